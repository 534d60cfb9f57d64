"""Torch-facing profiling: one training step becomes a :class:`slackswap.StepProfile`."""

from slackswap.profiling.step import default_device, profile

__all__ = ["default_device", "profile"]
