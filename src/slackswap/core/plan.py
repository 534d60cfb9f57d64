"""``Plan``: keep, offload or recompute for every saved activation of one profile."""

from __future__ import annotations

from enum import Enum
from typing import TYPE_CHECKING

import pydantic
from pydantic import NonNegativeInt

from slackswap.core.jsonio import JsonFile
from slackswap.core.profile import MIN_PLANNED_BYTES, Bytes, StepProfile
from slackswap.core.units import format_bytes
from slackswap.errors import InputError

if TYPE_CHECKING:
    from slackswap.core.result import SimResult

__all__ = ["Plan", "Decision", "MIN_PLANNED_BYTES"]


class Decision(str, Enum):
    """What a plan does with a saved activation. A ``str``: it equals, hashes and
    serializes as its value, so plan files hold "keep", "offload" or "recompute"."""

    KEEP = "keep"
    OFFLOAD = "offload"
    RECOMPUTE = "recompute"

    def __str__(self) -> str:
        return self.value


_DONE = {Decision.KEEP: "kept", Decision.OFFLOAD: "offloaded",
         Decision.RECOMPUTE: "recomputed"}


class Plan(JsonFile, pydantic.BaseModel):
    """Decisions keyed by activation id; prefetch points are op indices where a reload is issued."""

    model_config = pydantic.ConfigDict(extra="forbid")

    schema_version: int = 1
    fingerprint: str  # of the profile the plan was made for
    strategy: str
    budget_bytes: Bytes | None = None
    decisions: dict[str, Decision]
    prefetch: dict[str, NonNegativeInt] = {}
    # The profile a one-call plan was made from, kept in memory (not in the file) so the
    # runtime can check the plan and reload at its prefetch points without being given it.
    _profile: StepProfile | None = pydantic.PrivateAttr(default=None)
    # What planning predicted for it (the simulated step) and the hardware it was planned
    # for, kept in memory for ``str(plan)``; unset for a plan read from a file.
    _result: SimResult | None = pydantic.PrivateAttr(default=None)
    _hardware: str | None = pydantic.PrivateAttr(default=None)
    # a step under it left the profiled path: said (NOTE [a step off the profiled path])
    _off_path_said: bool = pydantic.PrivateAttr(default=False)

    def counts(self) -> dict[Decision, int]:
        """How many activations the plan keeps, offloads and recomputes."""
        counts = dict.fromkeys(Decision, 0)
        for decision in self.decisions.values():
            counts[Decision(decision)] += 1
        return counts

    def __str__(self) -> str:
        """A few lines for a person: strategy, budget, predicted retention (simulated),
        and how many activations (and bytes, when the profile is at hand) each decision
        takes; the plan file holds the decisions themselves."""
        budget = format_bytes(self.budget_bytes) if self.budget_bytes is not None else "none"
        lines = [f"SlackSwap plan ({self.strategy}), budget {budget}, for profile "
                 f"{self.fingerprint[:12]}"]
        result = self._result
        if result is not None and result.feasible:
            on = f" on {self._hardware}" if self._hardware else ""
            lines.append(
                f"  predicted retention {result.retention:.2%} of the ideal step "
                f"(simulated{on}): {result.step_time_s * 1e3:.2f} ms against "
                f"{result.ideal_step_time_s * 1e3:.2f} ms; activation peak "
                f"{format_bytes(result.peak_bytes)} (keep-all "
                f"{format_bytes(result.keep_all_peak_bytes)})")
        elif result is not None:
            lines.append(f"  infeasible: {result.infeasible_reason}")
        else:
            lines.append("  predicted retention not known (a plan read from a file): "
                         "`slackswap simulate PROFILE --plan PLAN` predicts it")
        counts = self.counts()
        sizes = self._bytes_by_decision()
        parts = [f"{counts[d]} {_DONE[d]}" + (f" ({format_bytes(sizes[d])})" if sizes else "")
                 for d in Decision]
        lines.append(f"  {len(self.decisions)} activations: {', '.join(parts)}; "
                     f"{len(self.prefetch)} prefetch points")
        return "\n".join(lines)

    def __eq__(self, other: object) -> bool:
        """Plans are equal when their files would be: what is kept in memory with one
        (its profile, its predicted result) is not the plan."""
        if not isinstance(other, Plan):
            return NotImplemented
        return self.__dict__ == other.__dict__

    __hash__ = None  # type: ignore[assignment]  # (mutable, as pydantic models are)

    def __repr__(self) -> str:
        counts = self.counts()
        retention = (f", predicted_retention={self._result.retention:.4f}"
                     if self._result is not None and self._result.feasible else "")
        return (f"Plan(strategy={self.strategy!r}, budget_bytes={self.budget_bytes!r}, "
                f"fingerprint={self.fingerprint[:12] + '...'!r}, "
                f"decisions=<{len(self.decisions)}: {counts[Decision.OFFLOAD]} offload, "
                f"{counts[Decision.RECOMPUTE]} recompute>, "
                f"prefetch=<{len(self.prefetch)}>{retention})")

    def _bytes_by_decision(self) -> dict[Decision, int]:
        """Bytes each decision takes, from the profile kept with the plan; empty without."""
        profile = self._profile
        if profile is None:
            return {}
        records = {**profile.checkpointable, **profile.by_name}
        sizes = dict.fromkeys(Decision, 0)
        for name, decision in self.decisions.items():
            if (record := records.get(name)) is not None:
                sizes[Decision(decision)] += record.bytes
        return sizes

    @classmethod
    def keep_all(cls, profile: StepProfile) -> Plan:
        """Keep every activation on the GPU: the ideal, with no memory limit."""
        return cls(
            fingerprint=profile.fingerprint,
            strategy="keep-all",
            decisions={name: Decision.KEEP for name in profile.by_name},
        )

    def check(self, profile: StepProfile) -> None:
        """Raise :class:`InputError` unless this plan was made for ``profile``."""
        if self.fingerprint != profile.fingerprint:
            raise InputError(
                f"plan was made for a different model or batch shape (fingerprint "
                f"{self.fingerprint[:12]} != {profile.fingerprint[:12]}); re-plan for this profile"
            )
        state, inputs = profile.derived("plan-check", lambda: (
            {t.name for t in profile.tensors if t.is_parameter},
            {t.name for t in profile.saved_activations if t.producer is None}))
        planned = [n for n, d in self.decisions.items() if d != Decision.KEEP] + list(self.prefetch)
        if fixed := [n for n in planned if n in state]:
            raise InputError(
                f"plan moves '{fixed[0]}', a parameter or buffer; model state is never planned"
            )
        if fixed := [n for n in planned if n in inputs]:
            raise InputError(
                f"plan moves '{fixed[0]}', a batch input; only activations can be planned"
            )
        checkpoints = profile.checkpointable
        if bad := [n for n, d in self.decisions.items()
                   if d == Decision.RECOMPUTE and n in checkpoints]:
            raise InputError(
                f"plan recomputes '{bad[0]}', which autograd does not save; such tensors "
                "are kept or offloaded as checkpoints, or left out (rebuilt when needed)"
            )
        if bad := [n for n in self.prefetch if n in checkpoints
                   and self.decisions.get(n) != Decision.OFFLOAD]:
            raise InputError(f"plan prefetches '{bad[0]}', a checkpoint it does not offload")
        # a prefetch point says when a reload starts: one for a tensor the plan keeps or
        # recomputes would be ignored, so the file does not say what the plan does
        if bad := [n for n in self.prefetch if n in profile.by_name
                   and self.decisions.get(n, Decision.KEEP) != Decision.OFFLOAD]:
            what = {Decision.KEEP: "keeps", Decision.RECOMPUTE: "recomputes"}[
                self.decisions.get(bad[0], Decision.KEEP)]
            raise InputError(
                f"plan prefetches '{bad[0]}', which it {what}: only an offloaded activation "
                "is reloaded; offload it or drop its prefetch point"
            )
        offloadable = profile.offloadable_checkpoints
        if bad := [n for n, d in self.decisions.items() if d == Decision.OFFLOAD
                   and n in checkpoints and n not in offloadable]:
            raise InputError(
                f"plan offloads '{bad[0]}', a checkpoint forward changes in place after "
                "making it; its copy could not be exact: keep it as a checkpoint instead"
            )
        pinned = profile.by_name
        if bad := [n for n in planned if n in pinned and pinned[n].written_after_save]:
            raise InputError(
                f"plan moves '{bad[0]}', which the step writes in place after autograd saved "
                "it (backward reads it as written, or fails as PyTorch does): keep it"
            )
        known = profile.by_name.keys() | profile.checkpointable.keys()
        unknown = [n for n in (*self.decisions, *self.prefetch) if n not in known]
        if unknown:
            raise InputError(
                f"plan names {len(unknown)} activation(s) the profile does not save, "
                f"e.g. '{unknown[0]}'"
            )
        bad = {n: i for n, i in self.prefetch.items() if not 0 <= i < len(profile.ops)}
        if bad:
            name, idx = next(iter(bad.items()))
            raise InputError(f"plan prefetches '{name}' at op {idx}, outside the step")
