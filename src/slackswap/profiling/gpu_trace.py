"""A step's kernel times from a ``torch.profiler`` chrome trace, mapped onto a profile's
ops: the measured time of each op, and a profile that replays the traced step in the
simulator on any machine. A trace is JSON: nothing here needs torch.

NOTE [kernels to ops]
    Each GPU event of a trace (kernel, memset, copy) carries the ``External id`` of the
    host op that launched it; where one carries none, the CUDA runtime call with its
    ``correlation`` id does. Host ops nest (``aten::linear`` > ``aten::matmul`` >
    ``aten::mm``), and a profile records ops where the dispatcher runs them, below
    autograd and composite ops, so an event belongs to the outermost op of its stack whose
    name a profile op has (``aten::mm``, not ``aten::linear``; ``aten::cumsum``, not the
    ``aten::_to_copy`` it calls); every fused attention kernel (flash, memory-efficient,
    cuDNN, the analytic trace's ``slackswap::fused_attention``) is one name. The events
    one such op launched on the compute stream (the stream with the most kernels) make
    one trace op, whose time is the sum of their durations. Weight gradients that
    autograd adds into an existing ``.grad`` (``AccumulateGrad``: every step after the
    first when gradients are zeroed, not freed) make trace ops of their own, which no
    profile op matches: the profile records a first step.

    The step is what the ``STEP_FORWARD`` and ``STEP_BACKWARD`` annotations span
    (``benchmarks/gpu_diag.py`` records them), by the host time of the launching op;
    without them, ops under autograd's engine are backward and the ops before the first
    of them forward. GPU work launched outside the step (``zero_grad``) is left out.
    Trace ops and the profile's kernel-launching ops are then aligned per phase by name,
    in order (difflib's matching blocks, without its junk heuristic), so ops one side has
    and the other has not (the checks a real step makes of its mask's values, which a
    fake trace cannot; the masks a fake trace builds instead) stay unmatched and shift
    nothing else.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from difflib import SequenceMatcher
from pathlib import Path
from typing import Any

from slackswap.core.jsonio import parse_json, read_file
from slackswap.core.profile import OpRecord, Phase, StepProfile
from slackswap.errors import InputError

__all__ = ["KernelTrace", "TraceOp", "Launch", "read_trace", "trace_ops", "match_ops",
           "op_key", "measured_profile", "matched_seconds", "MIN_MATCHED"]

_GPU = ("kernel", "gpu_memset", "gpu_memcpy")
_OP_NAME = re.compile(r"^\w+::\w+$")  # "aten::addmm": an op, not an autograd node
ACCUMULATE = "AccumulateGrad"
# The least share of the step's kernel time the matched ops must hold for a trace to
# be taken as the profile's step: a trace of another model or batch matches little
# (gpt2-xl@12's keep-all trace against its analytic profile: 0.99).
MIN_MATCHED = 0.9


def op_key(name: str) -> str:
    """The name a trace op and a profile op are matched by: ``aten::add_``,
    ``aten.add.Tensor`` -> ``add``; every fused attention op -> ``attention`` or
    ``attention_backward``."""
    if "::" in name:
        op = name.split("::", 1)[1]
    else:
        parts = name.split(".")
        op = parts[1] if len(parts) > 1 else parts[0]
    if "attention" in op and any(k in op for k in ("scaled_dot_product", "fused_attention",
                                                   "flash", "efficient", "cudnn")):
        return "attention_backward" if "backward" in op else "attention"
    return op.rstrip("_") or op


@dataclass(frozen=True)
class Launch:
    """One GPU event of the step on the compute stream: when it ran (us, trace clock),
    the phase of the host op that launched it, and that op's stack of host ops,
    outermost first, as (External id, name)."""

    start_us: float
    dur_us: float
    phase: Phase
    stack: tuple[tuple[int, str], ...]
    name: str


@dataclass(frozen=True)
class KernelTrace:
    """The step's GPU events on its compute stream, and the figures of the whole trace
    a replay is judged by (seconds)."""

    launches: list[Launch]
    device: str  # the GPU's name, as the trace gives it ("" if it does not)
    compute_stream: int
    busy_s: float  # the union of the step's events on the compute stream
    kernel_s: float  # the sum of their durations
    span_s: float  # first start to last end of the step's GPU events, every stream
    outside_s: float  # GPU time of work launched outside the step (zero_grad)
    side_streams: dict[int, tuple[int, float, int]]  # stream -> events, seconds, bytes


@dataclass(frozen=True)
class TraceOp:
    """Host op instance whose kernels ran in the step: its name (``aten::addmm``, or
    ``AccumulateGrad``), phase, key (``op_key``), GPU time and kernel count, and the
    stack its first kernel was launched from."""

    name: str
    key: str
    phase: Phase
    start_us: float
    seconds: float
    kernels: int
    stack: tuple[str, ...]


# The most a trace may hold, uncompressed: a step's chrome trace of a large model is a
# few hundred MB; past this it is not one step, and holding it would exhaust memory.
MAX_TRACE_BYTES = 1024 * 2**20


def _load(source: str | Path | Mapping[str, Any]) -> Mapping[str, Any]:
    """A trace's JSON, read as every file is (NOTE [files] in ``slackswap.core.jsonio``):
    a FIFO or a device is refused, never waited on or read without end, and a ``.gz``
    that inflates past ``MAX_TRACE_BYTES`` is refused."""
    if isinstance(source, Mapping):
        return source
    path = Path(source)
    text = read_file(path, "trace", MAX_TRACE_BYTES, compressed=path.suffix == ".gz")
    trace = parse_json(text, f"the trace {path}")
    if not isinstance(trace, dict):
        raise InputError(f"the trace {path} is not a torch.profiler chrome trace (a JSON "
                         "object with traceEvents); pass one (.json or .json.gz)")
    return trace


def _stacks(cpu: list[dict[str, Any]]) -> dict[int, tuple[tuple[int, str], ...]]:
    """Each host op's stack (itself last), by External id: ops nest by time per thread."""
    out: dict[int, tuple[tuple[int, str], ...]] = {}
    by_thread: dict[Any, list[dict[str, Any]]] = defaultdict(list)
    for e in cpu:
        by_thread[e.get("tid")].append(e)
    for events in by_thread.values():
        events.sort(key=lambda e: (e["ts"], -e["dur"]))
        open_: list[tuple[float, tuple[tuple[int, str], ...]]] = []  # (end, stack)
        for e in events:
            end = e["ts"] + e["dur"]
            while open_ and open_[-1][0] < end - 1e-3:
                open_.pop()
            stack = (open_[-1][1] if open_ else ()) + ((e["args"]["External id"], e["name"]),)
            out[e["args"]["External id"]] = stack
            open_.append((end, stack))
    return out


