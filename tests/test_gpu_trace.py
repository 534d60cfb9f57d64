"""``slackswap.profiling.gpu_trace``: kernels of a ``torch.profiler`` trace mapped onto a
profile's ops (NOTE [kernels to ops]) on made-up traces of a tiny model's step, and the
H200 keep-all step of gpt2-xl@12 committed in ``docs/results-gpu/traces/``, replayed in
the simulator against the trace's own figures."""

from __future__ import annotations

import importlib.util
import json
import math
import re
import sys
from pathlib import Path
from typing import Any

import pytest

import slackswap
from slackswap.core.hardware import load_hardware
from slackswap.core.plan import Plan
from slackswap.core.profile import StepProfile
from slackswap.errors import InputError
from slackswap.models import with_layers
from slackswap.profiling.gpu_trace import (
    match_ops,
    measured_profile,
    op_key,
    read_trace,
)
from slackswap.reproduce import cached_profile

TRACES = Path(__file__).parents[1] / "docs" / "results-gpu" / "traces"


@pytest.fixture(scope="module")
def tiny() -> StepProfile:
    return cached_profile("gpt2-xl-tiny", load_hardware("h200"))


def _trace_name(name: str) -> str:
    """How torch.profiler names the CPU op a profile op is (``aten.addmm.default`` ->
    ``aten::addmm``; the fused attention stand-in -> the flash kernel's op)."""
    if "fused_attention" in name:
        return ("aten::_scaled_dot_product_flash_attention_backward" if "backward" in name
                else "aten::_scaled_dot_product_flash_attention")
    ns, op = name.split(".")[:2]
    return f"{ns}::{op}"


class Trace:
    """A made-up chrome trace: host ops on a forward and an autograd thread, each with
    its kernels on stream 7, GPU time advancing kernel by kernel."""

    def __init__(self) -> None:
        self.events: list[dict] = []
        self.ext = 0
        self.cpu_ts = 0.0
        self.gpu_ts = 0.0

    def op(self, name: str, kernels_us: list[float], tid: int, parent: str | None = None,
           by_correlation: bool = False, inner: str | None = None) -> None:
        """Host op ``name`` (inside ``parent``, when given) launching one kernel per
        entry of ``kernels_us``, the first from op ``inner`` inside it, when given (as
        ``aten::cumsum`` converts its input by ``aten::_to_copy``); ``by_correlation``:
        the kernels carry no External id, only the runtime call's correlation id does."""
        start = self.cpu_ts
        if parent is not None:
            self.ext += 1
            self.events.append({"ph": "X", "cat": "cpu_op", "name": parent, "tid": tid,
                                "ts": start, "dur": 10.0, "args": {"External id": self.ext}})
        self.ext += 1
        ext = self.ext
        self.events.append({"ph": "X", "cat": "cpu_op", "name": name, "tid": tid,
                            "ts": start + 1, "dur": 8.0, "args": {"External id": ext}})
        launcher = ext
        if inner is not None:
            self.ext += 1
            launcher = self.ext
            self.events.append({"ph": "X", "cat": "cpu_op", "name": inner, "tid": tid,
                                "ts": start + 1.5, "dur": 1.0,
                                "args": {"External id": launcher}})
        for k, dur in enumerate(kernels_us):
            corr = ext * 100 + k
            self.events.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel",
                                "tid": tid, "ts": start + 2 + k, "dur": 0.5,
                                "args": {"External id": launcher, "correlation": corr}})
            args = {"stream": 7, "correlation": corr}
            if not by_correlation:
                args["External id"] = launcher
            launcher = ext
            self.events.append({"ph": "X", "cat": "kernel", "name": f"k_{name}",
                                "ts": self.gpu_ts, "dur": dur, "args": args})
            self.gpu_ts += dur + 1.0
        self.cpu_ts += 20.0

    def annotate(self, name: str, start: float, end: float) -> None:
        self.events.append({"ph": "X", "cat": "user_annotation", "name": name, "tid": 1,
                            "ts": start, "dur": end - start, "args": {"External id": 0}})

    def json(self) -> dict:
        return {"traceEvents": self.events}


