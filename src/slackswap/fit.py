"""``slackswap fit``: the largest micro-batch (or, at a given batch, the longest sequence)
that trains at or above a target retention in what the device leaves for activations,
for SlackSwap, keep-all and block checkpointing, with predicted tokens per second.

Plain Python: profiles come from ``profile_at`` (by default the cached analytic profile
of a preset, :func:`slackswap.reproduce.cached_profile`, which imports torch itself).

NOTE [fit search]
    A shape is a batch size at the given sequence length, or a sequence length (a
    multiple of ``SEQ_STEP``) at the given batch. At each shape the step is profiled and
    the activation budget is what the device leaves (:mod:`slackswap.device_budget`: its
    memory less the model states for the optimizer and precision, less the reserve). A
    strategy *meets* the target at a shape when its plan fits that budget in the simulator
    and retains at least ``min_retention`` of the ideal step at that shape (keep-all with
    unlimited memory, as everywhere): keep-all meets it when its peak fits, at 100%.
    Tokens per second are batch x sequence length / the simulated step time.

    The search assumes that a shape that misses the target is followed only by larger
    shapes that miss it too: the budget stays (the model states do not depend on the
    batch) while activations grow, so feasibility only falls, and retention generally
    falls with the share of the peak that must be moved. It doubles the shape from one
    unit until a shape misses (or ``MAX_DOUBLINGS`` doublings, then the answer is "at
    least"), then bisects between the last shape that met the target and the first
    that missed, one strategy after the other (SlackSwap first). The answer is a shape
    that meets the target while the next one (one unit more) was evaluated and misses:
    where retention is not monotone a larger shape may meet it again, unseen. The search
    depends only on the profiles and the hardware, so it is deterministic.

    SlackSwap is planned only at the shapes its own search visits (and wherever keep-all
    fits, at no cost); keep-all and checkpoint-blocks at every shape profiled, so a
    table or plot may lack SlackSwap at a shape only the others' searches visited.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from slackswap.core.hardware import Hardware
from slackswap.core.profile import StepProfile
from slackswap.core.units import format_bytes
from slackswap.device_budget import DeviceBudget, device_budget
from slackswap.errors import InputError
from slackswap.planners import plan_in_context
from slackswap.planners.cache import cached_attempt
from slackswap.planners.context import PlanContext

__all__ = ["FIT_STRATEGIES", "SEQ_STEP", "MAX_DOUBLINGS", "Outcome", "Point", "FitResult",
           "fit", "largest_meeting", "fit_figure", "write_fit_plot"]

# the answer first, then what a user would do without SlackSwap
FIT_STRATEGIES = ("slackswap", "checkpoint-blocks", "keep-all")
SEQ_STEP = 64  # sequence lengths searched, in multiples of this
MAX_DOUBLINGS = 16  # the search stops at 2**16 units: batch 65536, sequence 4Mi tokens

Progress = Callable[[str], None]
ProfileAt = Callable[[int, int], StepProfile]


@dataclass(frozen=True)
class Outcome:
    """One strategy at one shape: whether its plan fits, what it retains, how fast."""

    feasible: bool
    retention: float | None = None
    step_time_s: float | None = None
    tokens_per_s: float | None = None
    peak_bytes: int | None = None
    reason: str | None = None

    def meets(self, target: float) -> bool:
        """Fits and retains at least ``target`` of the ideal step."""
        return self.feasible and self.retention is not None and self.retention >= target


@dataclass
class Point:
    """A profiled shape: its budget, keep-all figures and each evaluated strategy."""

    batch: int
    seq: int
    budget_bytes: int
    keep_all_peak_bytes: int
    ideal_step_time_s: float
    outcomes: dict[str, Outcome] = field(default_factory=dict)

    @property
    def tokens(self) -> int:
        return self.batch * self.seq


@dataclass
class FitResult:
    """What ``fit`` found: the largest shape per strategy and every shape it evaluated."""

    model: str
    hardware: str
    optimizer: str
    precision: str
    min_retention: float
    search: str  # "batch" or "seq": the dimension searched
    fixed: int  # the other dimension: the sequence length, or the batch
    device: DeviceBudget  # at the smallest shape profiled
    points: list[Point]  # by shape
    largest: dict[str, int | None]  # strategy -> shape, None when even one unit misses
    cap: int  # the largest shape the search tries: one found there is "at least"

    def size_of(self, point: Point) -> int:
        """The point's shape in the dimension searched."""
        return point.batch if self.search == "batch" else point.seq

    def point(self, size: int) -> Point:
        return next(p for p in self.points if self.size_of(p) == size)

    def chosen(self, strategy: str) -> Point | None:
        """The point of ``strategy``'s largest shape, None when none meets the target."""
        size = self.largest[strategy]
        return None if size is None else self.point(size)

    def fastest(self) -> tuple[str, Point] | None:
        """The strategy and shape with the most tokens/s among those evaluated that meet
        the target (on a tie the simplest: keep-all, then checkpoint-blocks)."""
        best: tuple[str, Point] | None = None
        for p in self.points:
            for s in reversed(FIT_STRATEGIES):
                o = p.outcomes.get(s)
                if o is not None and o.meets(self.min_retention) and (
                        best is None or o.tokens_per_s > best[1].outcomes[best[0]].tokens_per_s):
                    best = s, p
        return best

    def to_json(self) -> dict[str, Any]:
        """Machine-readable: the shapes per strategy, the device budget and every point."""
        d = self.device
        return {
            "model": self.model, "hardware": self.hardware, "optimizer": self.optimizer,
            "precision": self.precision, "min_retention": self.min_retention,
            "search": self.search, self._fixed_name: self.fixed, "cap": self.cap,
            "device": {"capacity_bytes": d.capacity, "model_state_bytes": d.model_states,
                       "parameters": d.parameters,
                       "reserve_bytes": sum(d.reserve.values()),
                       "activation_budget_bytes": d.budget_bytes},
            "largest": {s: self._largest_json(s) for s in FIT_STRATEGIES},
            "fastest": self._fastest_json(),
            "points": [{"batch": p.batch, "seq": p.seq, "budget_bytes": p.budget_bytes,
                        "keep_all_peak_bytes": p.keep_all_peak_bytes,
                        "ideal_step_time_s": p.ideal_step_time_s,
                        "strategies": {s: asdict(o) for s, o in p.outcomes.items()}}
                       for p in self.points],
        }

    @property
    def _fixed_name(self) -> str:
        return "seq" if self.search == "batch" else "batch"

    def _largest_json(self, strategy: str) -> dict[str, Any] | None:
        p = self.chosen(strategy)
        if p is None:
            return None
        return {**_shape_json(p, strategy), "at_cap": self.largest[strategy] == self.cap}

    def _fastest_json(self) -> dict[str, Any] | None:
        found = self.fastest()
        return None if found is None else {"strategy": found[0], **_shape_json(found[1],
                                                                               found[0])}


