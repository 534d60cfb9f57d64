#!/usr/bin/env bash
# Every GPU check in one call, since device time is short (minutes a session).
#
#   bash benchmarks/gpu_session.sh prepare   # here, once: wheels the GPU image lacks -> .whl/
#   bash benchmarks/gpu_session.sh           # on the GPU machine (carry .whl; ~6 minutes)
#
# The GPU image has CUDA PyTorch, transformers, scipy, click, rich and pytest but not
# pydantic, so its wheels travel in .whl (ignored by git). Results land in $OUT: the CUDA
# runtime tests' log, the host link's measured rates and one gpu_validate JSON per
# workload, for docs/results-gpu.md.
set -uo pipefail
cd "$(dirname "$0")/.."

if [ "${1:-}" = "prepare" ]; then
    grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
    mkdir -p .whl
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d .whl pydantic==2.13.4 pydantic_core==2.46.4 annotated-types==0.7.0 \
        typing-inspection==0.4.2 typing_extensions==4.16.0
    ls .whl
    exit
fi

OUT=${OUT:-/tmp/slackswap-gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=src
if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site:src
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__,
'transformers', transformers.__version__)" | tee -a "$OUT/gpu.txt"

timeout 150 python3 -m pytest -q -rs -p no:cacheprovider tests/test_runtime_cuda.py 2>&1 \
    | tee "$OUT/cuda-tests.txt"
timeout 60 python3 benchmarks/link_bandwidth.py --hardware h200 2>&1 | tee "$OUT/link.txt"
# the runtime's per-call host costs, for benchmarks/host_costs_h200.json (host_work.py)
timeout 60 python3 benchmarks/host_work.py --measure-costs "$OUT/host_costs.json" 2>&1 \
    | tail -n 20
for workload in "gpt2-xl 12" "llama-7b 8"; do
    set -- $workload
    timeout 120 python3 benchmarks/gpu_validate.py --model "$1" --layers "$2" \
        --hardware h200 --steps 5 --out "$OUT/$1.json" 2>&1 | tee "$OUT/$1.txt"
done
for model in llama-7b gpt2-xl bert-large; do
    timeout 60 python3 benchmarks/runtime_overhead.py --model "$model" --layers 4 \
        --device cuda --steps 5 2>&1 | tee -a "$OUT/overhead.txt"
done