def _check_times(events: Iterable[Mapping[str, Any]]) -> None:
    """Each event's start and duration are numbers, finite, the duration not negative:
    a NaN, an infinity or a negative time would become an op's time in a profile (which
    a profile file refuses), and no step's (NOTE [files])."""
    for e in events:
        ts, dur = e.get("ts"), e.get("dur")
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool)
                   and math.isfinite(v) for v in (ts, dur)) or dur < 0:
            raise InputError(f"the trace's event {str(e.get('name'))[:60]!r} has ts {ts!r} "
                             f"and dur {dur!r}: not a time; pass a torch.profiler chrome "
                             "trace")


def _union_s(spans: Iterable[tuple[float, float]]) -> float:
    busy, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b > end:
            busy += b - max(a, end)
            end = b
    return busy / 1e6


def read_trace(source: str | Path | Mapping[str, Any]) -> KernelTrace:
    """The step's GPU events of a ``torch.profiler`` chrome trace (a path to ``.json``
    or ``.json.gz``, or the loaded JSON), each with the host op stack that launched it
    (NOTE [kernels to ops])."""
    trace = _load(source)
    try:
        return _kernel_trace(trace)
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as e:
        # an event without the fields a torch.profiler event has ("ts", "dur", "args")
        # or with others in their place: the file is not such a trace, said in one line
        where = source if isinstance(source, (str, Path)) else "the trace"
        raise InputError(f"{where}: not a torch.profiler chrome trace ({type(e).__name__}: "
                         f"{str(e)[:100]}); pass one (.json or .json.gz)") from None