def _shape_json(p: Point, strategy: str) -> dict[str, Any]:
    o = p.outcomes[strategy]
    return {"batch": p.batch, "seq": p.seq, "retention": o.retention,
            "tokens_per_s": o.tokens_per_s, "step_time_s": o.step_time_s,
            "peak_bytes": o.peak_bytes}


def largest_meeting(meets: Callable[[int], bool], unit: int = 1,
                    doublings: int = MAX_DOUBLINGS) -> int | None:
    """The largest multiple of ``unit`` that ``meets``, by doubling then bisection
    (NOTE [fit search]), at most ``unit * 2**doublings``; None when ``unit`` misses."""
    lo, hi = 0, None
    for k in range(doublings + 1):
        size = unit * 2**k
        if not meets(size):
            hi = size
            break
        lo = size
    if hi is None:
        return lo
    while hi - lo > unit:
        mid = lo + (hi - lo) // (2 * unit) * unit
        if meets(mid):
            lo = mid
        else:
            hi = mid
    return lo or None


class _Evaluator:
    """Profiles, budgets and plans shapes once each, and records every outcome."""

    def __init__(self, hw: Hardware, profile_at: ProfileAt, search: str, fixed: int,
                 optimizer: str, precision: str, progress: Progress,
                 cached: bool = False) -> None:
        self.hw, self.profile_at, self.search, self.fixed = hw, profile_at, search, fixed
        self.cached = cached  # the presets' analytic profiles: plans cached by content
        self.optimizer, self.precision, self.progress = optimizer, precision, progress
        self.points: dict[int, Point] = {}
        self.contexts: dict[int, PlanContext] = {}
        self.devices: dict[int, DeviceBudget] = {}

    def shape(self, size: int) -> tuple[int, int]:
        return (size, self.fixed) if self.search == "batch" else (self.fixed, size)

    def point(self, size: int) -> Point:
        if size not in self.points:
            batch, seq = self.shape(size)
            self.progress(f"batch {batch}, seq {seq}: profiling")
            prof = self.profile_at(batch, seq)
            device = device_budget(prof, self.hw, self.optimizer, self.precision)
            ctx = PlanContext(prof, self.hw, device.budget_bytes)
            point = Point(batch, seq, ctx.budget, ctx.keep_all_peak, ctx.ideal)
            fits = ctx.keep_all_peak <= ctx.budget
            point.outcomes["keep-all"] = Outcome(
                fits, 1.0 if fits else None, ctx.ideal if fits else None,
                point.tokens / ctx.ideal if fits else None, ctx.keep_all_peak,
                None if fits else f"the keep-all peak {format_bytes(ctx.keep_all_peak)} "
                                  f"is over the {format_bytes(ctx.budget)} budget")
            self.points[size], self.contexts[size], self.devices[size] = point, ctx, device
            self._plan(size, "checkpoint-blocks")
            if fits:  # every strategy keeps everything
                self._plan(size, "slackswap")
        return self.points[size]

    def outcome(self, size: int, strategy: str) -> Outcome:
        point = self.point(size)
        if strategy not in point.outcomes:
            self._plan(size, strategy)
        return point.outcomes[strategy]

    def _plan(self, size: int, strategy: str) -> None:
        point, ctx = self.points[size], self.contexts[size]
        self.progress(f"batch {point.batch}, seq {point.seq}: planning {strategy}")
        attempt = (cached_attempt(ctx, strategy)[0] if self.cached
                   else plan_in_context(ctx, strategy))
        if attempt is None:
            why = (f"the budget is below the {format_bytes(ctx.working_set)} one op needs "
                   "at once" if not ctx.reachable else "the strategy has no plan for this "
                   "model")
            point.outcomes[strategy] = Outcome(False, reason=why)
            return
        result = attempt[1]
        ok = result.feasible
        point.outcomes[strategy] = Outcome(
            ok, result.retention if ok else None, result.step_time_s if ok else None,
            point.tokens / result.step_time_s if ok else None, result.peak_bytes,
            None if ok else result.infeasible_reason)


