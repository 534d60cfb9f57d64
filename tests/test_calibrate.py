"""``slackswap calibrate`` on a CPU: it refuses without a GPU, and the file it writes from
a measurement (made up here: NOTE [calibration] keeps measuring and writing apart) loads,
keeps every unmeasured figure of its base, cites each measured one, and plans."""

from __future__ import annotations

import hashlib
import json
import os

import pytest
import torch
from click.testing import CliRunner

import slackswap
from slackswap.cli import main
from slackswap.core.hardware import hardware_presets, load_hardware
from slackswap.core.hwtemplate import hardware_toml
from slackswap.errors import InputError
from slackswap.runtime import calibrate
from slackswap.runtime.calibrate import Calibration, calibrated_hardware, write_hardware

MADE_UP = Calibration(device="NVIDIA Made-Up GPU", torch_version="2.99.0+cu999",
                      date="2031-02-03", d2h_bandwidth=41.5e9, h2d_bandwidth=42.25e9,
                      duplex_d2h_bandwidth=30.125e9, duplex_h2d_bandwidth=21.5e9,
                      dispatch_s=9.75e-6, call_costs_us={"copy": 12.5, "event_record": 3.0})


def run(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, list(args))
    return result.exit_code, result.stdout, result.stderr


def _digests() -> dict[str, str]:
    return {n: hashlib.sha256(json.dumps(load_hardware(n).model_dump(mode="json"),
                                         sort_keys=True).encode()).hexdigest()
            for n in hardware_presets()}


@pytest.fixture
def no_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.fixture
def made_up_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """A machine whose measurement is MADE_UP: the measuring functions replaced, the
    writing as it runs on a GPU."""
    monkeypatch.setattr(calibrate, "require_gpu", lambda: MADE_UP.device)
    monkeypatch.setattr(calibrate, "measure", lambda progress=None: MADE_UP)


def test_without_a_gpu_it_refuses_in_one_line(tmp_path, no_gpu) -> None:
    out = tmp_path / "gpu.toml"
    code, stdout, stderr = run("calibrate", "-o", str(out), "--base", "h200")
    assert code != 0 and stdout == ""
    assert stderr.count("\n") == 1 and "Traceback" not in stderr
    assert "CUDA GPU" in stderr and stderr.startswith("error: ")
    assert not out.exists()
    with pytest.raises(InputError, match="CUDA GPU"):
        calibrate.measure()


@pytest.mark.parametrize("base", ["h200", "l4", "dgx-a100"])
def test_the_file_replaces_only_what_was_measured(tmp_path, base: str) -> None:
    hw = load_hardware(base)
    path = tmp_path / "mine.toml"
    write_hardware(calibrated_hardware(hw, MADE_UP), path)
    got = load_hardware(path)
    assert got.name == f"{base}-calibrated"
    link = got.host_link
    assert (link.d2h_bandwidth, link.h2d_bandwidth, link.duplex_d2h_bandwidth,
            link.duplex_h2d_bandwidth) == (41.5e9, 42.25e9, 30.125e9, 21.5e9)
    assert got.host.dispatch_s == 9.75e-6
    measured = {f"host_link.{f}" for f in calibrate.LINK_FIELDS} | {"host.dispatch_s"}
    for key in measured:
        for part in ("measured by `slackswap calibrate` on NVIDIA Made-Up GPU", "2031-02-03",
                     "torch 2.99.0+cu999"):
            assert part in got.sources[key], key
    # every other figure, and every other source, is the base's
    mine, theirs = got.model_dump(), hw.model_dump()
    for table in ("compute", "memory", "node"):
        assert mine[table] == theirs[table]
    assert {k: v for k, v in mine["host_link"].items() if k not in calibrate.LINK_FIELDS} \
        == {k: v for k, v in theirs["host_link"].items() if k not in calibrate.LINK_FIELDS}
    assert {k: v for k, v in mine["host"].items() if k != "dispatch_s"} \
        == {k: v for k, v in theirs["host"].items() if k != "dispatch_s"}
    assert {k: v for k, v in got.sources.items() if k not in measured} \
        == {k: v for k, v in hw.sources.items() if k not in measured}


def test_the_file_plans_a_tiny_model(tmp_path) -> None:
    import factories

    path = tmp_path / "mine.toml"
    write_hardware(calibrated_hardware(load_hardware("h200"), MADE_UP, name="my-h200"), path)
    model, batch = factories.mlp()
    plan = slackswap.plan(model, batch, budget=0.6, hardware=str(path))
    assert plan._hardware == "my-h200" and plan._result.feasible


def test_writes_refuse_existing_files_and_links(tmp_path) -> None:
    hw = calibrated_hardware(load_hardware("h200"), MADE_UP)
    path = tmp_path / "mine.toml"
    path.write_text("mine")
    with pytest.raises(InputError, match="--force"):
        write_hardware(hw, path)
    assert path.read_text() == "mine"
    write_hardware(hw, path, force=True)
    assert load_hardware(path) == hw
    target, link = tmp_path / "elsewhere.toml", tmp_path / "link.toml"
    target.write_text("elsewhere")
    os.symlink(target, link)
    for force in (False, True):
        with pytest.raises(InputError):
            write_hardware(hw, link, force=force)
    assert target.read_text() == "elsewhere" and os.path.islink(link)


def test_the_command_writes_the_file_and_the_costs(tmp_path, made_up_gpu) -> None:
    before = _digests()
    out, costs = tmp_path / "gpu.toml", tmp_path / "costs.json"
    code, stdout, stderr = run("calibrate", "-o", str(out), "--base", "h200", "--costs",
                               str(costs))
    assert code == 0, stderr
    assert "41.5 GB/s" in stdout and "21.5 GB/s" in stdout and "9.8 us" in stdout
    assert load_hardware(out) == calibrated_hardware(load_hardware("h200"), MADE_UP)
    record = json.loads(costs.read_text())
    assert record["machine"] == MADE_UP.device and record["costs_us"]["copy"] == 12.5
    # a second run refuses to replace either file, before measuring, unless forced
    text = out.read_text()
    code, _, stderr = run("calibrate", "-o", str(out), "--base", "l4")
    assert code == 2 and "--force" in stderr and out.read_text() == text
    code, _, _ = run("calibrate", "-o", str(out), "--base", "l4", "--force")
    assert code == 0 and load_hardware(out).name == "l4-calibrated"
    assert _digests() == before  # the presets themselves are untouched


def test_every_preset_reads_back_as_written(tmp_path) -> None:
    for name in hardware_presets():
        hw = load_hardware(name)
        path = tmp_path / f"{name}.toml"
        path.write_text(hardware_toml(hw))
        assert load_hardware(path) == hw, name


def test_names_with_any_character_read_back_as_written(tmp_path) -> None:
    """A name or source from --name or a base file (which may escape any character) is
    written so that it reads back, and adds no key: DEL was written raw, which TOML
    refuses, and quotes or newlines must not start a table of their own."""
    hw = load_hardware("a100-80gb")
    for name in ["x\x7fy", 'a"\n[compute]\npeak_flops = 1', "tab\there\\", "\u2028\x00\x1b[2J"]:
        odd = hw.model_copy(update={"name": name, "description": name,
                                    "sources": {**hw.sources, name: name}})
        path = tmp_path / "odd.toml"
        path.write_text(hardware_toml(odd))
        assert load_hardware(path) == odd, repr(name)
