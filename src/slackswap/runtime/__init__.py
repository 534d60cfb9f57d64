"""The runtime: executes a plan in eager PyTorch training (torch-facing)."""

from slackswap.runtime.apply import apply

__all__ = ["apply"]
