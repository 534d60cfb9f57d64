"""What a person looks at: a Perfetto/Chrome trace of the simulated step and a memory plot."""

from __future__ import annotations

import os
from typing import Any

from slackswap.core.jsonio import atomic_write, atomic_write_text, json_text
from slackswap.core.result import SimResult
from slackswap.errors import InputError

__all__ = ["chrome_trace", "write_trace", "write_memory_plot", "HOST_PID"]

_TIDS = {"compute": 0, "d2h": 1, "h2d": 2}
_THREAD_NAMES = {"compute": "compute stream", "d2h": "D2H copy engine", "h2d": "H2D copy engine"}


def _run(result: SimResult) -> Any:
    if result.run is None:
        raise InputError("this result has no timeline; produce it with slackswap.simulate")
    return result.run


HOST_PID = 1
HOST_THREAD = "issuing thread"


def _compute_name(profile: Any, item: Any) -> str:
    kind = profile.ops[item.op].kind
    return f"recompute {kind}" if item.recompute else kind


def chrome_trace(result: SimResult) -> dict[str, Any]:
    """The step as ``torch.profiler``'s Chrome trace JSON: one process for the GPU, one
    track per stream, a counter track for activation memory; when the host costs anything,
    a process "host (simulated)" with one span per item it issues, named as the item's
    compute span. Times in microseconds."""
    run = _run(result)
    profile, sched, tl = run.profile, run.schedule, run.timeline
    events: list[dict[str, Any]] = [
        {"ph": "M", "name": "process_name", "pid": 0, "tid": 0,
         "args": {"name": f"GPU (simulated, {profile.hardware})"}},
    ]
    host = getattr(run, "host", None)
    if host is not None:
        events += [
            {"ph": "M", "name": "process_name", "pid": HOST_PID, "tid": 0,
             "args": {"name": "host (simulated)"}},
            {"ph": "M", "name": "thread_name", "pid": HOST_PID, "tid": 0,
             "args": {"name": HOST_THREAD}},
        ]
        start = 0.0  # the host works without a gap: each item from the previous issue
        for k, (item, issued) in enumerate(zip(sched.items, host.issued, strict=True)):
            events.append({"ph": "X", "cat": "host", "name": _compute_name(profile, item),
                           "pid": HOST_PID, "tid": 0, "ts": start * 1e6,
                           "dur": (issued - start) * 1e6,
                           "args": {"item": k, "op": item.op, "recompute": item.recompute}})
            start = issued
    for stream, tid in _TIDS.items():
        events.append({"ph": "M", "name": "thread_name", "pid": 0, "tid": tid,
                       "args": {"name": _THREAD_NAMES[stream]}})
        events.append({"ph": "M", "name": "thread_sort_index", "pid": 0, "tid": tid,
                       "args": {"sort_index": tid}})
    for span in tl.spans:
        if span.stream == "compute":
            item = sched.items[span.index]
            op = profile.ops[item.op]
            name = _compute_name(profile, item)
            args = {"item": span.index, "op": op.index, "module": op.module, "phase": op.phase,
                    "recompute": item.recompute}
        else:
            copy = (sched.d2h if span.stream == "d2h" else sched.h2d)[span.index]
            tensor = profile.tensors[copy.tensor]
            name = f"{'offload' if span.stream == 'd2h' else 'reload'} {tensor.name}"
            args = {"activation": tensor.name, "bytes": copy.bytes}
        events.append({"ph": "X", "cat": span.stream, "name": name, "pid": 0,
                       "tid": _TIDS[span.stream], "ts": span.start * 1e6,
                       "dur": (span.end - span.start) * 1e6, "args": args})
    for t, used in tl.memory:
        events.append({"ph": "C", "name": "activation memory", "pid": 0, "tid": 0,
                       "ts": t * 1e6, "args": {"bytes": used}})
    return {"schemaVersion": 1, "displayTimeUnit": "ms", "traceEvents": events}


def write_trace(result: SimResult, path: str | os.PathLike[str]) -> None:
    """Write :func:`chrome_trace` to ``path`` (opens in Perfetto or chrome://tracing)."""
    atomic_write_text(path, json_text(chrome_trace(result), os.fspath(path)))


def _curve(result: SimResult) -> tuple[list[float], list[float]]:
    xs, ys = [0.0], [0.0]
    for t, used in _run(result).timeline.memory:
        xs += [t * 1e3, t * 1e3]
        ys += [ys[-1], used / 2**30]
    return xs, ys


def write_memory_plot(result: SimResult, path: str | os.PathLike[str],
                      keep_all: SimResult | None = None) -> None:
    """PNG of activation memory over the step, with the budget line and keep-all curve."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4), dpi=120)
    if keep_all is not None:
        ax.plot(*_curve(keep_all), color="0.6", lw=1, label="keep-all (no limit)")
    ax.plot(*_curve(result), color="C0", lw=1.2, label=f"plan: {result.strategy}")
    if result.memory_limit_bytes is not None:
        ax.axhline(result.memory_limit_bytes / 2**30, color="C3", ls="--", lw=1,
                   label="memory limit")
    ax.set_xlabel("time in step (ms)")
    ax.set_ylabel("activation memory (GiB)")
    ax.set_title(f"retention {result.retention:.1%}, peak {result.peak_bytes / 2**30:.2f} GiB")
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    try:
        atomic_write(path, lambda f: fig.savefig(f, format="png"))
    finally:
        plt.close(fig)
