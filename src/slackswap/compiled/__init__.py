"""Compiled training: SlackSwap plans carried into torch.compile's graphs (torch-facing)."""

from slackswap.compiled.api import CompiledPlan, compile

__all__ = ["CompiledPlan", "compile"]
