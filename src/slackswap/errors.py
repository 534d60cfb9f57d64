"""Errors a user can act on. The CLI prints their message as one line and exits non-zero."""

from __future__ import annotations

__all__ = ["SlackSwapError", "InputError", "ProfileError"]


class SlackSwapError(Exception):
    """Base class: the message says what was wrong and what to do."""


class InputError(SlackSwapError):
    """A file, name or option given by the user is unusable."""


class ProfileError(SlackSwapError):
    """The model could not be traced for one training step."""
