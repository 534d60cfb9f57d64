"""The analytic cost model against a step measured on a GPU, op by op.

    python benchmarks/fidelity_ops.py                      # the table, printed
    python benchmarks/fidelity_ops.py --write              # and into docs/fidelity.md
    python benchmarks/fidelity_ops.py --profile-out P.json # the traced step as a profile

It reads a ``torch.profiler`` chrome trace of one step (by default the keep-all step of
gpt2-xl@12 measured on an NVIDIA H200 on 2026-12-04, ``docs/results-gpu/traces/``), maps
each kernel to the ATen op that launched it and that op to the op of SlackSwap's
analytic profile of the same workload on the same hardware preset
(``slackswap.profiling.gpu_trace``, NOTE [kernels to ops]), and prints, by op class
(matmuls by shape, attention forward and backward, memory-bound ops by bytes moved,
copies, reductions, the loss), the measured kernel time beside the analytic price and,
with ``--measured-profile``, a measured-mode profile's time of the same ops.
``--profile-out`` writes the analytic profile with the trace's times (the H200 step,
replayable by ``slackswap simulate`` on any machine) and prints its simulated keep-all
step beside the trace's own figures.
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

import slackswap
from slackswap.core.hardware import Hardware, load_hardware
from slackswap.core.jsonio import atomic_write_text
from slackswap.core.plan import Plan
from slackswap.core.profile import OpRecord, StepProfile
from slackswap.errors import InputError
from slackswap.models import with_layers
from slackswap.profiling.gpu_trace import (
    ACCUMULATE,
    KernelTrace,
    TraceOp,
    match_ops,
    measured_profile,
    op_key,
    read_trace,
)
from slackswap.reproduce import cached_profile

ROOT = Path(__file__).resolve().parents[1]
TRACES = ROOT / "docs" / "results-gpu" / "traces"
TRACE = TRACES / "gpt2-xl-12-50-trace-keep-all.json.gz"
DOC = ROOT / "docs" / "fidelity.md"
COMMAND = "python benchmarks/fidelity_ops.py --write"
BEGIN = "<!-- op by op: written by benchmarks/fidelity_ops.py --write -->"
END = "<!-- end of op by op -->"

LOSS = {"_log_softmax", "_log_softmax_backward_data", "nll_loss_forward", "nll_loss_backward",
        "nll_loss2d_forward", "nll_loss2d_backward", "cross_entropy_loss"}
COPIES = {"_to_copy", "clone", "copy", "cat", "constant_pad_nd", "stack", "index_select"}
REDUCTIONS = {"sum", "mean", "cumsum", "all", "any", "amax", "amin", "max", "min", "norm",
              "native_layer_norm", "native_layer_norm_backward", "_softmax",
              "_softmax_backward_data", "_fused_rms_norm", "_fused_rms_norm_backward",
              "embedding_dense_backward"}
# the cost model's rows of bandwidth efficiency by bytes moved (every preset's)
BUCKETS = ((1e8, ">= 100 MB"), (1e7, "10-100 MB"), (1e6, "1-10 MB"), (0.0, "< 1 MB"))
LAYER = re.compile(r"^(.*?\.)?(h|layers|layer)\.\d+\.")


def bucket(nbytes: float) -> str:
    return next(label for low, label in BUCKETS if nbytes >= low)


def role(module: str) -> str:
    """The module's path inside its block (``attn.c_attn``), or its path outside one."""
    return LAYER.sub("", module) or "(top)"


def matmul_shape(op: OpRecord, profile: StepProfile) -> str:
    """M x N x K of a matmul: its output's rows and columns, K from its FLOPs."""
    out = profile.tensors[op.outputs[0]].shape if op.outputs else []
    m = 1
    for d in out[:-1]:
        m *= d
    n = out[-1] if out else 1
    k = round(op.flops / (2 * m * n)) if m and n else 0
    return f"{m}x{n}x{k}"


def op_class(op: OpRecord, profile: StepProfile) -> tuple[str, str]:
    """(class, row) of a profile op in the table."""
    key, moved = op_key(op.name), op.bytes_read + op.bytes_written
    if op.category == "matmul":
        return "matmul", f"{role(op.module)} {op.phase} {matmul_shape(op, profile)}"
    if op.category.startswith("attention"):
        return "attention", f"{op.category.replace('_', ' ')}"
    if key in LOSS:
        return "loss", key
    if key in COPIES:
        return "copy", f"{key}, {bucket(moved)}"
    if key in REDUCTIONS:
        return "reduction", f"{key} {op.phase}, {bucket(moved)}"
    return "memory-bound", f"{bucket(moved)}: {key}"


