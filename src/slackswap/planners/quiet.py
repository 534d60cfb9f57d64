"""The solver kept off the process's standard output."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator

__all__ = ["solver_output_off"]


@contextlib.contextmanager
def solver_output_off() -> Iterator[None]:
    """File descriptor 1 on the null device for the duration.

    NOTE [solver output]
        HiGHS prints a debug line from C++ straight to the process's stdout on some MIP
        solves ("HighsMipSolverData::transformNewIntegerFeasibleSolution tmpSolver.run();",
        ERGO-Code/HiGHS#2783), whatever its output options say. Stdout is where the CLI
        writes JSON (``plan --summary``, ``fit --json``), so each solve runs with the
        descriptor pointed elsewhere; progress and errors go to stderr and are unaffected.
    """
    try:
        sys.stdout.flush()
        saved = os.dup(1)
    except (OSError, ValueError):  # no descriptor 1 to guard
        yield
        return
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 1)
        yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)
