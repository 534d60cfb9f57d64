"""What the framework callbacks share; imports no framework."""

from __future__ import annotations

import warnings

from slackswap.compiled.attach import CompiledAttached
from slackswap.runtime.attach import Attached

__all__ = ["unplanned"]


def unplanned(attached: Attached | CompiledAttached | None, what: str) -> None:
    """Warn, after a training step, when no forward of the attached model was planned:
    the step called other modules than the one attached (whose hooks never ran), and
    trains as it would without SlackSwap, its activations unplanned."""
    if attached is not None and not attached.plans:
        warnings.warn(f"SlackSwapCallback: the first training step planned no forward of "
                      f"{what}; training runs without a plan. Attach the module the "
                      f"training step calls", UserWarning, stacklevel=3)
