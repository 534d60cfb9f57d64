"""The layers as designed: the import contract in pyproject.toml ([tool.importlinter]) holds,
and it would catch the import circles and torch imports it is there to keep out."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
SOURCE = ROOT / "src" / "slackswap"


def _lint_imports(source_root: Path) -> subprocess.CompletedProcess[str]:
    """``lint-imports`` with the project's contracts, on the package under ``source_root``."""
    tool = Path(sys.executable).with_name("lint-imports")
    found = str(tool) if tool.exists() else shutil.which("lint-imports")
    assert found is not None, "import-linter is not installed (pip install -e '.[test]')"
    env = {**os.environ, "PYTHONPATH": str(source_root)}
    return subprocess.run([found, "--no-cache", "--no-logo", str(ROOT / "pyproject.toml")],
                          cwd=source_root, env=env, capture_output=True, text=True, check=False)


def test_the_import_contract_holds() -> None:
    run = _lint_imports(SOURCE.parent)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "3 kept, 0 broken" in run.stdout


# (file, a function appended to it, what the linter must then say: {line} is the line of
# the appended import, so the message is about the copy, not an installed package)
BREAKS = {
    "simulator imports runtime": (
        "sim/host.py",
        "def _late():\n    from slackswap.runtime.watch import watch_for\n    return watch_for\n",
        "slackswap.sim.host -> slackswap.runtime.watch (l.{line})"),
    "core imports torch": (
        "core/units.py", "def _late():\n    import torch\n    return torch\n",
        "slackswap.core.units -> torch (l.{line})"),
    "a circle inside the planners": (
        "planners/context.py",
        "def _late():\n    from slackswap.planners.api import plan\n    return plan\n",
        "No cycles are allowed in slackswap.planners"),
}


@pytest.mark.parametrize("case", sorted(BREAKS))
def test_the_contract_catches(case: str, tmp_path: Path) -> None:
    """A function-level import the layers forbid, in a copy of the package, breaks it."""
    path, function, said = BREAKS[case]
    copy = tmp_path / "slackswap"
    shutil.copytree(SOURCE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    text = (copy / path).read_text()
    (copy / path).write_text(text + "\n\n" + function)
    run = _lint_imports(tmp_path)
    assert run.returncode != 0
    assert said.format(line=len(text.splitlines()) + 4) in run.stdout, run.stdout
    if "circle" in case:
        assert ".context -> .api" in run.stdout, run.stdout
