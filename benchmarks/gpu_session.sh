#!/usr/bin/env bash
# Every GPU measurement of the project in one run of at most five minutes, packed into
# one archive.
#
# The machine: one CUDA GPU with 40 GB free or more (written for an NVIDIA H200, 141 GB,
# bf16), 8 CPU cores or more, 16 GB of host memory for pinned buffers, Python 3.12 with
# CUDA PyTorch (2.11 or newer), transformers 5.x, numpy, scipy, click, rich, hypothesis
# and pytest. pydantic and its dependencies may be missing there: `prepare` downloads
# their wheels into .whl/, and a run installs them when pydantic does not import. No
# network is needed during the run; .git is optional (pass COMMIT instead).
#
#   bash benchmarks/gpu_session.sh prepare        # wheels for pydantic etc. -> .whl/
#   COMMIT=<sha> OUT=<dir> bash benchmarks/gpu_session.sh
#   bash benchmarks/gpu_session.sh --cpu-smoke    # the same steps on a CPU, tiny models
#
# A run writes two files to $OUT: gpu-session.tar.gz (folder gpu-session/, laid out as
# docs/results-gpu/README.md describes) and gpu-session-summary.txt (the summary printed
# at the end). Parts, in order, each under a timeout and the clock: the CUDA tests;
# the runtime's host per-call costs; benchmarks/gpu_diag.py on gpt2-xl@12 and llama-7b@8
# (every strategy at 50%, traces, the memory checks); then, while time is left, the
# runtime's host work per step on this machine's CPU (benchmarks/host_work.py),
# bert-large@8 (keep-all and SlackSwap, traces), benchmarks/peers.py on gpt2-xl@12 and
# llama-7b@8 (the eager points; the compiled ones too when three minutes are left) and
# the host link's rates (benchmarks/link_bandwidth.py).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

if [ "${1:-}" = "prepare" ]; then
    exclude=$(git rev-parse --git-path info/exclude 2>/dev/null || echo .git/info/exclude)
    grep -qx '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >> "$exclude"
    mkdir -p .whl
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d .whl pydantic==2.13.4 pydantic_core==2.46.4 annotated-types==0.7.0 \
        typing-inspection==0.4.2 typing_extensions==4.16.0
    ls .whl
    exit
fi

SMOKE=0
[ "${1:-}" = "--cpu-smoke" ] && SMOKE=1
PYTHON=${PYTHON:-python3}
OUT=${OUT:-/tmp/slackswap-gpu}
SESSION_S=${SESSION_S:-300}  # the whole run, packing included
OPTIONAL_UNTIL_S=${OPTIONAL_UNTIL_S:-270}  # no optional part starts after this
PACK_S=10  # kept back for the summary and the archive
START=$SECONDS
mkdir -p "$OUT"
WORK=$(mktemp -d)/gpu-session
mkdir -p "$WORK"
export PYTHONUNBUFFERED=1 PYTHONPATH=$ROOT/src
if [ "$SMOKE" = 1 ]; then
    DEVICE=cpu STEPS=1
    DIAGS=("gpt2-xl-tiny - slackswap,offload-only,recompute-only")
    OPTIONAL_DIAGS=()
    PEERS=()
else
    DEVICE=cuda STEPS=5
    DIAGS=("gpt2-xl 12 all" "llama-7b 8 all")
    OPTIONAL_DIAGS=("bert-large 8 slackswap")
    PEERS=("gpt2-xl 12" "llama-7b 8")
fi

PEERS_MIN_S=35  # a peers.py run's eager points: build, profile, ten points
PEERS_EAGER="keep-all,hf-*,sac-*,save-on-cpu,offload,slackswap-0.*"

elapsed() { echo $((SECONDS - START)); }

# part NAME CAP_S MIN_S optional|required COMMAND...: run COMMAND under a timeout of
# CAP_S or what the clock leaves, whichever is less; skip it when less than MIN_S is
# left, or when it is optional and the optional parts' time is over. Output goes to
# the screen and $WORK/NAME.log; one line per part to $WORK/parts.txt.
part() {
    local name=$1 cap=$2 least=$3 kind=$4
    shift 4
    local now left limit rc
    now=$(elapsed)
    left=$((SESSION_S - PACK_S - now))
    if { [ "$kind" = optional ] && [ "$now" -ge "$OPTIONAL_UNTIL_S" ]; } || [ "$left" -lt "$least" ]; then
        echo "[${now}s] $name: skipped (${left}s left)" | tee -a "$WORK/parts.txt"
        return 0
    fi
    limit=$((cap < left ? cap : left))
    echo "[${now}s] $name: start (timeout ${limit}s)"
    timeout -k 5 "$limit" "$@" 2>&1 | tee "$WORK/$name.log"
    rc=${PIPESTATUS[0]}
    [ "$rc" = 124 ] && rc="124 (timed out after ${limit}s)"
    echo "[$(elapsed)s] $name: rc $rc, $(( $(elapsed) - now ))s" | tee -a "$WORK/parts.txt"
}