def _kernel_trace(trace: Mapping[str, Any]) -> KernelTrace:
    """:func:`read_trace` of the loaded JSON."""
    events = [e for e in trace.get("traceEvents", ()) if isinstance(e, dict)
              and e.get("ph") == "X" and isinstance(e.get("args", {}), dict)]
    cpu = [e for e in events if e.get("cat") == "cpu_op"
           and e.get("args", {}).get("External id") is not None]
    gpu = [e for e in events if e.get("cat") in _GPU]
    if not gpu:
        raise InputError("the trace holds no GPU kernels; trace a step on a GPU with "
                         "ProfilerActivity.CUDA")
    _check_times(cpu + gpu)
    stacks = _stacks(cpu)
    by_correlation = {e["args"]["correlation"]: e["args"].get("External id") for e in events
                      if e.get("cat") in ("cuda_runtime", "cuda_driver")
                      and "correlation" in e["args"]}
    start_of = {e["args"]["External id"]: e["ts"] for e in cpu}
    notes = {e["name"]: (e["ts"], e["ts"] + e["dur"]) for e in events
             if e.get("cat") == "user_annotation" and e["name"] in ("STEP_FORWARD",
                                                                    "STEP_BACKWARD")}

    def phase_of(stack: tuple[tuple[int, str], ...]) -> Phase | None:
        if not stack:
            return None
        if notes:
            at = start_of[stack[0][0]]
            for name, phase in (("STEP_FORWARD", "forward"), ("STEP_BACKWARD", "backward")):
                if name in notes and notes[name][0] <= at <= notes[name][1]:
                    return phase  # type: ignore[return-value]
            return None
        return "backward" if any("autograd::engine" in n for _, n in stack) else "forward"

    counts: dict[Any, int] = defaultdict(int)
    for e in gpu:
        counts[e["args"].get("stream")] += e.get("cat") == "kernel"
    compute = max(counts, key=counts.__getitem__)
    launches: list[Launch] = []
    inside: list[dict[str, Any]] = []
    outside = 0.0
    side: dict[int, list[float]] = defaultdict(lambda: [0, 0.0, 0])
    for e in sorted(gpu, key=lambda e: e["ts"]):
        args = e["args"]
        ext = args.get("External id")
        if ext not in stacks:
            ext = by_correlation.get(args.get("correlation"))
        stack = stacks.get(ext, ())
        phase = phase_of(stack)
        if phase is None and (notes or not stack):
            outside += e["dur"] / 1e6
            continue
        inside.append(e)
        if args.get("stream") != compute:
            row = side[args.get("stream")]
            row[0] += 1
            row[1] += e["dur"] / 1e6
            row[2] += int(args.get("bytes", 0) or 0)
            continue
        launches.append(Launch(e["ts"], e["dur"], phase or "forward", stack, e["name"]))
    if not notes:  # ops before the first backward one are forward; none after the last
        last = max((i for i, k in enumerate(launches) if k.phase == "backward"), default=-1)
        launches = launches[:last + 1] if last >= 0 else launches
    if not launches:
        raise InputError("the trace holds no kernels inside its step's STEP_FORWARD and "
                         "STEP_BACKWARD annotations; trace one forward and backward")
    devices = trace.get("deviceProperties") or [{}]
    return KernelTrace(
        launches=launches, device=str(devices[0].get("name", "")), compute_stream=compute,
        busy_s=_union_s((k.start_us, k.start_us + k.dur_us) for k in launches),
        kernel_s=sum(k.dur_us for k in launches) / 1e6,
        span_s=(max(e["ts"] + e["dur"] for e in inside) - min(e["ts"] for e in inside)) / 1e6,
        outside_s=outside,
        side_streams={s: (int(r[0]), r[1], int(r[2])) for s, r in side.items()})


def _anchor(stack: tuple[tuple[int, str], ...], known: set[str]) -> tuple[int, str]:
    """The host op a kernel belongs to (NOTE [kernels to ops])."""
    for ext, name in stack:
        if ACCUMULATE in name:
            return ext, ACCUMULATE
    ops = [(ext, name) for ext, name in stack if _OP_NAME.match(name)]
    for ext, name in ops:
        if op_key(name) in known:
            return ext, name
    return ops[0] if ops else (stack[-1] if stack else (-1, "?"))


