"""Files written atomically and never through a link, files read with limits, and bad
input refused in one line (issue 14, items 4 and 5; issue 50): every file is validated on
load, random corruptions of valid files give a clean error or a valid result, never a
hang or a traceback."""

from __future__ import annotations

import errno
import json
import math
import os
import signal
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from slackswap.cli import main
from slackswap.core.costmodel import op_time
from slackswap.core.hardware import load_hardware, with_overrides
from slackswap.core.jsonio import (
    atomic_write,
    atomic_write_text,
    dump_model,
    json_text,
    load_model,
)
from slackswap.core.plan import Decision, Plan
from slackswap.core.profile import StepProfile
from slackswap.core.result import SimResult
from slackswap.core.units import parse_bytes, resolve_budget
from slackswap.errors import InputError, SlackSwapError
from slackswap.planners.api import plan_with_result
from slackswap.sim import simulate

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


def test_a_symlink_is_never_written_through(tmp_path) -> None:
    """Issue 50: a link at the output's name, to a file or to nothing, is refused and
    left as it was; the file it points to is not touched."""
    target, link = tmp_path / "real" / "plan.json", tmp_path / "plan.json"
    target.parent.mkdir()
    target.write_text("old")
    link.symlink_to(target)
    with pytest.raises(InputError, match=r"refusing to write .*plan\.json: it is a "
                                         "symbolic link, not a regular file"):
        atomic_write_text(link, "new")
    assert link.is_symlink() and target.read_text() == "old"
    dangling = tmp_path / "dangling.json"
    dangling.symlink_to(tmp_path / "made" / "here.json")
    with pytest.raises(InputError, match="symbolic link"):
        atomic_write_text(dangling, "made")
    assert dangling.is_symlink() and not (tmp_path / "made").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dangling.json", "plan.json",
                                                          "real"]  # no temporary left


@pytest.mark.parametrize("option", ["-o", "--trace", "--plot"])
def test_outputs_never_write_through_a_symlink(tmp_path, profile_file, option) -> None:
    victim, link = tmp_path / "victim.txt", tmp_path / "out"
    victim.write_text("precious")
    link.symlink_to(victim)
    command = ["plan", str(profile_file), "--budget", "0.8"] if option == "-o" else [
        "simulate", str(profile_file)]
    code, _, stderr = run(*command, option, str(link))
    assert_one_line_error(code, stderr, f"refusing to write {link}: it is a symbolic link")
    assert victim.read_text() == "precious" and link.is_symlink()


def test_the_memory_plot_is_written_as_other_files_are(tmp_path, profile) -> None:
    """The PNG writer goes through ``atomic_write`` too: with the umask's mode, into a
    folder it makes, never through a link."""
    from slackswap.sim.outputs import write_memory_plot

    result = simulate(profile, None, "a100-80gb")
    os.umask(0o022)
    path = tmp_path / "new" / "m.png"
    write_memory_plot(result, path)
    assert path.read_bytes().startswith(b"\x89PNG")
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    target, link = tmp_path / "real.png", tmp_path / "m.png"
    target.write_bytes(b"old")
    link.symlink_to(target)
    with pytest.raises(InputError, match="symbolic link"):
        write_memory_plot(result, link)
    assert target.read_bytes() == b"old"


def test_a_fifo_is_refused_not_waited_on(tmp_path, profile_file) -> None:
    """Issue 50: ``-o`` naming a FIFO is a one-line error at once; nothing blocks on it."""
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    with time_limit(10):
        with pytest.raises(InputError, match="it is a FIFO, not a regular file"):
            atomic_write_text(fifo, "into the pipe")
        code, _, stderr = run("plan", str(profile_file), "--budget", "0.8", "-o", str(fifo))
    assert_one_line_error(code, stderr, f"refusing to write {fifo}: it is a FIFO")
    assert stat.S_ISFIFO(fifo.stat().st_mode)