record_session() {
    local given=${COMMIT:-} head="" dirty=""
    if git rev-parse --git-dir > /dev/null 2>&1; then
        head=$(git rev-parse HEAD)
        dirty=$(git status --porcelain --untracked-files=no | wc -l)
    fi
    {
        echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
        echo "mode: $([ "$SMOKE" = 1 ] && echo cpu-smoke || echo gpu)"
        echo "commit (given): ${given:-none}"
        echo "commit (.git): ${head:-no .git}${dirty:+, $dirty changed tracked files}"
        echo "host: $(uname -srm), $(nproc) cores"
        nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader \
            2>/dev/null | sed 's/^/gpu: /'
        PYTHONPATH=$PYTHONPATH:$ROOT/benchmarks "$PYTHON" - <<'EOF'
from gpu_diag import versions
for k, v in versions().items():
    print(f"{k}: {v}")
EOF
    } > "$WORK/session.txt" 2>&1
    cat "$WORK/session.txt"
}

install_wheels() {
    if "$PYTHON" -c "import pydantic" 2> /dev/null; then
        return
    fi
    if ! compgen -G ".whl/*.whl" > /dev/null; then
        echo "pydantic does not import and .whl/ has no wheels: run 'prepare' and carry .whl"
        return
    fi
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site:$PYTHONPATH
}

diag() {  # diag optional|required MODEL LAYERS|- STRATEGIES|all
    local kind=$1 model=$2 layers=$3 strategies=$4 tag=$2
    local args=(--model "$model" --device "$DEVICE" --steps "$STEPS" --budget 0.5)
    if [ "$layers" != - ]; then
        tag=$model-$layers
        args+=(--layers "$layers")
    fi
    [ "$strategies" != all ] && args+=(--strategies "$strategies")
    part "diag-$tag" 90 30 "$kind" "$PYTHON" benchmarks/gpu_diag.py "${args[@]}" \
        --out "$WORK/$tag"
    if [ -d "$WORK/$tag" ]; then
        mv "$WORK/diag-$tag.log" "$WORK/$tag/diag.log"
    fi
}

