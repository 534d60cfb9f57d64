"""The runtime: executes a plan in eager PyTorch training (torch-facing).

``apply`` and ``RuntimeStats`` are imported on first use (PEP 562), so the plain-Python
parts (``runtime.watch``, ``runtime.checks``) load without torch: the simulator asks
``runtime.watch`` what the runtime watches.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["RuntimeStats", "apply"]

_HOMES = {"apply": "slackswap.runtime.apply", "RuntimeStats": "slackswap.runtime.stats"}


def __getattr__(name: str) -> Any:
    if name in _HOMES:
        # NOTE: ``apply`` is also a submodule: importing it binds the module under that
        # name here, so every name is bound again to what ``__all__`` promises
        values = {n: getattr(importlib.import_module(m), n) for n, m in _HOMES.items()}
        globals().update(values)
        return values[name]
    raise AttributeError(f"module 'slackswap.runtime' has no attribute {name!r}")