def trace_class(op: TraceOp) -> tuple[str, str]:
    """(class, row) of a trace op no profile op matches."""
    if op.key == ACCUMULATE:
        return "not in the profile", "gradient accumulation into .grad (AccumulateGrad)"
    return "not in the profile", f"{op.key} ({op.phase})"


@dataclass
class Row:
    cls: str
    label: str
    ops: int = 0
    measured_s: float = 0.0
    analytic_s: float = 0.0
    mode_s: float | None = None
    flops: float = 0.0
    moved: float = 0.0
    idx: list[int] = field(default_factory=list)

    @property
    def ratio(self) -> float | None:
        return self.analytic_s / self.measured_s if self.measured_s else None


CLASS_ORDER = ("matmul", "attention", "memory-bound", "copy", "reduction", "loss",
               "not in the profile", "not in the trace")


def table_rows(profile: StepProfile, trace: KernelTrace,
               mode: StepProfile | None = None) -> list[Row]:
    """One row per op class and shape (or bytes moved): the trace's kernel time, the
    analytic price and, with ``mode``, that measured-mode profile's time of the same
    trace ops."""
    ops, matched = match_ops(profile, trace)
    mode_of: list[int | None] = match_ops(mode, trace)[1] if mode is not None else []
    rows: dict[tuple[str, str], Row] = {}

    def row(key: tuple[str, str]) -> Row:
        return rows.setdefault(key, Row(*key))

    seen: set[int] = set()
    for i, (o, m) in enumerate(zip(ops, matched, strict=True)):
        r = row(op_class(profile.ops[m], profile) if m is not None else trace_class(o))
        r.measured_s += o.seconds
        if mode is not None and mode_of[i] is not None:
            r.mode_s = (r.mode_s or 0.0) + mode.ops[mode_of[i]].time_s
        if m is None:
            r.ops += 1
            continue
        p = profile.ops[m]
        r.ops += 1
        r.analytic_s += p.time_s
        r.flops += p.flops
        r.moved += p.bytes_read + p.bytes_written
        seen.add(m)
    for p in profile.ops:
        if p.category != "free" and p.index not in seen:
            r = row(("not in the trace", f"{op_key(p.name)} ({p.phase})"))
            r.ops += 1
            r.analytic_s += p.time_s
    return sorted(rows.values(), key=lambda r: (CLASS_ORDER.index(r.cls), -r.measured_s,
                                                -r.analytic_s))


def _ms(s: float | None) -> str:
    return "-" if s is None else f"{s * 1e3:.2f}"


def _rate(r: Row) -> str:
    if not r.measured_s or not r.ops:
        return "-"
    if r.cls in ("matmul", "attention"):
        return f"{r.flops / r.measured_s / 1e12:.0f} TFLOP/s"
    return f"{r.moved / r.measured_s / 1e12:.2f} TB/s" if r.moved else "-"


def _size(r: Row) -> str:
    if not r.ops or r.cls.startswith("not in"):
        return "-"
    if r.cls in ("matmul", "attention"):
        return f"{r.flops / r.ops / 1e9:.1f} GFLOP"
    return f"{r.moved / r.ops / 1e6:.1f} MB"


def render(rows: list[Row], with_mode: bool) -> list[str]:
    header = ["class", "row", "ops", "each", "measured (ms)", "analytic (ms)",
              "analytic / measured", "achieved (measured)"]
    if with_mode:
        header.insert(6, "measured mode (ms)")
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in rows:
        cells = [r.cls, r.label, str(r.ops), _size(r), _ms(r.measured_s), _ms(r.analytic_s),
                 f"{r.ratio:.2f}" if r.ratio is not None else "-", _rate(r)]
        if with_mode:
            cells.insert(6, _ms(r.mode_s))
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def class_totals(rows: list[Row]) -> dict[str, Row]:
    out: dict[str, Row] = {}
    for r in rows:
        t = out.setdefault(r.cls, Row(r.cls, "all"))
        t.ops += r.ops
        t.measured_s += r.measured_s
        t.analytic_s += r.analytic_s
        t.flops += r.flops
        t.moved += r.moved
        if r.mode_s is not None:
            t.mode_s = (t.mode_s or 0.0) + r.mode_s
    return out


