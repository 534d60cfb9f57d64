import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest
from hypothesis import settings

# Tests name custom models as ``factories:NAME``; make that module importable.
sys.path.insert(0, str(Path(__file__).parent))

# CI runs the same examples every time; local runs keep exploring new ones.
settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")


def pytest_configure(config: pytest.Config) -> None:
    """The profiles and plans the tests cache go to one folder of this run, shared by
    the xdist workers and the processes tests spawn (they inherit the environment),
    never to the user's cache, so every run starts cold, as CI does."""
    # pytest-xdist's workers run with ``COLUMNS=80`` in their environment, which the command
    # line honours as a user's (NOTE [piped width] in ``slackswap/cli.py``): the tests read
    # its output as a pipe without one gives it, with or without xdist
    os.environ.pop("COLUMNS", None)
    if not hasattr(config, "workerinput"):  # the controller (or a run without xdist)
        config._slackswap_cache = tempfile.mkdtemp(prefix="slackswap-tests-")
        os.environ["SLACKSWAP_CACHE"] = config._slackswap_cache


def pytest_unconfigure(config: pytest.Config) -> None:
    folder = getattr(config, "_slackswap_cache", None)
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(autouse=True)
def _own_cache_when_patched(request: pytest.FixtureRequest,
                            tmp_path_factory: pytest.TempPathFactory) -> None:
    """A test that monkeypatches gets a cache of its own: a plan made with a patched
    planner must not reach other tests, nor one made without it this test."""
    if "monkeypatch" in request.fixturenames:
        folder = tmp_path_factory.mktemp("cache")
        request.getfixturevalue("monkeypatch").setenv("SLACKSWAP_CACHE", str(folder))

