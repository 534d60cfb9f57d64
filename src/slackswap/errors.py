"""Errors a user can act on. The CLI prints their message as one line and exits non-zero."""

from __future__ import annotations

__all__ = ["SlackSwapError", "InputError", "ProfileError", "VerifyError", "HardwareNotice"]


class SlackSwapError(Exception):
    """Base class: the message says what was wrong and what to do."""


class InputError(SlackSwapError):
    """A file, name or option given by the user is unusable."""


class ProfileError(SlackSwapError):
    """The model could not be traced for one training step."""


NESTED_BACKWARD = (
    "the model runs backward inside its forward pass (torch.autograd.grad or backward "
    "in forward); a plan covers one forward pass then one backward, so train this model "
    "without slackswap"
)


class VerifyError(SlackSwapError):
    """``apply(..., verify=True)`` found a reload or rebuild that differs from the original."""


class HardwareNotice(UserWarning):
    """Which hardware a step is planned for when the user named none, or named ``auto``:
    said once per process (the CLI prints it as one line)."""
