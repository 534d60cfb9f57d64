"""Errors a user can act on. The CLI prints their message as one line and exits non-zero."""

from __future__ import annotations

__all__ = ["SlackSwapError", "InputError", "ProfileError", "VerifyError", "HardwareNotice",
           "PathChanged", "PathNotice"]


class SlackSwapError(Exception):
    """Base class: the message says what was wrong and what to do."""


class InputError(SlackSwapError):
    """A file, name or option given by the user is unusable."""


class ProfileError(SlackSwapError):
    """The model could not be traced for one training step."""


class PathChanged(InputError):
    """The model took a different code path in forward than in the step its plan was
    profiled on (a LayerDrop-style random skip, a branch on the data): NOTE [a step off
    the profiled path]."""


def path_changed(what: str) -> str:
    """The one line said when a step leaves the profiled path; ``what`` is what the
    runtime saw."""
    return (f"the model took a different code path than in the profiled step ({what}: "
            "a random skip such as LayerDrop, a branch on the data, or a profile of other "
            "kernels); set the skip's rate to 0 (e.g. config.layerdrop=0) for a plan that "
            "holds on every step, or profile again with mode='traced' on this device")


class PathNotice(UserWarning):
    """A step left its plan's profiled path and ran again as plain PyTorch, saving its
    activations to host memory (within the plan's budget, slower): said once per plan."""


NESTED_BACKWARD = (
    "the model runs backward inside its forward pass (torch.autograd.grad or backward "
    "in forward); a plan covers one forward pass then one backward, so train this model "
    "without slackswap"
)


class VerifyError(SlackSwapError):
    """``apply(..., verify=True)`` found a reload or rebuild that differs from the original
    as backward would read it."""


class HardwareNotice(UserWarning):
    """Which hardware a step is planned for when the user named none, or named ``auto``:
    said once per process (the CLI prints it as one line)."""
