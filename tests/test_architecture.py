"""The layers as designed: the import contract in pyproject.toml ([tool.importlinter]) holds,
and it would catch the import circles and torch imports it is there to keep out."""

from __future__ import annotations

import ast
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


LONGEST = 80  # lines a function or method may take without saying why it is longer
WHY = "long because"  # the comment that says why, in the function or just above its def


def _long_units(source: str) -> list[tuple[str, int, int]]:
    """(name, first line, lines) of each function or method in ``source`` longer than
    ``LONGEST`` lines with no comment saying ``WHY`` in it or in the comment lines, and
    decorators, just above its ``def``."""
    lines = source.splitlines()
    out = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
        size = node.end_lineno - node.lineno + 1
        if size <= LONGEST:
            continue
        above = first - 1
        while above > 0 and lines[above - 1].lstrip().startswith("#"):
            above -= 1
        text = lines[above:node.end_lineno]
        if not any("#" in line and WHY in line.split("#", 1)[1].lower() for line in text):
            out.append((node.name, node.lineno, size))
    return out


def test_no_long_function_without_a_reason() -> None:
    """Every function and method of the package is at most ``LONGEST`` lines, or says in a
    comment why it is longer (``# long because ...``)."""
    long = [f"{path.relative_to(SOURCE.parent)}:{line} {name} ({size} lines)"
            for path in sorted(SOURCE.rglob("*.py"))
            for name, line, size in _long_units(path.read_text())]
    assert not long, "split these, or say why they are long: " + "; ".join(long)


def test_long_units_are_found() -> None:
    """The check finds a long function and a long method, and takes a reason given in the
    function or just above it, but not in its docstring or another function's."""
    body = "".join(f"    x{k} = {k}\n" for k in range(LONGEST))
    plain = f"def f():\n{body}"
    assert _long_units(plain) == [("f", 1, LONGEST + 1)]
    assert _long_units(f"def f():\n{body[:-len('    x79 = 79')-1]}") == []
    assert _long_units(f"class C:\n    def m(self):\n    {body.replace(chr(10), chr(10) + '    ')}"
                       ) == [("m", 2, LONGEST + 1)]
    assert _long_units(f"# long because it is one loop\ndef f():\n{body}") == []
    assert _long_units(f"def f():\n    # long because it is one loop\n{body}") == []
    assert _long_units(f"def f():\n    '''long because'''\n{body}") == [("f", 1, LONGEST + 2)]
    assert _long_units(f"def g():  # long because\n    pass\n\n\ndef f():\n{body}"
                       ) == [("f", 5, LONGEST + 1)]
