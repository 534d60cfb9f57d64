"""Files written as a shell would write them (issue 14, item 4)."""

from __future__ import annotations

import errno
import json
import os
import stat
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from slackswap.cli import main
from slackswap.core.jsonio import atomic_write, atomic_write_text, dump_model, load_model
from slackswap.core.profile import StepProfile
from slackswap.errors import InputError

PRESET = Path(__file__).parents[1] / "src/slackswap/hardware/presets/a100-80gb.toml"


def run(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, list(args))
    return result.exit_code, result.stdout, result.stderr


def assert_one_line_error(code: int, stderr: str, message: str) -> None:
    assert code == 2, stderr
    assert stderr.startswith("error: ") and message in stderr, stderr
    assert stderr.count("\n") == 1 and "Traceback" not in stderr


@pytest.fixture(scope="module")
def profile() -> StepProfile:
    """A real profile of a small residual MLP (three blocks, dropout, layer norms), read
    from a file so that these tests need no torch; made by ``slackswap.profile(
    *factories.mlp(), "a100-80gb", name="mlp")``."""
    return load_model(StepProfile, Path(__file__).parent / "data" / "mlp-profile.json")


@pytest.fixture
def profile_file(tmp_path, profile) -> Path:
    path = tmp_path / "p.json"
    dump_model(profile, path)
    return path


@pytest.fixture
def umask() -> Iterator[None]:
    old = os.umask(0o022)
    yield
    os.umask(old)


# -- item 4: files --------------------------------------------------------------------


@pytest.mark.usefixtures("umask")
def test_new_files_follow_the_umask_and_old_files_keep_their_mode(tmp_path) -> None:
    path = tmp_path / "out.json"
    for mask in (0o022, 0o077, 0o002):
        path.unlink(missing_ok=True)
        os.umask(mask)
        atomic_write_text(path, "x")
        assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~mask
    path.chmod(0o644)
    os.umask(0o077)
    atomic_write_text(path, "y")
    assert stat.S_IMODE(path.stat().st_mode) == 0o644 and path.read_text() == "y"


def test_a_symlink_is_written_through(tmp_path) -> None:
    target, link = tmp_path / "real" / "plan.json", tmp_path / "plan.json"
    target.parent.mkdir()
    target.write_text("old")
    link.symlink_to(target)
    atomic_write_text(link, "new")
    assert link.is_symlink() and target.read_text() == "new"
    dangling = tmp_path / "dangling.json"
    dangling.symlink_to(tmp_path / "made" / "here.json")
    atomic_write_text(dangling, "made")
    assert dangling.is_symlink() and dangling.read_text() == "made"


def test_a_fifo_is_written_through(tmp_path) -> None:
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_bytes()), daemon=True)
    reader.start()
    atomic_write_text(fifo, "through the pipe")
    reader.join(5)
    assert got == [b"through the pipe"] and stat.S_ISFIFO(fifo.stat().st_mode)


@pytest.mark.skipif(os.geteuid() != 0, reason="making a device node needs root")
def test_a_device_is_written_through(tmp_path, profile_file) -> None:
    """As root, ``-o`` naming a device (a /dev/null of our own) writes into it."""
    null = tmp_path / "null"
    os.mknod(null, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    code, stdout, stderr = run("plan", str(profile_file), "--budget", "0.8", "-o", str(null))
    assert code == 0, stderr
    assert stat.S_ISCHR(null.stat().st_mode)


@pytest.mark.parametrize(("path", "message"), [
    ("/proc/no-such-folder/plan.json", "cannot write /proc/no-such-folder/plan.json: "),
    ("/proc/self/status", "cannot write /proc/self/status: "),
    ("/dev/full", "cannot write /dev/full: No space left on device"),
])
def test_unwritable_outputs_are_one_line_errors(profile_file, path, message) -> None:
    if not Path(path).parent.exists() and path.startswith("/dev"):
        pytest.skip(f"{path} is not on this system")
    code, _, stderr = run("plan", str(profile_file), "--budget", "0.8", "-o", path)
    assert_one_line_error(code, stderr, message)


def test_a_full_disk_leaves_the_old_file(tmp_path) -> None:
    path = tmp_path / "out.json"
    path.write_text("old")

    def fill(f: Any) -> None:
        f.write(b"half")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with pytest.raises(InputError, match=r"cannot write .*out\.json: No space left on device"):
        atomic_write(path, fill)
    assert path.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["out.json"]


def test_plot_and_trace_into_a_missing_folder(tmp_path, profile_file) -> None:
    plot, trace = tmp_path / "new" / "m.png", tmp_path / "other" / "deeper" / "t.json"
    code, _, stderr = run("simulate", str(profile_file), "--plot", str(plot),
                          "--trace", str(trace))
    assert code == 0, stderr
    assert plot.stat().st_size > 0 and json.loads(trace.read_text())["traceEvents"]
