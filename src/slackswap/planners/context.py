"""What every planner needs to know about a step: candidates, timings, the memory curve."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from slackswap.core.hardware import Hardware
from slackswap.core.plan import MIN_PLANNED_BYTES, Decision, Plan
from slackswap.core.profile import StepProfile
from slackswap.core.result import SimResult
from slackswap.sim.schedule import min_working_set
from slackswap.sim.simulate import collector_paused, simulate

__all__ = ["Candidate", "PlanContext", "MIN_PLANNED_BYTES", "SHORT_STEP_CANDIDATES"]

# a step of at most this many candidates is short (one or two layers): the planner
# searches it harder, and a whole workload has several times more (bert-large: 420)
SHORT_STEP_CANDIDATES = 100



@dataclass(frozen=True, slots=True)
class Candidate:
    """A saved activation a plan may offload or recompute."""

    name: str
    tensor: int
    bytes: int
    producer: int  # op index
    recompute_s: float  # producer time alone (a chain may cost more)
    produced_at: float  # end of the producer in the keep-all timeline (s)
    freed_op: int  # last forward use: after it an evicted tensor's memory can go
    first_use: int  # first backward op that needs it
    needed_at: float  # start of that op in the keep-all timeline (s)
    layer: int | None
    kind: str  # producer op kind
    random: bool


class PlanContext:
    """A profile, the hardware, a budget in bytes, and derived tables, computed once."""

    def __init__(self, profile: StepProfile, hardware: Hardware, budget: int) -> None:
        self.profile, self.hw, self.budget = profile, hardware, budget
        self.working_set = min_working_set(profile)[0]
        keep = simulate(profile, None, hardware)
        self.ideal = keep.ideal_step_time_s
        self.keep_all_peak = keep.peak_bytes
        items = keep.run.schedule.items
        spans = [s for s in keep.run.timeline.spans if s.stream == "compute"]
        self.op_start = [0.0] * len(profile.ops)
        self.op_end = [0.0] * len(profile.ops)
        for span in spans:
            self.op_start[items[span.index].op] = span.start
            self.op_end[items[span.index].op] = span.end
        self.first_backward = keep.run.schedule.first_backward
        self.forward_end = self.op_start[self.first_backward] if self.first_backward < len(
            profile.ops) else keep.step_time_s
        # memory in use while each op runs, keep-all (allocations at start, frees at end)
        res = keep.run.schedule.residencies
        level, self.memory = 0, []
        for item in items:
            level += sum(res[r].bytes for r in item.allocs)
            self.memory.append(level)
            level -= sum(res[r].bytes for r in item.frees)
        self._attempts: dict[Callable, Any] = {}
        self.simulations = 0  # plans simulated so far: searches spend them
        self.covers: dict[tuple, Any] = {}  # recompute covers by what they were asked
        self._results: dict[tuple, SimResult] = {}  # simulated plans (``simulate``)

    def attempt(self, strategy: Callable[[PlanContext], Any]) -> Any:
        """``strategy(self)`` (a strategy, or any function of the context alone), worked
        out once per context: SlackSwap starts from the baselines' plans (NOTE [starting
        points]) and ``reproduce`` compares them. The cyclic collector stays paused over
        all of its simulations (NOTE [collector paused])."""
        if strategy not in self._attempts:
            with collector_paused():
                self._attempts[strategy] = strategy(self)
        return self._attempts[strategy]

    @cached_property
    def candidates(self) -> list[Candidate]:
        """Saved activations above the runtime's size floor that no write after their save
        pins (NOTE [written after it was saved]) and the program does not hold past the
        step or never sees saved (``StepProfile.unmovable``), in production order."""
        p, out = self.profile, []
        held = p.unmovable
        for t in p.saved_activations:
            if (t.producer is None or t.bytes < MIN_PLANNED_BYTES
                    or t.first_backward_use is None or t.written_after_save
                    or t.name in held):
                continue
            op = p.ops[t.producer]
            forward_uses = [c for c in t.forward_consumers if c < self.first_backward]
            out.append(Candidate(
                name=t.name, tensor=t.id, bytes=t.bytes, producer=t.producer,
                recompute_s=op.time_s, produced_at=self.op_end[t.producer],
                freed_op=max([t.producer, *forward_uses]), first_use=t.first_backward_use,
                needed_at=self.op_start[t.first_backward_use],
                layer=p.layer_index(op.module), kind=op.kind, random=t.random,
            ))
        return sorted(out, key=lambda c: (c.producer, c.tensor))

    @cached_property
    def short_step(self) -> bool:
        """At most ``SHORT_STEP_CANDIDATES`` candidates: one or two layers, not a whole
        workload (NOTE [starting points] in :mod:`slackswap.planners.slackswap`)."""
        return len(self.candidates) <= SHORT_STEP_CANDIDATES

    @property
    def reachable(self) -> bool:
        """False when the budget is below what one op needs at once: no plan fits."""
        return self.budget >= self.working_set

    def plan(self, strategy: str, decisions: dict[str, str],
             prefetch: dict[str, int] | None = None) -> Plan:
        """The plan, held to what the runtime can do, whatever the strategy asked: an
        activation no replay rebuilds exactly (NOTE [replayable ops]), or a checkpoint
        (which autograd does not save: never recomputed), is kept instead of recomputed; a
        checkpoint forward changes in place after making it is kept instead of offloaded
        (``StepProfile.offloadable_checkpoints``); a saved activation written after its
        save is kept, and so is one the program holds past the step (moving it frees
        nothing); only offloads are prefetched. So no
        strategy makes a plan ``Plan.check`` or the runtime refuses."""
        p = self.profile
        recomputable, checkpoints = p.recomputable, p.checkpointable
        offloadable, saved, held = p.offloadable_checkpoints, p.by_name, p.unmovable
        decisions = {n: Decision.KEEP if (
            d == Decision.RECOMPUTE and n not in recomputable
            or d == Decision.OFFLOAD and n in checkpoints and n not in offloadable
            # NOTE [written after it was saved]: never moved
            or d != Decision.KEEP and n in saved and saved[n].written_after_save
            or d != Decision.KEEP and n in held) else d
            for n, d in decisions.items()}
        prefetch = {n: i for n, i in (prefetch or {}).items()
                    if decisions.get(n) == Decision.OFFLOAD}
        return Plan(fingerprint=p.fingerprint, strategy=strategy,
                    budget_bytes=self.budget, decisions=decisions, prefetch=prefetch)

    def simulate_unlimited(self, plan: Plan) -> SimResult:
        """Simulate ``plan`` with no memory limit (counted in ``simulations``)."""
        self.simulations += 1
        return simulate(self.profile, plan, self.hw)

    def simulate(self, plan: Plan) -> SimResult:
        """Simulate ``plan`` under the budget (counted in ``simulations``, asked again or
        not). A plan simulated before is answered from the first simulation, without its
        timeline (``run`` None: :meth:`with_run` adds it back). The searches of one plan
        ask for the same plans again and again (wav2vec2 at 50%: 925 plans in 2 298
        simulations); the simulator is deterministic, and a search spends its budget of
        simulations as before, so the plans made are the same."""
        self.simulations += 1
        key = (plan.strategy, tuple(sorted(plan.decisions.items())),
               tuple(sorted(plan.prefetch.items())))
        if key in self._results:  # (a copy of its own: its dicts, the rest immutable)
            kept = self._results[key]
            return kept.model_copy(update={"stall_s": dict(kept.stall_s),
                                           "busy_fraction": dict(kept.busy_fraction)})
        result = simulate(self.profile, plan, self.hw, self.budget)
        kept = result.model_copy()  # a timeline is large: only the figures are kept
        kept._run = None
        self._results[key] = kept
        return result

    def with_run(self, attempt: tuple[Plan, SimResult]) -> tuple[Plan, SimResult]:
        """``attempt`` with the schedule and timeline of its simulation (simulated again,
        not counted, when its result was answered without them)."""
        plan, result = attempt
        if result.run is not None:
            return attempt
        return plan, simulate(self.profile, plan, self.hw, self.budget)