def fit(
    model: str,
    hardware: Hardware,
    *,
    batch: int | None = None,
    seq: int | None = None,
    optimizer: str = "adamw",
    precision: str = "mixed",
    min_retention: float = 0.97,
    progress: Progress = lambda message: None,
    profile_at: ProfileAt | None = None,
) -> FitResult:
    """The largest batch at sequence length ``seq`` (the preset's own by default), or
    given ``batch`` the longest sequence, that trains at ``min_retention`` or more of the
    ideal step under what ``hardware``'s memory leaves for activations, for SlackSwap,
    checkpoint-blocks and keep-all (NOTE [fit search]).

    ``profile_at(batch, seq)`` profiles the step (default: the cached analytic profile
    of preset ``model``). A one-line InputError when the model states alone do not fit."""
    if not 0 <= min_retention <= 1:
        raise InputError(f"--min-retention {min_retention} must be in [0, 1]")
    if batch is not None and seq is not None:
        raise InputError("give --batch to search the sequence length, or --seq (or "
                         "neither) to search the batch, not both")
    if ":" in model:
        raise InputError(f"fit builds preset models at every shape it tries; '{model}' is "
                         "a factory, which builds one batch: profile and plan it instead")
    cached = profile_at is None  # (NOTE [plan cache] in :mod:`slackswap.planners.cache`)
    if profile_at is None:
        profile_at = _preset_profiles(model, hardware)
    if batch is None:
        search, fixed, unit = "batch", seq or _preset_seq(model), 1
    else:
        search, fixed, unit = "seq", batch, SEQ_STEP
    ev = _Evaluator(hardware, profile_at, search, fixed, optimizer, precision, progress,
                    cached)
    largest = {strategy: largest_meeting(  # SlackSwap's doubling profiles the others' shapes
        lambda size, s=strategy: ev.outcome(size, s).meets(min_retention), unit)
        for strategy in FIT_STRATEGIES}
    sizes = sorted(ev.points)
    return FitResult(model=model, hardware=hardware.name, optimizer=optimizer,
                     precision=precision, min_retention=min_retention, search=search,
                     fixed=fixed, device=ev.devices[sizes[0]],
                     points=[ev.points[s] for s in sizes], largest=largest,
                     cap=unit * 2**MAX_DOUBLINGS)