@pytest.mark.skipif(os.geteuid() != 0, reason="making a device node needs root")
def test_a_device_is_refused(tmp_path, profile_file) -> None:
    """As root, ``-o`` naming a device (a /dev/null of our own) is refused, and the node
    stays."""
    null = tmp_path / "null"
    os.mknod(null, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    code, stdout, stderr = run("plan", str(profile_file), "--budget", "0.8", "-o", str(null))
    assert_one_line_error(code, stderr, "it is a device, not a regular file")
    assert stat.S_ISCHR(null.stat().st_mode)


def test_a_planted_temporary_name_is_not_followed(tmp_path, monkeypatch) -> None:
    """The temporary file is made with O_EXCL | O_NOFOLLOW: a link planted at the name
    it draws is skipped, never written through."""
    import slackswap.core.jsonio as jsonio

    victim = tmp_path / "victim"
    victim.write_text("precious")
    draws = iter(["planted", "fresh"])
    monkeypatch.setattr(jsonio.secrets, "token_hex", lambda n: next(draws))
    (tmp_path / ".out.json.planted.tmp").symlink_to(victim)
    atomic_write_text(tmp_path / "out.json", "new")
    assert victim.read_text() == "precious" and (tmp_path / "out.json").read_text() == "new"


@pytest.mark.parametrize(("path", "message"), [
    ("/proc/no-such-folder/plan.json", "cannot write /proc/no-such-folder/plan.json: "),
    ("/proc/self/status", "cannot write /proc/self/status: "),
    ("/dev/full", "refusing to write /dev/full: it is a device, not a regular file"),
    ("", "cannot write '': the file name is empty"),
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


# -- item 5: bad input ----------------------------------------------------------------


def _corrupt(path: Path, edit: Any) -> None:
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


def _set(where: str, value: Any) -> Any:
    def edit(data: Any) -> None:
        *parents, last = where.split(".")
        for part in parents:
            data = data[int(part) if part.isdigit() else part]
        data[int(last) if last.isdigit() else last] = value
    return edit


@pytest.mark.parametrize(("edit", "message"), [
    (_set("ops.3.time_s", math.nan), "field 'ops.3.time_s'"),
    (_set("ops.3.time_s", math.inf), "field 'ops.3.time_s'"),
    (_set("ops.3.time_s", -1e-3), "field 'ops.3.time_s': Input should be greater than"),
    (_set("ops.3.flops", -5.0), "field 'ops.3.flops'"),
    (_set("tensors.5.bytes", -100), "field 'tensors.5.bytes'"),
    (_set("model_state_bytes", -1), "field 'model_state_bytes'"),
    (_set("ops.3.inputs", [0, 10**6]), "ops.3.inputs: tensor 1000000 is not in the profile"),
    (_set("tensors.5.producer", 999), "tensors.5.producer: op 999 is not in the profile"),
    (_set("tensors.5.backward_consumers", [999]), "tensors.5.backward_consumers: op 999"),
    (_set("tensors.5.id", 7), "tensors.5.id is 7"),
    (_set("ops.4.index", 3), "ops.4.index is 3"),
    (_set("saves", [[10**6, 0]]), "saves: tensor 1000000 is not in the profile"),
])
def test_bad_profile_values_are_refused_on_load(profile_file, edit, message) -> None:
    _corrupt(profile_file, edit)
    with pytest.raises(InputError) as info:
        load_model(StepProfile, profile_file)
    assert message in str(info.value) and "\n" not in str(info.value)
    code, _, stderr = run("simulate", str(profile_file))
    assert_one_line_error(code, stderr, message)


def test_bad_plan_values_are_refused_on_load(tmp_path, profile) -> None:
    path = tmp_path / "plan.json"
    for edit, message in ((_set("budget_bytes", -1), "field 'budget_bytes'"),
                          (_set("prefetch", {"x": -3}), "field 'prefetch.x'")):
        dump_model(Plan.keep_all(profile), path)
        _corrupt(path, edit)
        with pytest.raises(InputError, match=message):
            load_model(Plan, path)


@pytest.mark.parametrize("budget", ["1e400", "inf", "-inf", "nan", math.inf, 10**400,
                                    "1e400GiB", 1e300])
def test_huge_and_infinite_budgets_are_one_line_errors(budget) -> None:
    with pytest.raises(InputError, match="budget|byte count|more bytes than any memory"):
        resolve_budget(budget, 1000)


def test_huge_budget_on_the_command_line(profile_file) -> None:
    code, _, stderr = run("plan", str(profile_file), "--budget", "1e400")
    assert_one_line_error(code, stderr, "budget '1e400' must be a finite number")
    code, _, stderr = run("simulate", str(profile_file), "--memory-limit", "1e400")
    assert_one_line_error(code, stderr, "must be a finite number")


def _edited_preset(tmp_path: Path, old: str, new: str) -> Path:
    text = PRESET.read_text()
    assert old in text
    path = tmp_path / "gpu.toml"
    path.write_text(text.replace(old, new, 1))
    return path


@pytest.mark.parametrize(("old", "new", "message"), [
    ("fp32 = 19.5e12, ", "", "field 'compute.peak_flops': needs an fp32 peak"),
    ("latency_s = 1e-5", "latency_s = inf", "field 'host_link.latency_s'"),
    ("min_kernel_time_s = 1.3e-6", "min_kernel_time_s = inf", "compute.min_kernel_time_s"),
    ("d2h_bandwidth = 24.8e9", "d2h_bandwidth = nan", "field 'host_link.d2h_bandwidth'"),
    ("schema_version = 1", "schema_version = 999", "schema_version 999 is newer"),
    ("schema_version = 1", "schema_version = 0", "schema_version 0"),
])
def test_bad_hardware_files_are_one_line_errors(tmp_path, profile_file, old, new,
                                                message) -> None:
    path = _edited_preset(tmp_path, old, new)
    with pytest.raises(InputError, match=message):
        load_hardware(path)
    code, _, stderr = run("simulate", str(profile_file), "--hardware", str(path))
    assert_one_line_error(code, stderr, message)


def test_plan_reads_a_profile_file_of_any_name(tmp_path, profile_file) -> None:
    other = tmp_path / "x.profile"
    profile_file.rename(other)
    code, stdout, stderr = run("plan", str(other), "--budget", "0.8")
    assert code == 0, stderr
    assert "predicted retention" in stdout


# -- property: random corruptions of valid files --------------------------------------


@contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """Fail, rather than hang, when the body runs longer than ``seconds``."""
    def expire(*_: Any) -> None:
        raise TimeoutError(f"ran longer than {seconds} s: a hang")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


# what a hand edit or a damaged file may hold: out-of-range, non-finite and negative
# numbers, wrong types, and values valid elsewhere (other ids, other phases, decisions)
BAD_VALUES = [math.nan, math.inf, -math.inf, -1, -1.5, 0, 1, 7, 30, 1e308, 1e-308, 2**70,
              10**6, "x", "backward", "forward", "offload", "recompute", None, True, [], {},
              [-1], [3], [10**6]]


def _places(data: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every place in parsed JSON: keys of objects and indices of arrays, nested."""
    items = data.items() if isinstance(data, dict) else (
        enumerate(data) if isinstance(data, list) else ())
    out = []
    for key, value in items:
        out.append((*prefix, key))
        out += _places(value, (*prefix, key))
    return out


def corrupted(data: st.DataObject, original: Any) -> Any:
    """``original`` (parsed JSON) with one to three places replaced, removed or repeated."""
    copy = json.loads(json.dumps(original))
    places = _places(copy)
    for _ in range(data.draw(st.integers(1, 3), label="edits")):
        place = data.draw(st.sampled_from(places), label="place")
        action = data.draw(st.sampled_from(["replace", "replace", "remove", "repeat"]),
                           label="action")
        value = data.draw(st.sampled_from(BAD_VALUES), label="value")
        try:
            parent = copy
            for key in place[:-1]:
                parent = parent[key]
            key = place[-1]
            if action == "replace":
                parent[key] = json.loads(json.dumps(value))  # a fresh [] or {} each time
            elif action == "remove":
                del parent[key]
            elif isinstance(parent, list):
                parent.insert(key, parent[key])
            else:
                parent[key] = [parent[key], parent[key]]
        except (KeyError, IndexError, TypeError):
            pass  # an earlier edit moved this place
    return copy


def _clean(error: SlackSwapError) -> None:
    assert str(error) and "\n" not in str(error)


PROPERTY = settings(max_examples=40, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture,
                                           HealthCheck.too_slow])


def _load(cls: type, data: Any, tmp_path: Path) -> Any:
    path = tmp_path / "corrupt.json"
    path.write_text(json.dumps(data))
    return load_model(cls, path)


@PROPERTY
@given(data=st.data())
def test_corrupted_profiles(profile, tmp_path, data) -> None:
    corrupt = corrupted(data, json.loads(profile.model_dump_json()))
    with time_limit(20):
        try:
            loaded = _load(StepProfile, corrupt, tmp_path)
            simulate(loaded, None, "a100-80gb")
            simulate(loaded, None, "a100-80gb", 0.6)
            plan_with_result(loaded, 0.6, "a100-80gb")
        except SlackSwapError as e:
            _clean(e)


@pytest.fixture(scope="module")
def moving_plan(profile) -> Plan:
    attempt = plan_with_result(profile, 0.5, "a100-80gb")
    assert attempt is not None and attempt[1].feasible
    assert set(attempt[0].decisions.values()) > {"keep"}
    return attempt[0]


@PROPERTY
@given(data=st.data())
def test_corrupted_plans(profile, moving_plan, tmp_path, data) -> None:
    corrupt = corrupted(data, json.loads(moving_plan.model_dump_json()))
    with time_limit(20):
        try:
            simulate(profile, _load(Plan, corrupt, tmp_path), "a100-80gb", 0.5)
        except SlackSwapError as e:
            _clean(e)


LINE_VALUES = ["nan", "inf", "-inf", "-1", "0", "1e308", "1e-308", "999", '"x"', "[]",
               "[[0, 1.0]]", "{ fp32 = 1e12 }", "true"]


@PROPERTY
@given(data=st.data())
def test_corrupted_hardware_files(profile, tmp_path, data) -> None:
    lines = PRESET.read_text().splitlines()
    settings_lines = [i for i, line in enumerate(lines) if "=" in line
                      and not line.lstrip().startswith(("#", '"'))]
    for _ in range(data.draw(st.integers(1, 3))):
        i = data.draw(st.sampled_from(settings_lines))
        if data.draw(st.booleans()):
            lines[i] = ""
        else:
            lines[i] = lines[i].split("=")[0] + "= " + data.draw(st.sampled_from(LINE_VALUES))
    path = tmp_path / "gpu.toml"
    path.write_text("\n".join(lines))
    with time_limit(20):
        try:
            hw = load_hardware(path)
        except SlackSwapError as e:
            _clean(e)
            return
        priced = [op.model_copy(update={"time_s": op_time(op, hw)}) for op in profile.ops]
        repriced = profile.model_copy(update={"ops": priced, "hardware": str(path)})
        try:
            simulate(repriced, None, hw, 0.6)
            plan_with_result(repriced, 0.6, hw)
        except SlackSwapError as e:
            _clean(e)
        # a profile priced on hardware that loads can be read back
        _load(StepProfile, json.loads(repriced.model_dump_json()), tmp_path)


# -- issue 50: nothing a file says can harm the machine or the result ------------------


@pytest.mark.parametrize("option", ["profile", "--plan", "--hardware"])
def test_a_device_is_not_read(profile_file, option) -> None:
    """``/dev/zero`` never ends: it is refused at once, as anything not a regular file."""
    args = ["/dev/zero"] if option == "profile" else [str(profile_file), option, "/dev/zero"]
    with time_limit(10):
        code, _, stderr = run("simulate", *args)
    assert_one_line_error(code, stderr, "/dev/zero: it is a device, not a regular file")


def test_a_fifo_is_not_waited_on(tmp_path) -> None:
    fifo = tmp_path / "p.json"
    os.mkfifo(fifo)
    with time_limit(10):
        code, _, stderr = run("simulate", str(fifo))
    assert_one_line_error(code, stderr, "it is a FIFO, not a regular file")


def test_a_file_over_the_limit_is_not_read(profile_file, monkeypatch) -> None:
    import slackswap.core.jsonio as jsonio

    monkeypatch.setattr(jsonio, "MAX_FILE_BYTES", 1000)
    code, _, stderr = run("simulate", str(profile_file))
    assert_one_line_error(code, stderr, "over the 1000 bytes a profile may be")


@pytest.mark.parametrize("hardware", ["/dev/zero", "gpu.toml", "../a100-80gb.toml",
                                      "x" * 10_000])
def test_the_hardware_a_profile_names_is_a_preset_never_a_path(tmp_path, profile_file,
                                                               hardware) -> None:
    """Issue 50: the profile's ``hardware`` field is a preset name; a file is read only
    when the user names it with --hardware."""
    (tmp_path / "gpu.toml").write_text(PRESET.read_text())
    _corrupt(profile_file, _set("hardware", hardware))
    for command in (["simulate", str(profile_file)],
                    ["plan", str(profile_file), "--budget", "0.8"]):
        with time_limit(10):
            code, _, stderr = run(*command)
        assert_one_line_error(code, stderr, "is not a preset")
        assert len(stderr) < 1000
    code, _, stderr = run("simulate", str(profile_file), "--hardware",
                          str(tmp_path / "gpu.toml"))
    assert code == 0, stderr


@pytest.mark.parametrize(("base", "message"), [
    ('"/dev/zero"', "it is a device, not a regular file"),
    ('"gpu.toml"', "base 'gpu.toml' leads back to itself"),
    ('"other.toml"', "leads back to itself"),
    ("5", "base must be a preset name or a .toml file's path in quotes, not 5"),
    ('""', "base must be a preset name"),
    ("[1, 2]", "base must be a preset name"),
])
def test_bad_bases_are_one_line_errors(tmp_path, monkeypatch, base, message) -> None:
    monkeypatch.chdir(tmp_path)
    text = PRESET.read_text().replace("schema_version = 1", f"schema_version = 1\nbase = {base}")
    (tmp_path / "gpu.toml").write_text(text)
    (tmp_path / "other.toml").write_text('base = "gpu.toml"\n')
    with time_limit(10), pytest.raises(InputError, match=message) as info:
        load_hardware("gpu.toml")
    _clean(info.value)


@pytest.mark.parametrize("kind", ["profile", "plan", "hardware"])
def test_bytes_that_are_not_utf8_are_one_line_errors(tmp_path, profile_file, kind) -> None:
    bad = tmp_path / ("bad.toml" if kind == "hardware" else "bad.json")
    bad.write_bytes(b'{"model": "\xff\xfe"}' if kind != "hardware" else b'name = "\xff"\n')
    args = {"profile": [str(bad)], "plan": [str(profile_file), "--plan", str(bad)],
            "hardware": [str(profile_file), "--hardware", str(bad)]}[kind]
    code, _, stderr = run("simulate", *args)
    assert_one_line_error(code, stderr, "not UTF-8 text (byte ")


@pytest.mark.parametrize("depth", [500, 100_000])
def test_deeply_nested_json_is_a_one_line_error(tmp_path, depth) -> None:
    path = tmp_path / "deep.json"
    path.write_text('{"model": ' + "[" * depth + "]" * depth + "}")
    code, _, stderr = run("simulate", str(path))
    assert code == 2 and stderr.count("\n") == 1 and "Traceback" not in stderr, stderr


def test_deeply_nested_toml_is_a_one_line_error(tmp_path, profile_file) -> None:
    path = tmp_path / "deep.toml"
    path.write_text("x = " + "[" * 100_000 + "]" * 100_000 + "\n")
    code, _, stderr = run("simulate", str(profile_file), "--hardware", str(path))
    assert code == 2 and stderr.count("\n") == 1 and "Traceback" not in stderr, stderr


def test_an_op_that_reads_what_it_makes_is_refused(profile_file, profile) -> None:
    """It would need the tensor to rebuild the tensor (a RecursionError in the schedule)."""
    t = next(t for t in profile.tensors if t.saved and t.producer is not None)
    op = profile.ops[t.producer]
    _corrupt(profile_file, _set(f"ops.{op.index}.inputs", [*op.inputs, t.id]))
    data = json.loads(profile_file.read_text())
    data["tensors"][t.id]["forward_consumers"] = sorted({*t.forward_consumers, op.index})
    profile_file.write_text(json.dumps(data))
    code, _, stderr = run("simulate", str(profile_file))
    assert_one_line_error(code, stderr, f"op {op.index} reads tensor {t.id}, which it makes")


def test_one_op_making_every_tensor_is_checked_in_linear_time(tmp_path, profile) -> None:
    """NOTE [files]: a profile's checks looked each tensor up in its producer's list of
    outputs: one op listing 60,000 tensors (11 MB) took over a minute to load, a
    256 MB file days. Now a few seconds."""
    n = 60_000
    data = json.loads(profile.model_dump_json())
    first, last = data["ops"][0], data["ops"][-1]
    first.update(index=0, phase="forward", inputs=[], outputs=list(range(n)))
    last.update(index=1, phase="backward", inputs=[], outputs=[])
    data.update(ops=[first, last], saves=[], module_events=[], layers=[], tensors=[
        {"id": i, "name": f"t{i}", "kind": "activation", "bytes": 4, "dtype": "fp32",
         "shape": [1], "producer": 0} for i in range(n)])
    path = tmp_path / "wide.json"
    path.write_text(json.dumps(data))
    with time_limit(20):
        assert len(load_model(StepProfile, path).tensors) == n


@pytest.mark.parametrize("args", [["fit", "gpt2-xl", "--seq", "99999999999999999999"],
                                  ["profile", "bert-large", "--batch", "100000000"]])
def test_shapes_too_large_for_a_profile_are_one_line_errors(args) -> None:
    code, _, stderr = run(*args)
    assert_one_line_error(code, stderr, "a profile takes; use a smaller --batch or --seq")


def test_an_output_that_names_no_file_is_refused(tmp_path, profile_file) -> None:
    for output, message in ((f"{tmp_path}/newdir/", "it names a folder"),
                            ("", "the file name is empty")):
        code, _, stderr = run("plan", str(profile_file), "--budget", "0.8", "-o", output)
        assert_one_line_error(code, stderr, message)
    assert [p.name for p in tmp_path.iterdir()] == ["p.json"]


@pytest.mark.parametrize("model", ["[link=https://example.com]click[/link]", "[red]x[/red]",
                                   "a\x1b[2Jb\x07", "m" * 10_000_000])
def test_names_from_a_file_are_printed_as_text(profile_file, model) -> None:
    """Issue 50: a profile's model name is printed as it is written, never read as rich
    markup; control characters are escaped and a long name is cut (a 10 MB one had
    rich's highlighter hang)."""
    _corrupt(profile_file, _set("model", model))
    with time_limit(20):
        for command in (["simulate", str(profile_file)],
                        ["plan", str(profile_file), "--budget", "0.8"]):
            code, stdout, stderr = run(*command)
            assert code == 0, stderr
            first = stdout.splitlines()[0]
            assert "\x1b" not in stdout and "\x07" not in stdout
            if model.startswith("["):
                assert first.startswith(model)
            elif model.startswith("a"):
                assert first.startswith("a\\x1b[2Jb\\x07")
            else:
                assert "m" * 200 not in stdout.replace("\n", "") and "m..." in stdout


@pytest.mark.parametrize(("command", "option"), [
    (["plan", "{p}", "--budget", "0.8"], "-o"),
    (["simulate", "{p}"], "--trace"),
    (["simulate", "{p}"], "--plot"),
])
def test_an_output_that_is_an_input_is_refused(profile_file, command, option) -> None:
    """Issue 50: ``plan p.json -o p.json`` would replace the profile with its plan."""
    before = profile_file.read_bytes()
    args = [a.replace("{p}", str(profile_file)) for a in command]
    same = str(profile_file.parent / "." / profile_file.name)  # the same file, spelt apart
    code, _, stderr = run(*args, option, same)
    assert_one_line_error(code, stderr, f"{option} {same} is an input of this command")
    assert profile_file.read_bytes() == before


def test_trace_and_plot_onto_one_file_and_a_plot_not_png_are_refused(tmp_path,
                                                                     profile_file) -> None:
    out = tmp_path / "out"
    code, _, stderr = run("simulate", str(profile_file), "--trace", str(out), "--plot",
                          str(out))
    assert_one_line_error(code, stderr, "--plot and --trace name the same file")
    code, _, stderr = run("simulate", str(profile_file), "--plot", str(tmp_path / "m.pdf"))
    assert_one_line_error(code, stderr, "the plot is a PNG image; name a .png file")
    assert not out.exists() and not (tmp_path / "m.pdf").exists()


# -- issue 50, item 8: values accepted that mean nothing --------------------------------


@pytest.mark.parametrize(("edit", "message"), [
    (_set("ops.3.time_s", True), "field 'ops.3.time_s': Input should be a valid number"),
    (_set("ops.3.time_s", "0.001"), "field 'ops.3.time_s': Input should be a valid number"),
    (_set("tensors.5.bytes", True), "field 'tensors.5.bytes': Input should be a valid integer"),
    (_set("tensors.5.bytes", 1024.0), "field 'tensors.5.bytes': Input should be a valid int"),
    (_set("model_state_bytes", "8"), "field 'model_state_bytes': Input should be a valid int"),
    (_set("ops.3.random", 1), "field 'ops.3.random': Input should be a valid boolean"),
    (_set("tensors.5.saved", "yes"), "field 'tensors.5.saved': Input should be a valid bool"),
    (_set("saves", [[True, 0]]), "field 'saves.0.0': Input should be a valid integer"),
    (_set("schema_version", "3"), 'schema_version "3" is not a version: a whole number from '
                                  "1 to 3, unquoted; fix the file"),
    (_set("schema_version", True), "schema_version true is not a version"),
    (_set("schema_version", 2.0), "schema_version 2.0 is not a version"),
    (_set("schema_version", 4), "schema_version 4 is newer than this SlackSwap reads (3); "
                                "upgrade slackswap"),
    (_set("ops.3.time_s", 1e308), "field 'ops.3.time_s': 1e+308 is not a kernel's time in "
                                  "seconds: none is over 86400"),
    (_set("ops.3.flops", 1e300), "field 'ops.3.flops': 1e+300 is not a kernel's FLOPs"),
    (_set("ops", []), "ops: there are none, so there is no step to simulate or plan"),
])
def test_values_that_mean_nothing_are_refused_on_load(profile_file, edit, message) -> None:
    """Issue 50, item 8: strict JSON types (NOTE [strict types]: ``true`` is not 1 s or 1
    byte, ``"3"`` not a version), absurd op times and an empty profile, refused in one
    line naming the field, through the library and the command line."""
    _corrupt(profile_file, edit)
    with pytest.raises(InputError) as info:
        load_model(StepProfile, profile_file)
    assert message in str(info.value) and "\n" not in str(info.value)
    for command in (["simulate", str(profile_file)],
                    ["plan", str(profile_file), "--budget", "0.5"]):
        code, _, stderr = run(*command)
        assert_one_line_error(code, stderr, message)


def test_strict_types_in_plans_and_results(tmp_path, profile, moving_plan) -> None:
    path = tmp_path / "plan.json"
    for edit, message in ((_set("budget_bytes", True), "field 'budget_bytes': Input should"),
                          (_set("prefetch", {"x": 1.0}), "field 'prefetch.x': Input should"),
                          (_set("schema_version", "1"), 'schema_version "1" is not a version'),
                          (_set("decisions", {"x": True}), "field 'decisions.x'")):
        dump_model(moving_plan, path)
        _corrupt(path, edit)
        with pytest.raises(InputError, match=message):
            load_model(Plan, path)
    result = simulate(profile, moving_plan, "a100-80gb", 0.5)
    for edit, message in ((_set("feasible", 1), "field 'feasible': Input should be a valid"),
                          (_set("retention", True), "field 'retention': Input should be a"),
                          (_set("peak_bytes", 1.5), "field 'peak_bytes': Input should be"),
                          (_set("schema_version", "2"), 'schema_version "2" is not')):
        dump_model(result, path)
        assert SimResult.load(path).model_dump() == result.model_dump()
        _corrupt(path, edit)
        with pytest.raises(InputError, match=message):
            SimResult.load(path)


@pytest.mark.parametrize(("old", "new", "message"), [
    ("latency_s = 1e-5", "latency_s = true", "field 'host_link.latency_s': Input should be a "
                                             "valid number"),
    ("schema_version = 1", 'schema_version = "1"', 'schema_version "1" is not a version'),
    ("latency_s = 1e-5", "latency_s = 1979-05-27", "field 'host_link.latency_s'"),
])
def test_strict_types_in_hardware_files(tmp_path, profile_file, old, new, message) -> None:
    path = _edited_preset(tmp_path, old, new)
    with pytest.raises(InputError, match=message):
        load_hardware(path)
    code, _, stderr = run("simulate", str(profile_file), "--hardware", str(path))
    assert_one_line_error(code, stderr, message)


def test_strict_types_in_hardware_overrides(profile_file) -> None:
    hw = load_hardware("a100-80gb")
    with pytest.raises(InputError, match="host_link.latency_s=True: Input should be a valid"):
        with_overrides(hw, {"host_link.latency_s": True})
    assert with_overrides(hw, {"host_link.latency_s": 0}).host_link.latency_s == 0.0
    code, _, stderr = run("simulate", str(profile_file), "--set", "node.gpus=true",
                          "--hardware", "dgx-a100")
    assert code == 2 and "Input should be a valid integer" in stderr, stderr
    # a host table a file leaves out still takes the defaults and cites their sources
    assert hw.sources["host.pack_s"].startswith("default (NOTE [host costs])")


def test_a_profile_that_saves_nothing_is_not_planned(profile_file, profile) -> None:
    """Issue 50, item 8: a profile with nothing saved for backward has nothing to plan:
    refused in one line (it was a KeyError), while simulating it reports the step."""
    data = json.loads(profile_file.read_text())
    for t in data["tensors"]:
        t["saved"], t["first_backward_use"] = False, None
    profile_file.write_text(json.dumps(data))
    empty = load_model(StepProfile, profile_file)
    assert not empty.saved_activations
    for budget in ("0.5", "1GiB"):
        code, _, stderr = run("plan", str(profile_file), "--budget", budget)
        assert_one_line_error(code, stderr, "the profile saves no activations for backward: "
                                            "there is nothing to plan")
    result = simulate(empty)
    assert result.feasible and 0 < result.retention <= 1


def test_a_step_that_takes_no_time_retains_all_of_it(profile) -> None:
    free = profile.model_copy(update={"ops": [op.model_copy(update={"time_s": 0.0})
                                              for op in profile.ops]})
    hw = with_overrides(load_hardware("a100-80gb"), {f"host.{name}": 0 for name in (
        "dispatch_s", "pack_s", "watch_s", "replay_s", "unpack_s")})
    result = simulate(free, None, hw)
    assert result.step_time_s == 0 and result.feasible and result.retention == 1.0


def test_a_plan_that_prefetches_what_it_keeps_is_refused(tmp_path, profile_file, profile,
                                                         moving_plan) -> None:
    kept = next(n for n, d in moving_plan.decisions.items() if d == "keep")
    offloaded = next(n for n in moving_plan.prefetch if n in profile.recomputable)
    for name, what in ((kept, "keeps"), (offloaded, "recomputes")):
        plan = moving_plan.model_copy(update={
            "prefetch": {**moving_plan.prefetch, name: 3},
            "decisions": {**moving_plan.decisions, offloaded: Decision.RECOMPUTE}
            if what == "recomputes" else moving_plan.decisions})
        path = tmp_path / "plan.json"
        dump_model(plan, path)
        code, _, stderr = run("simulate", str(profile_file), "--plan", str(path))
        assert_one_line_error(code, stderr, f"plan prefetches '{name}', which it {what}: only "
                                            "an offloaded activation is reloaded")


@pytest.mark.parametrize("budget", ["1.5", 1.5, "1000.25", 2500.5, "1.5B", True])
def test_a_budget_over_one_that_is_not_whole_bytes_is_refused(budget) -> None:
    """Issue 50, item 8: ``1.5`` is neither a fraction (in (0, 1]) nor bytes (whole)."""
    with pytest.raises(InputError, match="fraction|whole number of bytes|not a budget") as e:
        resolve_budget(budget, 1000)
    assert "\n" not in str(e.value)


def test_budgets_that_mean_something_still_do() -> None:
    assert resolve_budget("0.5", 1000) == resolve_budget(0.5, 1000) == 500
    assert resolve_budget(1, 1000) == 1000 and resolve_budget("1", 1000) == 1000
    assert resolve_budget(2, 1000) == 2 and resolve_budget(3e9, 1000) == 3 * 10**9
    assert resolve_budget("1.5e9", 1000) == 1_500_000_000
    assert resolve_budget("1.5GiB", 1000) == 3 * 2**29
    assert resolve_budget("1.1KiB", 1000) == 1126  # a size with a unit: rounded down
    assert parse_bytes("2048") == parse_bytes("2048B") == 2048


def test_a_fraction_budget_of_a_profile_without_activation_memory() -> None:
    with pytest.raises(InputError, match="keep-all activation peak, which is 0 bytes"):
        resolve_budget(0.5, 0)


def test_a_fractional_budget_on_the_command_line(profile_file) -> None:
    code, _, stderr = run("plan", str(profile_file), "--budget", "1.5")
    assert_one_line_error(code, stderr, "budget '1.5' is neither a fraction nor bytes: "
                                        "fractions of the keep-all peak are in (0, 1], bytes "
                                        "are whole numbers or sizes such as 4GiB")
    code, _, stderr = run("simulate", str(profile_file), "--memory-limit", "1.5")
    assert_one_line_error(code, stderr, "budget '1.5' is neither a fraction nor bytes")


# -- issue 50: every JSON written is strict (NOTE [finite JSON]) -----------------------


@pytest.mark.parametrize(("value", "place"), [
    ({"a": [1, {"b": math.nan}]}, "a.1.b"), ([math.inf], "0"), (-math.inf, "the value")])
def test_json_text_refuses_nan_and_infinity_naming_the_place(value, place) -> None:
    with pytest.raises(InputError) as info:
        json_text(value, "out.json")
    assert str(info.value) == (f"cannot write out.json: {place} is not a finite number, "
                               "which JSON cannot hold; nothing was written (please report it)")
    assert json_text({"a": [1.5, None]}, "x") == '{"a": [1.5, null]}'


def test_a_model_holding_nan_is_not_written(tmp_path, profile, moving_plan) -> None:
    """pydantic writes a NaN as null, which then does not load: refused instead."""
    result = simulate(profile, moving_plan, "a100-80gb", 0.5)
    path = tmp_path / "result.json"
    dump_model(result, path)
    assert json.loads(path.read_text()) == result.model_dump(mode="json")
    before = path.read_bytes()
    for bad in (math.nan, math.inf):
        broken = result.model_copy(update={"retention": bad})
        with pytest.raises(InputError, match="retention is not a finite number"):
            dump_model(broken, path)
        assert path.read_bytes() == before
        with pytest.raises(InputError, match="busy_fraction.h2d is not a finite number"):
            dump_model(result.model_copy(update={"busy_fraction": {
                **result.busy_fraction, "h2d": bad}}), path)


def test_a_trace_and_json_output_holding_nan_are_one_line_errors(tmp_path, profile_file,
                                                                monkeypatch) -> None:
    import slackswap.sim.outputs as outputs

    trace = tmp_path / "t.json"
    monkeypatch.setattr(outputs, "chrome_trace", lambda result: {"traceEvents": [
        {"ts": math.nan}]})
    code, _, stderr = run("simulate", str(profile_file), "--trace", str(trace))
    assert_one_line_error(code, stderr, f"cannot write {trace}: traceEvents.0.ts is not a "
                                        "finite number")
    assert not trace.exists()
    original = SimResult.model_dump

    def nan_dump(self: SimResult, **options: Any) -> dict[str, Any]:
        return {**original(self, **options), "step_time_s": math.nan}

    monkeypatch.setattr(SimResult, "model_dump", nan_dump)
    code, stdout, stderr = run("simulate", str(profile_file), "--json")
    assert_one_line_error(code, stderr, "cannot write the result: step_time_s is not a "
                                        "finite number")
    assert "NaN" not in stdout


# -- property: hostile files and paths (issue 50) --------------------------------------


HOSTILE_BYTES = [b"", b"{}", b"[]", b"null", b"5", b"\xff\xfe\x00", b"[" * 100_000,
                 b'{"schema_version": "3"}', b'{"schema_version": true}', b"NaN",
                 b'base = "/dev/zero"', b"base = 5", b'name = "\x1b[2J"', b"x = [[[[[[[[",
                 b'{"model": "' + b"[red]" * 2000 + b'"}']
PATH_KINDS = ["file", "profile", "link to victim", "dangling link", "fifo", "folder",
              "/dev/zero", "missing"]


def _make(kind: str, path: Path, content: bytes, profile_text: str, victim: Path) -> str:
    """``path`` made as ``kind`` (a file holding ``content``, the good profile, a link, a
    FIFO...); the name to pass."""
    if kind == "file":
        path.write_bytes(content)
    elif kind == "profile":
        path.write_text(profile_text)
    elif kind == "link to victim":
        path.symlink_to(victim)
    elif kind == "dangling link":
        path.symlink_to(path.parent / "nowhere" / "x")
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "folder":
        path.mkdir()
    elif kind == "/dev/zero":
        return "/dev/zero"
    return str(path)


def _snapshot(folder: Path) -> dict[str, tuple[str, bytes | None]]:
    """What each entry under ``folder`` is (by its path there, in every subfolder, links
    not followed), a file's bytes and a link's target."""
    out: dict[str, tuple[str, bytes | None]] = {}
    for root, dirs, files in os.walk(folder):
        for name in dirs + files:
            p = Path(root) / name
            info = os.lstat(p)
            content = (p.read_bytes() if stat.S_ISREG(info.st_mode) else
                       os.readlink(p).encode() if stat.S_ISLNK(info.st_mode) else None)
            out[str(p.relative_to(folder))] = (stat.filemode(info.st_mode)[0], content)
    return out


@contextmanager
def _inside(folder: Path) -> Iterator[None]:
    """The working folder, and the cache, in ``folder`` for the duration: a write to a
    relative path or to the cache lands where the snapshot sees it."""
    cwd, cache = os.getcwd(), os.environ.get("SLACKSWAP_CACHE")
    (folder / "cwd").mkdir()
    os.chdir(folder / "cwd")
    os.environ["SLACKSWAP_CACHE"] = str(folder / "cache")
    try:
        yield
    finally:
        os.chdir(cwd)
        if cache is None:
            os.environ.pop("SLACKSWAP_CACHE", None)
        else:
            os.environ["SLACKSWAP_CACHE"] = cache


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_hostile_files_and_paths(tmp_path_factory, data) -> None:
    """Issue 50: whatever the files say and whatever the paths are (links, FIFOs,
    devices, folders, bytes that are not JSON or not UTF-8, deep nesting, markup), a
    command gives a one-line error or a result, with no traceback and no run past 5 s,
    and nothing but its named outputs changes, in any folder under the example's (the
    working folder and the cache among them): a link's target never."""
    tmp = tmp_path_factory.mktemp("hostile")
    victim = tmp / "victim.txt"
    victim.write_bytes(b"precious")
    profile_text = (Path(__file__).parent / "data" / "mlp-profile.json").read_text()
    names = {}
    for role in ("input", "plan", "hardware", "output"):
        kind = data.draw(st.sampled_from(PATH_KINDS), label=f"{role} kind")
        content = data.draw(st.one_of(st.sampled_from(HOSTILE_BYTES), st.binary(max_size=64)),
                            label=f"{role} content")
        names[role] = _make(kind, tmp / f"{role}.{'toml' if role == 'hardware' else 'json'}",
                            content, profile_text, victim)
    command = data.draw(st.sampled_from(["plan", "simulate"]), label="command")
    args = [command, names["input"]]
    if command == "plan":
        args += ["--budget", "0.8", "-o", names["output"]]
    else:
        args += ["--trace", names["output"]]
        if data.draw(st.booleans(), label="with a plan"):
            args += ["--plan", names["plan"]]
    if data.draw(st.booleans(), label="with hardware"):
        args += ["--hardware", names["hardware"]]
    with _inside(tmp):
        before = _snapshot(tmp)
        with time_limit(5):
            result = CliRunner().invoke(main, args)
    assert result.exception is None or isinstance(result.exception, SystemExit), (
        args, result.exc_info)
    assert result.exit_code in (0, 1, 2)
    if result.exit_code == 2 and "\nError: " not in result.stderr:  # (not click's usage)
        assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1, (
            args, result.stderr)
    assert "Traceback" not in result.stderr
    assert victim.read_bytes() == b"precious"
    after = _snapshot(tmp)
    output = Path(names["output"]).name
    changed = {n for n in set(before) | set(after) if before.get(n) != after.get(n)}
    assert changed <= {output}, (args, changed)
    if output in changed and output in before:
        assert before[output][0] == "-" and after[output][0] == "-"  # a file replaced


# -- outputs refused before the work, not after it ---------------------------------------


def test_a_results_folder_with_a_link_is_refused_before_any_work(
        tmp_path, monkeypatch) -> None:
    """NOTE [files]: a link planted at one of reproduce's outputs (report.md) was refused
    only when it was written, after the whole run, with results.json already written
    beside it: half a results folder. Now nothing is profiled and nothing written."""
    import slackswap.reproduce as reproduce_module

    def no_work(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("profiled before the outputs were checked")

    monkeypatch.setattr(reproduce_module, "cached_profile", no_work)
    victim = tmp_path / "victim"
    victim.write_text("precious")
    out = tmp_path / "out"
    out.mkdir()
    (out / "bert-large-tiny-slackswap-plan.json").symlink_to(victim)
    with pytest.raises(InputError, match="is a symbolic link, not a regular file"):
        reproduce_module.reproduce(out, workloads=("bert-large-tiny",))
    assert sorted(p.name for p in out.iterdir()) == ["bert-large-tiny-slackswap-plan.json"]
    assert victim.read_text() == "precious"


@pytest.mark.parametrize("kind", ["link", "dangling link", "fifo"])
def test_cli_outputs_that_are_no_file_are_refused_before_any_work(tmp_path, kind) -> None:
    """calibrate measured for a minute (and needed a GPU) before refusing a link it was
    told to --force over; every command's outputs are checked first now."""
    victim = tmp_path / "victim"
    victim.write_text("precious")
    target = tmp_path / "hw.toml"
    if kind == "link":
        target.symlink_to(victim)
    elif kind == "dangling link":
        target.symlink_to(tmp_path / "nowhere")
    else:
        os.mkfifo(target)
    code, _, stderr = run("calibrate", "-o", str(target), "--force", "--base", "a100-80gb")
    assert_one_line_error(code, stderr, "not a regular file; remove it or name another file")
    assert victim.read_text() == "precious" and not (tmp_path / "nowhere").exists()


@pytest.mark.parametrize("kind", ["file", "dangling link", "under a file"])
def test_a_results_folder_that_cannot_be_made_is_an_input_error(tmp_path, kind) -> None:
    """reproduce(out=...) raised a bare FileExistsError (and the command line said
    'error: out: File exists') for a file or a dangling link at the folder's name."""
    from slackswap.reproduce import reproduce

    out = tmp_path / "out"
    if kind == "file":
        out.write_text("precious")
    elif kind == "dangling link":
        out.symlink_to(tmp_path / "nowhere")
    else:
        out.write_text("precious")
        out = out / "sub"
    with pytest.raises(InputError, match=r"cannot make the results folder .*: .*; name a "
                                         "folder, or a new name, as --out"):
        reproduce(out, workloads=("bert-large-tiny",))
    assert not (tmp_path / "nowhere").exists()
    assert kind == "dangling link" or (tmp_path / "out").read_text() == "precious"


def test_a_file_named_as_a_hardware_preset_does_not_replace_it(tmp_path, profile_file,
                                                                monkeypatch) -> None:
    """NOTE [files]: a file named 'a100-80gb' in the working folder was read in place of
    the preset, by every command run there, the default hardware's included (and said
    nothing: the file may call itself a100-80gb). The preset's name is the preset now;
    ./a100-80gb names the file."""
    planted = PRESET.read_text().replace("d2h_bandwidth = 24.8e9", "d2h_bandwidth = 1.0")
    assert planted != PRESET.read_text()
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a100-80gb").write_text(planted)
    (tmp_path / "dgx-a100").mkdir()
    (tmp_path / "dgx-a100" / "8").write_text(planted)
    assert load_hardware("a100-80gb") == load_hardware(PRESET)
    assert load_hardware("dgx-a100/8").host_link.d2h_bandwidth > 1
    assert load_hardware("./a100-80gb").host_link.d2h_bandwidth == 1.0
    code, stdout, stderr = run("simulate", str(profile_file), "--hardware", "a100-80gb",
                               "--json")
    assert code == 0, stderr
    assert json.loads(stdout) == json.loads(run("simulate", str(profile_file), "--hardware",
                                                str(PRESET), "--json")[1])


def test_a_file_named_as_a_model_preset_does_not_replace_it(tmp_path, profile_file,
                                                             monkeypatch) -> None:
    """As for hardware: 'slackswap plan bert-large-tiny' beside a file of that name read
    the file as the profile; the preset is profiled now."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "bert-large-tiny").write_text(profile_file.read_text())
    code, stdout, stderr = run("plan", "bert-large-tiny", "--budget", "0.9")
    assert code == 0, stderr
    assert stdout.startswith("bert-large-tiny, ") and "mlp" not in stdout.split("\n")[0]


def test_a_relative_base_is_beside_its_file_not_in_the_working_folder(
        tmp_path, monkeypatch) -> None:
    """NOTE [files]: a hardware file's relative ``base`` was read from the working folder,
    so a file of that name there (anyone's) replaced the one beside it; it is read
    beside the file that names it now."""
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "gpu.toml").write_text(PRESET.read_text())
    (mine / "node.toml").write_text('base = "gpu.toml"\nname = "node"\n')
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "gpu.toml").write_text(
        PRESET.read_text().replace("d2h_bandwidth = 24.8e9", "d2h_bandwidth = 1.0"))
    monkeypatch.chdir(elsewhere)
    node = load_hardware(mine / "node.toml")
    assert node.host_link == load_hardware(PRESET).host_link
