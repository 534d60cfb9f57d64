"""Discrete-event simulation of one training step under a plan. Plain Python, no torch."""

from slackswap.sim.simulate import simulate

__all__ = ["simulate"]