def _step(profile: StepProfile, skip: frozenset[int] = frozenset(),
          extra_after: dict[int, tuple[str, float]] | None = None,
          zero_grad: bool = False) -> tuple[dict, dict[int, float]]:
    """A trace of ``profile``'s step: op i's kernel runs 1 + i/10 us (ops in ``skip``
    launch none); after op i, ``extra_after[i]`` (a host op no profile op is) launches
    one kernel. Returns the trace and each op's kernel time."""
    extra_after = extra_after or {}
    t = Trace()
    times: dict[int, float] = {}
    fwd_start = t.cpu_ts
    bwd_start = None
    for op in profile.ops:
        if op.phase == "backward" and bwd_start is None:
            t.annotate("STEP_FORWARD", fwd_start, t.cpu_ts - 1)
            bwd_start = t.cpu_ts
        tid = 1 if op.phase == "forward" else 2
        if op.category != "free" and op.index not in skip:
            times[op.index] = 1 + op.index / 10
            parent = ("autograd::engine::evaluate_function: Node" if op.phase == "backward"
                      else "aten::linear" if op.category == "matmul" else None)
            # every third op's kernel is found by its correlation id only
            name = _trace_name(op.name)
            if name == "aten::cumsum":  # two kernels, one launched by an op it calls
                t.op(name, [0.5, times[op.index] - 0.5], tid, inner="aten::_to_copy")
            else:
                t.op(name, [times[op.index]], tid, parent, by_correlation=op.index % 3 == 0)
        if op.index in extra_after:
            name, us = extra_after[op.index]
            t.op(name, [us], tid, "torch::autograd::AccumulateGrad"
                 if op.phase == "backward" else None)
    t.annotate("STEP_BACKWARD", bwd_start, t.cpu_ts)
    if zero_grad:
        t.op("aten::zero_", [50.0], 1)
    return t.json(), times


def test_every_kernel_lands_on_its_own_op(tiny: StepProfile) -> None:
    trace, times = _step(tiny)
    replayed = measured_profile(tiny, trace)
    assert [op.time_s for op in replayed.ops] == pytest.approx(
        [times.get(op.index, 0.0) / 1e6 for op in tiny.ops])
    assert replayed.tensors == tiny.tensors and replayed.mode == tiny.mode


def test_unmatched_kernels_join_the_op_before_and_missing_ops_take_no_time(
        tiny: StepProfile) -> None:
    """A mask check in forward and a gradient accumulation in backward, which the
    profile has not, add their time to the op before them; ops the trace ran no kernel
    for take none; the zero_grad after the step is left out."""
    kernels = [op.index for op in tiny.ops if op.category != "free"]
    first_fwd = kernels[3]
    first_bwd = next(i for i in kernels if tiny.ops[i].phase == "backward")
    last_bwd = kernels[-1]
    skip = frozenset({kernels[5], last_bwd - 1 if last_bwd - 1 in kernels else kernels[-2]})
    trace, times = _step(tiny, skip, {first_fwd: ("aten::all", 7.0),
                                      first_bwd: ("aten::add_", 11.0)}, zero_grad=True)
    replayed = measured_profile(tiny, trace)
    got = {op.index: op.time_s * 1e6 for op in replayed.ops}
    for i in kernels:
        want = times.get(i, 0.0) + (7.0 if i == first_fwd else 11.0 if i == first_bwd else 0)
        assert got[i] == pytest.approx(want), (i, tiny.ops[i].name)
    kt = read_trace(trace)
    assert kt.outside_s == pytest.approx(50e-6)
    assert kt.kernel_s == pytest.approx((sum(times.values()) + 18.0) / 1e6)


def test_a_trace_of_another_step_is_refused(tiny: StepProfile) -> None:
    other = cached_profile("llama-7b-tiny", load_hardware("h200"))
    trace, _ = _step(other)
    with pytest.raises(InputError, match="matches the profile"):
        measured_profile(tiny, trace)


def test_names_match_across_profiler_and_profile() -> None:
    assert op_key("aten::add_") == op_key("aten.add.Tensor") == "add"
    assert op_key("aten::_to_copy") == "_to_copy"
    assert op_key("slackswap.fused_attention.default") == op_key(
        "aten::_scaled_dot_product_cudnn_attention") == "attention"
    assert op_key("aten._scaled_dot_product_flash_attention_backward.default") == \
        "attention_backward"


@pytest.mark.slow
def test_the_h200_keep_all_trace_replays_at_its_measured_step() -> None:
    """gpt2-xl@12's keep-all step on an H200 (2026-12-04), replayed from its trace.

    The simulated step is checked against three figures the replay does not use: the
    compute stream's busy time (the union of its kernels), the step's GPU span and the
    median step timed around five other steps of the same session. A keep-all step is
    GPU-bound (the host issues each op in well under its kernel time), so the simulator
    runs the ops back to back: within 1% of the busy time. It leaves out the gaps between
    kernels, 2.7 ms of the 82.4 ms span in this trace (1.3 ms of them where the host was
    late in forward), so it lies below the span and the timed step by up to 5%."""
    hw = load_hardware("h200")
    profile = cached_profile(with_layers("gpt2-xl", 12), hw)
    trace = read_trace(TRACES / "gpt2-xl-12-50-trace-keep-all.json.gz")
    ops, matched = match_ops(profile, trace)
    unmatched = sum(o.seconds for o, m in zip(ops, matched, strict=True) if m is None)
    assert unmatched < 0.02 * trace.kernel_s  # AccumulateGrad and the mask's check
    replayed = measured_profile(profile, trace)
    assert sum(op.time_s for op in replayed.ops) == pytest.approx(trace.kernel_s)
    step = slackswap.simulate(replayed, Plan.keep_all(replayed), hw).step_time_s
    timed = json.loads((TRACES / "gpt2-xl-12-50.json").read_text())["keep_all"]["step_ms"] / 1e3
    assert step == pytest.approx(trace.busy_s, rel=0.01)
    assert step <= trace.span_s and step == pytest.approx(trace.span_s, rel=0.05)
    assert step == pytest.approx(timed, rel=0.05)


