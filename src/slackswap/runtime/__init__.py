"""The runtime: executes a plan in eager PyTorch training (torch-facing).

``apply`` and ``RuntimeStats`` are imported on first use (PEP 562), so the plain-Python
parts (``runtime.watch``, ``runtime.checks``) load without torch. What the simulator and
the planners need to know of the runtime (which ops it watches) is in
:mod:`slackswap.core.watched`, below both.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["RuntimeStats", "apply"]

_HOMES = {"apply": "slackswap.runtime.block", "RuntimeStats": "slackswap.runtime.stats"}


def __getattr__(name: str) -> Any:
    if name in _HOMES:  # (no submodule is named like them, so none hides them)
        value = getattr(importlib.import_module(_HOMES[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'slackswap.runtime' has no attribute {name!r}")
