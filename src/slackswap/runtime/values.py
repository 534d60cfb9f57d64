"""What the recorder (forward) and the replayer (backward) ask of the saved values
(:class:`slackswap.runtime.saved.SavedValues`), as protocols: they are typed against
these, so ``saved`` imports them and neither imports ``saved`` back (no import circle
between the three)."""

from __future__ import annotations

from typing import Any, Protocol

import torch

from slackswap.runtime.copies import HostCopies
from slackswap.runtime.stats import RuntimeStats

__all__ = ["Recorded", "Rebuilt"]

Value = tuple[int, int]  # (storage key, its version): NOTE [values, not storages]


class Recorded(Protocol):
    """What forward's recorder needs: the host copies (a write waits for an offload
    still reading the storage) and where to keep a checkpoint it makes."""

    copies: HostCopies

    def hold_checkpoint(self, key: int, release: int, t: torch.Tensor, name: str) -> None:
        ...


class Rebuilt(Protocol):
    """What a rebuild in backward needs: the step's stats and recorder, the plan's
    decisions, what is back on the device or in host memory, and reloads."""

    stats: RuntimeStats
    recorder: Any
    copies: HostCopies
    decisions: dict[str, str]
    pending: dict[Value, int]
    back: dict[Value, torch.Tensor]
    host: dict[Value, torch.Tensor]
    group: dict[Value, torch.Tensor]

    def bring_back(self, vkey: Value, base: torch.Tensor) -> None:
        ...

    def reload(self, vkey: Value, name: str | None, device: torch.device,
               waited: bool = False) -> torch.Tensor:
        ...