def test_the_op_by_op_section_is_rewritten_in_place_and_kept(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``fidelity_ops.py --write`` replaces its own section of docs/fidelity.md (appended
    the first time), and ``fidelity.py --write``, which rewrites the rest, keeps it."""
    spec = importlib.util.spec_from_file_location(
        "fidelity_ops", Path(__file__).parents[1] / "benchmarks" / "fidelity_ops.py")
    assert spec is not None and spec.loader is not None
    ops = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "fidelity_ops", ops)  # its dataclasses look it up
    spec.loader.exec_module(ops)
    doc = tmp_path / "fidelity.md"
    doc.write_text("# Fidelity\n\nrows\n")
    ops.write_section("## Op by op\n\nfirst\n", doc)
    ops.write_section("## Op by op\n\nsecond\n", doc)
    text = doc.read_text()
    assert text.startswith("# Fidelity\n\nrows\n\n") and text.count("## Op by op") == 1
    assert "second" in text and "first" not in text
    doc.write_text("# Fidelity, rewritten\n" + ops.kept_section(doc))  # as fidelity.py does
    assert "second" in doc.read_text() and ops.kept_section(doc).count(ops.BEGIN) == 1
    assert ops.kept_section(tmp_path / "none.md") == ""


def _hostile_trace(kind: str, tmp_path: Path) -> Path:
    """A trace path that is no trace: a FIFO, a device, a gzip bomb, not gzip, events
    without their fields, JSON that is not an object."""
    import gzip
    import os

    path = tmp_path / ("t.json.gz" if kind in ("bomb", "not gzip") else "t.json")
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "device":
        return Path("/dev/zero")
    elif kind == "bomb":  # 1.3 MiB that inflates past the limit the test sets
        path.write_bytes(gzip.compress(b" " * (2**20 + 1)))
    elif kind == "not gzip":
        path.write_bytes(b"hello")
    elif kind == "fieldless":
        path.write_text('{"traceEvents": [{"ph": "X", "cat": "kernel", "args": {}}]}')
    elif kind == "unhashable":  # an External id that is a list: no key of a stack
        path.write_text('{"traceEvents": [{"ph": "X", "cat": "cpu_op", "ts": 0, "dur": 1, '
                        '"name": "aten::mm", "args": {"External id": [1]}}, {"ph": "X", '
                        '"cat": "kernel", "ts": 0, "dur": 1, "name": "k", "args": {}}]}')
    elif kind == "list":
        path.write_text("[1]")
    return path


@pytest.mark.parametrize(("kind", "message"), [
    ("fifo", "it is a FIFO, not a regular file"),
    ("device", "it is a device, not a regular file"),
    ("bomb", "it holds over 1 MiB uncompressed"),
    ("not gzip", "not gzip"),
    ("fieldless", "has ts None and dur None: not a time"),
    ("unhashable", "not a torch.profiler chrome trace (TypeError"),
    ("list", "is not a torch.profiler chrome trace"),
])
def test_a_hostile_trace_is_a_one_line_error(kind: str, message: str, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """NOTE [files]: a trace is read as every file is: a FIFO was waited on for ever,
    /dev/zero read without end, a gzip bomb inflated whole, and an event without "ts" a
    KeyError or TypeError; each is now an InputError, in one line, at once."""
    import slackswap.profiling.gpu_trace as gpu_trace

    monkeypatch.setattr(gpu_trace, "MAX_TRACE_BYTES", 2**20)
    with pytest.raises(InputError, match=re.escape(message)) as caught:
        read_trace(_hostile_trace(kind, tmp_path))
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize(("dur", "message"), [
    (math.nan, "not a time"), (-5.0, "not a time"), (math.inf, "not a time"),
    ("7", "not a time"), (0.0, "the trace's kernels took no time")])
def test_kernel_times_that_are_no_times_are_refused(tiny: StepProfile, dur: Any,
                                                    message: str) -> None:
    """A trace whose kernels last NaN, an infinity, a negative time or none at all
    gave a profile with such op times (unchecked: a profile file refuses them) or a
    ZeroDivisionError; each is an InputError in one line now."""
    trace, _ = _step(tiny)
    for e in trace["traceEvents"]:
        if e.get("cat") == "kernel":
            e["dur"] = dur
    with pytest.raises(InputError, match=re.escape(message)) as caught:
        measured_profile(tiny, trace)
    assert "\n" not in str(caught.value)
