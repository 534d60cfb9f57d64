"""Every ```python block of README.md and of docs/ runs as written.

A page's blocks run in order in one namespace (a later block may use what an earlier one
made), in a temporary working folder. A fence's info string may say more:

- ```` ```python title="needs a GPU..." ````: the block needs a CUDA GPU (or what a GPU
  session saved); it is skipped here and counted in ``GPU_BLOCKS``, so adding one is a
  decision, not an accident;
- a block whose only line is ``--8<-- "FILE:SECTION"`` shows a section of a file (MkDocs
  includes it); the section must exist, and ``INCLUDED`` names the test that runs the file.

Any other info string fails, so no block is left unrun by a typo.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
FENCE = re.compile(r"^```python([^\n]*)\n(.*?)^```\s*$", re.S | re.M)
INCLUDE = re.compile(r'^--8<-- "([^":]+):([\w-]+)"$')
NEEDS_GPU = 'title="needs a GPU'

GPU_BLOCKS = {"docs/results-gpu/README.md": 1}  # replays a GPU session's saved files
INCLUDED = {"examples/train_fsdp.py": "tests/test_distributed.py"}  # file: the test running it

# What a page's blocks must leave behind, beyond running without an error.
CHECKS: dict[str, Callable[[dict[str, Any]], bool]] = {
    "README.md": lambda ns: not ns["model"]._forward_pre_hooks and bool(ns["attached"].plans),
    "docs/training/attach.md": lambda ns: (bool(ns["attached"].plans)
                                           and not ns["model"]._forward_pre_hooks),
    "docs/training/eager.md": lambda ns: len(ns["step"].plans) == 1,
    "docs/training/checkpoint-policy.md": lambda ns: ns["policy"].applied()["recomputed"] > 0,
    "docs/training/compile.md": lambda ns: ns["compiled"].slackswap.applied()["recomputed"] > 0,
}


def _name(page: Path) -> str:
    return page.relative_to(ROOT).as_posix()


def _blocks(page: Path) -> list[tuple[str, str]]:
    return [(info.strip(), code) for info, code in FENCE.findall(page.read_text())]


def _kind(info: str, code: str) -> str:
    if not info:
        return "run"
    if info.startswith(NEEDS_GPU):
        return "gpu"
    if INCLUDE.match(code.strip()):
        return "include"
    raise AssertionError(f"unknown fence info string {info!r}: run it, or mark it")


RUNNABLE = [p for p in PAGES if any(_kind(i, c) == "run" for i, c in _blocks(p))]


@pytest.mark.parametrize("page", RUNNABLE, ids=_name)
def test_page_snippets_run(page: Path, tmp_path: Path) -> None:
    namespace: dict[str, Any] = {"__name__": "__docs__"}
    here = os.getcwd()
    os.chdir(tmp_path)  # files a snippet writes, a Trainer's output folder
    try:
        for info, code in _blocks(page):
            if _kind(info, code) == "run":
                exec(compile(code, _name(page), "exec"), namespace)
    finally:
        os.chdir(here)
    check = CHECKS.get(_name(page))
    assert check is None or check(namespace), f"{_name(page)}: its snippets did not do it"


def test_every_python_block_is_run_or_marked() -> None:
    kinds: dict[str, dict[str, int]] = {}
    for page in PAGES:
        text = page.read_text()
        indented = re.findall(r"^[ \t]+```python", text, re.M)
        assert not indented, f"{_name(page)}: an indented python fence is not run"
        for info, code in _blocks(page):
            kind = _kind(info, code)
            kinds.setdefault(kind, {}).setdefault(_name(page), 0)
            kinds[kind][_name(page)] += 1
            if kind == "include":
                path, section = INCLUDE.match(code.strip()).groups()
                source = (ROOT / path).read_text()
                assert f"# --8<-- [start:{section}]" in source, (path, section)
                assert f"# --8<-- [end:{section}]" in source, (path, section)
                assert path in (ROOT / INCLUDED[path]).read_text(), path
    assert kinds.get("gpu", {}) == GPU_BLOCKS
    assert set(kinds.get("include", {})) <= {
        _name(p) for p in PAGES if "--8<--" in p.read_text()}
    assert len(kinds["run"]) >= 7  # README and the pages that teach the API


def _slug(heading: str) -> str:
    """A heading's anchor as MkDocs' and GitHub's renderers make it (for the headings here)."""
    return re.sub(r"[\s]+", "-", re.sub(r"[^\w\s-]", "", heading.strip().lower()))


def test_readme_is_short_and_its_links_resolve() -> None:
    readme = (ROOT / "README.md").read_text()
    lines = readme.splitlines()
    assert len(lines) <= 150
    head = "\n".join(lines[:40])
    # the first 40 lines: the dated GPU comparison, install and one command
    assert "2026-12-04" in head and "checkpointing" in head
    assert "pip install -e . && slackswap reproduce" in head
    for target in re.findall(r"\]\((docs/[^)\s]+)\)", readme):
        path, _, anchor = target.partition("#")
        assert (ROOT / path).exists(), target
        if anchor:
            headings = re.findall(r"^#+ (.*)$", (ROOT / path).read_text(), re.M)
            assert anchor in {_slug(h) for h in headings}, target


def test_readme_test_command_is_what_ci_runs() -> None:
    """.ci/run runs "the README's test command": the two must not drift apart."""
    readme = (ROOT / "README.md").read_text()
    command = ('pip install torch==2.13.0 && pip install -e ".[test]" && '
               "python -m pytest -n auto --dist worksteal")
    assert command in readme
    ci = (ROOT / ".ci" / "run").read_text()
    assert command.split(" && ", 1)[1] in ci