def trace_ops(trace: KernelTrace, known: Iterable[str]) -> list[TraceOp]:
    """The trace's ops in the order their first kernels ran, grouped by the host op each
    kernel belongs to among ops whose ``op_key`` is in ``known`` (NOTE [kernels to ops])."""
    names = set(known)
    groups: dict[int, list[Launch]] = {}
    anchors: dict[int, str] = {}
    for k in trace.launches:
        ext, name = _anchor(k.stack, names)
        groups.setdefault(ext, []).append(k)
        anchors[ext] = name
    ops = [TraceOp(name=anchors[ext], key=ACCUMULATE if anchors[ext] == ACCUMULATE
                   else op_key(anchors[ext]), phase=ks[0].phase, start_us=ks[0].start_us,
                   seconds=sum(k.dur_us for k in ks) / 1e6, kernels=len(ks),
                   stack=tuple(n for _, n in ks[0].stack))
           for ext, ks in groups.items()]
    return sorted(ops, key=lambda o: o.start_us)


def _launches_kernels(op: OpRecord) -> bool:
    return op.category != "free"


def match_ops(profile: StepProfile, trace: KernelTrace) -> tuple[list[TraceOp], list[int | None]]:
    """The trace's ops and, for each, the index of the profile op it is (None: no profile
    op), aligned per phase by name in order (NOTE [kernels to ops])."""
    known = {op_key(op.name) for op in profile.ops if _launches_kernels(op)}
    ops = trace_ops(trace, known)
    matched: list[int | None] = [None] * len(ops)
    for phase in ("forward", "backward"):
        mine = [i for i, o in enumerate(ops) if o.phase == phase]
        theirs = [op.index for op in profile.ops if op.phase == phase and _launches_kernels(op)]
        a = [ops[i].key for i in mine]
        b = [op_key(profile.ops[j].name) for j in theirs]
        for block in SequenceMatcher(None, a, b, autojunk=False).get_matching_blocks():
            for n in range(block.size):
                matched[mine[block.a + n]] = theirs[block.b + n]
    return ops, matched


def measured_profile(profile: StepProfile, trace: KernelTrace | str | Path) -> StepProfile:
    """``profile`` with each op's time as the traced step ran it: the GPU time of the
    kernels its trace op launched (NOTE [kernels to ops]). A trace op no profile op
    matches adds its time to the matched op before it in its phase (after it, where
    none is before), so the step's kernel time is kept whole; a profile op no trace op
    matches ran no kernel in the traced step and takes no time. The ops, tensors and
    mode stay the profile's: a profile traced on fake tensors keeps its structure, and
    the runtime treats it as before (NOTE [value-dependent masks] in
    ``slackswap.profiling.kernels``)."""
    if not isinstance(trace, KernelTrace):
        trace = read_trace(trace)
    ops, matched = match_ops(profile, trace)
    total = sum(o.seconds for o in ops)
    if not total > 0:
        raise InputError("the trace's kernels took no time; trace a step on a GPU")
    share = sum(o.seconds for o, m in zip(ops, matched, strict=True) if m is not None) / total
    if share < MIN_MATCHED:
        raise InputError(f"only {share:.0%} of the trace's kernel time matches the profile's "
                         f"ops ({profile.model}); trace the step the profile describes, same "
                         "model, batch and sequence length")
    times = [0.0] * len(profile.ops)
    for phase in ("forward", "backward"):
        pending = 0.0
        last: int | None = None
        for o, m in zip(ops, matched, strict=True):
            if o.phase != phase:
                continue
            if m is None:
                if last is None:
                    pending += o.seconds
                else:
                    times[last] += o.seconds
                continue
            times[m] += o.seconds + pending
            pending, last = 0.0, m
    updated = [op.model_copy(update={"time_s": t}) for op, t in zip(profile.ops, times,
                                                                     strict=True)]
    return profile.model_copy(update={"ops": updated})


def matched_seconds(ops: Sequence[TraceOp], matched: Sequence[int | None]) -> dict[int, float]:
    """GPU seconds per profile op index, of the trace ops matched to it."""
    out: dict[int, float] = defaultdict(float)
    for o, m in zip(ops, matched, strict=True):
        if m is not None:
            out[m] += o.seconds
    return dict(out)
