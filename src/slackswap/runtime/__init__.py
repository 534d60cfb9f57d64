"""The runtime: executes a plan in eager PyTorch training (torch-facing)."""

from slackswap.runtime.apply import RuntimeStats, apply

__all__ = ["RuntimeStats", "apply"]