@dataclass
class Figures:
    """What one run of the script computes."""

    name: str
    hardware: Hardware
    trace_path: Path
    profile: StepProfile
    trace: KernelTrace
    rows: list[Row]
    analytic_step_s: float
    replay_step_s: float
    with_mode: bool


def compute(trace_path: Path, model: str, layers: int | None, hardware: str,
            mode_path: Path | None = None) -> tuple[Figures, StepProfile]:
    """The table's rows and the step figures; the trace's measured profile."""
    name = with_layers(model, layers) if layers else model
    hw = load_hardware(hardware)
    profile = cached_profile(name, hw)
    trace = read_trace(trace_path)
    mode = StepProfile.load(mode_path) if mode_path else None
    rows = table_rows(profile, trace, mode)
    analytic = slackswap.simulate(profile, Plan.keep_all(profile), hw).step_time_s
    replayed = measured_profile(profile, trace)
    replay = slackswap.simulate(replayed, Plan.keep_all(replayed), hw).step_time_s
    return Figures(name, hw, trace_path, profile, trace, rows, analytic, replay,
                   mode is not None), replayed


def summary(f: Figures) -> list[str]:
    t = f.trace
    kernel = sum(r.measured_s for r in f.rows)
    return [
        f"- Trace `{_rel(f.trace_path)}`: the step's kernels on the compute stream (stream "
        f"{t.compute_stream}) sum to {t.kernel_s * 1e3:.1f} ms (busy {t.busy_s * 1e3:.1f} ms); "
        f"its GPU work spans {t.span_s * 1e3:.1f} ms; {t.outside_s * 1e3:.2f} ms of kernels "
        "launched after the step (zero_grad) are left out.",
        f"- Mapped to ops: {kernel * 1e3:.1f} ms; the analytic profile ({f.name}, preset "
        f"`{f.hardware.name}`, {len(f.profile.ops)} ops) prices the same step at "
        f"{sum(r.analytic_s for r in f.rows) * 1e3:.1f} ms of ops and simulates it keep-all "
        f"at {f.analytic_step_s * 1e3:.1f} ms "
        f"({f.analytic_step_s / t.span_s - 1:+.0%} against the traced span).",
        f"- The trace replayed (`--profile-out`: the analytic profile with each op's "
        f"measured kernel time) simulates keep-all at {f.replay_step_s * 1e3:.1f} ms "
        f"({f.replay_step_s / t.span_s - 1:+.1%} against the span: the simulator leaves "
        "out the compute stream's idle gaps between kernels).",
    ]


def _rel(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


def report(f: Figures) -> str:
    totals = class_totals(f.rows)
    lines = ["By class:", ""] + render(list(totals.values()), f.with_mode) + [
        "", "By shape and size:", ""] + render(f.rows, f.with_mode) + [""] + summary(f)
    return "\n".join(lines)


def write_section(text: str, doc: Path = DOC) -> None:
    """Put ``text`` between the markers in ``doc`` (at its end, the first time)."""
    old = doc.read_text()
    block = f"{BEGIN}\n{text.rstrip()}\n{END}\n"
    if BEGIN in old and END in old:
        head, rest = old.split(BEGIN, 1)
        new = head + block + rest.split(END, 1)[1].lstrip("\n")
    else:
        new = old.rstrip("\n") + "\n\n" + block
    atomic_write_text(doc, new)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", type=Path, default=TRACE, help="a torch.profiler trace")
    parser.add_argument("--model", default="gpt2-xl")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hardware", default="h200")
    parser.add_argument("--measured-profile", type=Path,
                        help="a measured-mode profile of the same step (its per-op times "
                             "become a column)")
    parser.add_argument("--profile-out", type=Path,
                        help="write the analytic profile with the trace's kernel times here")
    parser.add_argument("--write", action="store_true", help=f"also write its section of {DOC}")
    args = parser.parse_args(argv)
    figures, replayed = compute(args.trace, args.model, args.layers, args.hardware,
                                args.measured_profile)
    text = report(figures)
    print(text)
    if args.profile_out:
        replayed.save(args.profile_out)
        print(f"\nwrote {args.profile_out}: simulated keep-all {figures.replay_step_s * 1e3:.1f}"
              f" ms, the trace's span {figures.trace.span_s * 1e3:.1f} ms", file=sys.stderr)
    if args.write:
        write_section(text)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except InputError as err:
        sys.exit(f"error: {err}")
