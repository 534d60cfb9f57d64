"""SlackSwap: fit training activations in GPU memory by offloading what is expensive to
rebuild within the transfer time computation hides, and recomputing the rest."""

from slackswap.core.hardware import Hardware, hardware_presets, load_hardware
from slackswap.core.plan import Plan
from slackswap.core.profile import OpRecord, StepProfile, TensorRecord
from slackswap.core.result import SimResult
from slackswap.errors import InputError, ProfileError, SlackSwapError
from slackswap.planners import STRATEGIES
from slackswap.planners import plan as _plan_profile
from slackswap.sim import simulate

__all__ = [
    "Hardware", "OpRecord", "Plan", "SimResult", "StepProfile", "TensorRecord",
    "InputError", "ProfileError", "SlackSwapError",
    "STRATEGIES", "apply", "attach", "auto", "checkpoint_policy", "compile", "hardware_presets",
    "load_hardware", "plan", "profile", "simulate",
]


def plan(profile_or_model, *args, **kwargs) -> Plan:
    """``plan(profile, budget, hardware=None, strategy="slackswap")``, or in one call
    ``plan(model, batch, budget=0.5, hardware=None, strategy="slackswap", loss_fn=None)``:
    profile the step as the model's device runs it, then plan."""
    if hasattr(profile_or_model, "named_parameters"):
        from slackswap.runtime.oneshot import plan_model

        return plan_model(profile_or_model, *args, **kwargs)
    return _plan_profile(profile_or_model, *args, **kwargs)


def __getattr__(name: str):
    # Torch is imported only when profiling or the runtime is used: the core stays torch-free.
    if name == "profile":
        from slackswap.profiling import profile

        return profile
    if name == "apply":
        from slackswap.runtime.block import apply

        return apply
    if name == "attach":
        from slackswap.runtime.attach import attach

        return attach
    if name == "checkpoint_policy":
        from slackswap.runtime.checkpoint_policy import checkpoint_policy

        return checkpoint_policy
    if name == "compile":
        from slackswap.compiled import compile

        return compile
    if name == "auto":
        from slackswap.runtime.oneshot import AutoPlan

        return AutoPlan
    raise AttributeError(f"module 'slackswap' has no attribute {name!r}")
