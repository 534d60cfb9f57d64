"""``Plan``: keep, offload or recompute for every saved activation of one profile."""

from __future__ import annotations

from enum import Enum

import pydantic
from pydantic import NonNegativeInt

from slackswap.core.jsonio import JsonFile
from slackswap.core.profile import MIN_PLANNED_BYTES, Bytes, StepProfile
from slackswap.errors import InputError

__all__ = ["Plan", "Decision", "MIN_PLANNED_BYTES"]


class Decision(str, Enum):
    """What a plan does with a saved activation. A ``str``: it equals, hashes and
    serializes as its value, so plan files hold "keep", "offload" or "recompute"."""

    KEEP = "keep"
    OFFLOAD = "offload"
    RECOMPUTE = "recompute"

    def __str__(self) -> str:
        return self.value


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