main() {
    install_wheels
    record_session
    echo "[$(elapsed)s] set up"
    local cuda_tests=(tests/test_runtime_cuda.py
        "tests/test_compiled_offload.py::test_offloads_to_the_host_on_a_gpu_are_bit_identical")
    if [ "$SMOKE" = 1 ]; then  # the tests skip on a CPU: collect them (imports, names)
        part cuda-tests 60 10 required "$PYTHON" -m pytest -q --collect-only \
            -p no:cacheprovider "${cuda_tests[@]}"
        part host-costs 30 10 required "$PYTHON" benchmarks/host_work.py --help
    else
        part cuda-tests 100 30 required "$PYTHON" -m pytest -q -rs -p no:cacheprovider \
            "${cuda_tests[@]}"
        part host-costs 40 15 required "$PYTHON" benchmarks/host_work.py \
            --measure-costs "$WORK/host_costs.json"
    fi
    local spec
    for spec in "${DIAGS[@]}"; do
        # shellcheck disable=SC2086
        diag required $spec
    done
    # the runtime's host work on this machine's own CPU, the host the GPU waits for (the
    # CPU sessions predict it from a slower one), priced with the costs just measured
    if [ "$SMOKE" = 1 ]; then
        part host-work 60 20 optional "$PYTHON" benchmarks/host_work.py --layers 2 \
            --budget 0.9 --steps 1 --json "$WORK/host_work.json"
    else
        part host-work 45 25 optional "$PYTHON" benchmarks/host_work.py --steps 5 \
            --costs "$WORK/host_costs.json" --json "$WORK/host_work.json"
        # the same with the forward's ops at a GPU host's cost (NOTE [ops at a GPU
        # host's cost] in host_work.py): the figure the CPU sessions report beside it
        part host-work-cheap 40 20 optional "$PYTHON" benchmarks/host_work.py --steps 15 \
            --cheap-ops --costs "$WORK/host_costs.json" --json "$WORK/host_work_cheap.json"
    fi
    for spec in "${OPTIONAL_DIAGS[@]}"; do
        # shellcheck disable=SC2086
        diag optional $spec
    done
    if [ ! -f benchmarks/peers.py ]; then
        echo "[$(elapsed)s] peers: skipped (benchmarks/peers.py is not in this checkout)" \
            | tee -a "$WORK/parts.txt"
    elif [ "$SMOKE" = 1 ]; then
        part peers 60 10 optional "$PYTHON" benchmarks/peers.py --model gpt2-xl --layers 2 \
            --hardware h200 --steps 1 --device cpu --points keep-all,hf-every-1,slackswap-0.5 \
            --time-limit 30 --out "$WORK/peers"
    else
        local i=0 n=${#PEERS[@]} left share points limit
        for spec in "${PEERS[@]}"; do
            set -- $spec
            # the time left, shared by the runs left; the eager points alone (about half a
            # minute a run) unless there is time for the compiled ones too (minutes)
            left=$((SESSION_S - PACK_S - $(elapsed)))
            share=$((left / (n - i)))
            [ "$share" -lt "$PEERS_MIN_S" ] && share=$left
            [ "$share" -gt 240 ] && share=240
            i=$((i + 1))
            points=$PEERS_EAGER limit=$((share - 15))
            if [ "$share" -ge 180 ]; then  # no compiled point starts in the last 90 s
                points="*" limit=$((share - 90))
            fi
            part "peers-$1-$2" "$share" "$PEERS_MIN_S" optional "$PYTHON" benchmarks/peers.py \
                --model "$1" --layers "$2" --hardware h200 --steps 3 --device cuda \
                --points "$points" --time-limit "$limit" --out "$WORK/peers"
        done
    fi
    if [ "$SMOKE" = 1 ]; then
        part link 30 10 optional "$PYTHON" benchmarks/link_bandwidth.py --help
    else  # the link alone and both ways at once, for the hardware preset
        part link 30 15 optional "$PYTHON" benchmarks/link_bandwidth.py --hardware h200
    fi
}

summary() {
    echo "== SlackSwap GPU session"
    grep -E '^(date|mode|commit|gpu|torch|transformers|cuda):' "$WORK/session.txt"
    echo
    "$PYTHON" benchmarks/gpu_diag.py --summary "$WORK" 2>&1
    echo
    echo "cuda tests: $(grep -E '(passed|failed|error|skipped|collected|no tests)' \
        "$WORK/cuda-tests.log" 2> /dev/null | tail -n 1)"
    if [ -f "$WORK/host_costs.json" ]; then
        echo "host costs (us): $("$PYTHON" -c "import json, sys
print(json.load(open(sys.argv[1]))['costs_us'])" "$WORK/host_costs.json" 2>&1)"
    fi
    if [ -f "$WORK/host-work.log" ]; then
        echo "host work per step, on this host's CPU:"
        grep -E '(policy|packs|forward:|predicted)' "$WORK/host-work.log" | sed 's/^/  /'
    fi
    local pareto
    for pareto in "$WORK"/peers/peers-*.json; do
        [ -f "$pareto" ] || continue
        echo "$(basename "$pareto" .json):"
        "$PYTHON" -c "import json, sys
print('\n'.join('  ' + line for line in json.load(open(sys.argv[1]))['pareto_lines']))" \
            "$pareto" 2>&1
    done
    echo "parts:"
    sed 's/^/  /' "$WORK/parts.txt"
}

main 2>&1 | tee "$WORK/session.log"
summary 2>&1 | tee "$WORK/summary.txt"
cat "$WORK/summary.txt" >> "$WORK/session.log"
cp "$WORK/summary.txt" "$OUT/gpu-session-summary.txt"
tar -czf "$OUT/gpu-session.tar.gz" -C "$(dirname "$WORK")" gpu-session
echo "[$(elapsed)s] $OUT/gpu-session.tar.gz: $(du -h "$OUT/gpu-session.tar.gz" | cut -f1)," \
    "$(tar -tzf "$OUT/gpu-session.tar.gz" | wc -l) entries"