def _preset_profiles(model: str, hardware: Hardware) -> ProfileAt:
    from slackswap.reproduce import cached_profile

    return lambda batch, seq: cached_profile(model, hardware, batch=batch, seq=seq)


def _preset_seq(model: str) -> int:
    from slackswap.models import MODEL_PRESETS, build_model

    if model not in MODEL_PRESETS:
        build_model(model)  # raises the error that lists the presets
    return MODEL_PRESETS[model].seq


def fit_figure(result: FitResult) -> Any:
    """Tokens per second against the shape searched, one line per strategy: a filled
    marker meets the target, a hollow one falls short, a gap does not fit."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    for i, strategy in enumerate(FIT_STRATEGIES):
        pts = [p for p in result.points if strategy in p.outcomes]
        xs = [result.size_of(p) for p in pts]
        ys = [p.outcomes[strategy].tokens_per_s or math.nan for p in pts]
        color = f"C{i}"
        ax.plot(xs, ys, color=color, lw=2.6 if strategy == "slackswap" else 1.2,
                ls="--" if strategy == "keep-all" else "-", label=strategy)
        meets = [p.outcomes[strategy].meets(result.min_retention) for p in pts]
        ax.scatter(xs, ys, s=18, zorder=3, edgecolors=color,
                   facecolors=[color if m else "white" for m in meets])
        if (size := result.largest[strategy]) is not None:
            ax.axvline(size, color=color, ls=":", lw=1)
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:g}"))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:,.0f}"))
    ax.set_xlabel("micro-batch size" if result.search == "batch" else "sequence length")
    ax.set_ylabel("tokens/s (simulated)")
    ax.set_ylim(0, ax.get_ylim()[1] * 1.08)
    fixed = (f"seq {result.fixed}" if result.search == "batch" else f"batch {result.fixed}")
    ax.set_title(f"{result.model} on {result.hardware}, {fixed}: hollow below "
                 f"{result.min_retention:.0%} of ideal, dotted the largest", fontsize=9)
    ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    return fig


def write_fit_plot(result: FitResult, path: str | Path) -> None:
    """Write :func:`fit_figure` as a PNG, atomically."""
    import matplotlib.pyplot as plt

    from slackswap.core.jsonio import atomic_write

    fig = fit_figure(result)
    try:
        atomic_write(path, lambda f: fig.savefig(f, format="png"))
    finally:
        plt.close(fig)
