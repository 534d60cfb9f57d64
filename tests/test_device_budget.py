"""``--budget fit``: device memory less the model states (16 B/param for AdamW in mixed
precision, ZeRO section 3.1) and the reserve, with the breakdown shown, and one line with
the numbers when the states do not fit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from slackswap.cli import main
from slackswap.core.hardware import Hardware, load_hardware, with_overrides
from slackswap.core.jsonio import dump_model
from slackswap.core.profile import StepProfile
from slackswap.core.units import format_bytes
from slackswap.device_budget import RESERVE, device_budget
from slackswap.errors import InputError
from slackswap.planners import plan
from slackswap.reproduce import cached_profile

NAME = "gpt2-xl-tiny"
RESERVED = sum(n for n, _, _ in RESERVE.values())


@pytest.fixture(scope="module")
def prof(tmp_path_factory: pytest.TempPathFactory) -> StepProfile:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SLACKSWAP_CACHE", str(tmp_path_factory.mktemp("cache")))
        return cached_profile(NAME, load_hardware("a100-80gb"))


def _sized(capacity: float) -> Hardware:
    return with_overrides(load_hardware("a100-80gb"), {"memory.capacity_bytes": capacity})


def test_model_states_by_optimizer_and_precision(prof: StepProfile) -> None:
    from slackswap.models import build_model

    model, _ = build_model(NAME)
    n = sum(p.numel() for p in model.parameters())
    assert all(p.dtype.itemsize == 2 for p in model.parameters())  # bf16 weights
    hw = load_hardware("a100-80gb")
    device = device_budget(prof, hw)
    assert device.parameters == n and device.weights == prof.model_state_bytes == 2 * n
    assert (device.gradients, device.master, device.optimizer_states) == (2 * n, 4 * n, 8 * n)
    assert device.model_states == 16 * n  # ZeRO: 2 + 2 + 12 bytes per parameter
    assert device.budget_bytes == hw.memory.capacity_bytes - 16 * n - RESERVED
    for optimizer, precision, per in (("adamw", "pure", 8), ("sgd-momentum", "mixed", 12),
                                      ("sgd-momentum", "pure", 6), ("sgd", "pure", 4)):
        assert device_budget(prof, hw, optimizer, precision).model_states == per * n
    lines = device.lines()
    assert "16 B/param" in lines[0] and f"{n:,} parameters" in lines[0]
    for what in ("device memory", "gradients", "fp32 master weights", "AdamW states",
                 "CUDA context", "cuBLAS", "activation budget"):
        assert any(what in line for line in lines), what
    with pytest.raises(InputError, match="unknown optimizer 'lion'"):
        device_budget(prof, hw, "lion")


def test_fit_plans_under_what_the_device_leaves(prof: StepProfile) -> None:
    states = 16 * device_budget(prof, load_hardware("a100-80gb")).parameters
    hw = _sized(states + RESERVED + 0.85 * prof.keep_all_peak)
    chosen = plan(prof, "fit", hw)
    assert chosen.budget_bytes == device_budget(prof, hw).budget_bytes
    assert chosen.budget_bytes == int(0.85 * prof.keep_all_peak)
    assert plan(prof, " FIT ", load_hardware("a100-80gb")).budget_bytes > 79 * 2**30


@pytest.mark.parametrize(("extra", "message"), [
    (-1, "do not fit"), (RESERVED, "leave nothing"),
])
def test_states_that_do_not_fit(prof: StepProfile, extra: int, message: str) -> None:
    states = 16 * device_budget(prof, load_hardware("a100-80gb")).parameters
    with pytest.raises(InputError) as caught:
        plan(prof, "fit", _sized(states + extra))
    text = str(caught.value)
    assert message in text and "\n" not in text and "16 B/param" in text
    assert "3.50 MiB" in text  # the model states, in numbers


def test_states_that_fit_sharded_say_over_how_many_gpus(prof: StepProfile) -> None:
    """Model states over what the device leaves: the error names the fewest GPUs that hold
    them sharded with room for activations, each one's share in numbers."""
    states = 16 * device_budget(prof, load_hardware("a100-80gb")).parameters
    for room, gpus in ((states / 3, 4), (states / 2.5, 3), (states * 0.99, 2)):
        with pytest.raises(InputError) as caught:
            plan(prof, "fit", _sized(RESERVED + room))
        text = str(caught.value)
        assert f"sharded over {gpus} or more GPUs" in text, text
        share = states // gpus
        assert share < room <= states // (gpus - 1)  # the fewest that leave room
        assert format_bytes(share) in text and "\n" not in text


def test_optimizer_temporaries_must_fit_what_the_states_leave(prof: StepProfile) -> None:
    """AdamW's foreach step makes one fp32 state-sized tensor per parameter after backward:
    shown in the breakdown, not taken from the activation budget, and a warning when the
    states leave less than that (a fused optimizer makes none)."""
    a100 = load_hardware("a100-80gb")
    fit = device_budget(prof, a100)
    assert fit.temporaries == fit.optimizer_states // 2 == 4 * fit.parameters
    assert device_budget(prof, a100, "sgd").temporaries == 0
    assert any("optimizer step temporaries" in line for line in fit.lines())
    room = fit.model_states + RESERVED
    enough = device_budget(prof, _sized(room + fit.temporaries))
    assert enough.budget_bytes == fit.temporaries
    assert not any("warning" in line for line in enough.lines())
    short = device_budget(prof, _sized(room + fit.temporaries // 2))
    assert short.budget_bytes == fit.temporaries // 2
    assert any("warning: the AdamW step's temporaries" in line and "fused=True" in line
               for line in short.lines())


def test_a_sharded_model_holds_two_blocks_and_a_blocks_gradients(prof: StepProfile) -> None:
    """A rank that holds a quarter of the model (FSDP2) gives up the gather buffers of its
    largest block: two blocks' parameters and one block's gradients, in their dtype."""
    listed = sum(t.bytes for t in prof.tensors if t.is_parameter)
    sharded = prof.model_copy(update={"model_state_bytes": listed // 4})
    block = max(sum(t.bytes for t in prof.tensors
                    if t.kind == "parameter" and (t.name or "").startswith(layer + "."))
                for layer in prof.layers)
    assert block > 0
    a100 = load_hardware("a100-80gb")
    whole, quarter = device_budget(prof, a100), device_budget(sharded, a100)
    assert whole.gather == 0 and quarter.gather == 3 * block
    assert quarter.budget_bytes == (a100.memory.capacity_bytes - quarter.model_states
                                    - RESERVED - 3 * block)
    assert any("FSDP2 units gathered whole" in line for line in quarter.lines())


def test_cli(prof: StepProfile, tmp_path: Path) -> None:
    path = tmp_path / "p.json"
    dump_model(prof, path)
    result = CliRunner().invoke(main, ["plan", str(path), "--budget", "fit"])
    assert result.exit_code == 0, result.output
    assert "16 B/param" in result.stdout and "activation budget" in result.stdout
    assert "CUDA context" in result.stdout and "predicted retention 100.00%" in result.stdout
    result = CliRunner().invoke(main, ["plan", str(path), "--budget", "fit", "--optimizer",
                                       "sgd", "--precision", "pure"])
    assert result.exit_code == 0 and "4 B/param" in result.stdout
    result = CliRunner().invoke(main, ["plan", str(path), "--budget", "fit", "--set",
                                       "memory.capacity_bytes=1e6"])
    assert result.exit_code == 2 and result.stderr.count("\n") == 1
    assert "do not fit" in result.stderr and "976.56 KiB of device memory" in result.stderr
    result = CliRunner().invoke(main, ["plan", str(path), "--budget", "0.5", "--optimizer",
                                       "sgd"])
    assert result.exit_code == 2 and "--budget fit" in result.stderr


@pytest.mark.parametrize(("args", "message"), [
    (["gpt2-xl-tiny", "--budget", "0.5", "--probe"], "checks a --budget fit plan"),
    (["gpt2-xl-tiny", "--budget", "fit", "--probe", "--gpus", "2"], "no profile file, --gpus"),
])
def test_probe_refusals(args: list[str], message: str, tmp_path: Path) -> None:
    """``--probe`` runs real steps of a preset's ``--budget fit`` plan on the GPU here: any
    other use is one line, before anything is profiled."""
    result = CliRunner().invoke(main, ["plan", *args])
    assert result.exit_code == 2 and result.stderr.count("\n") == 1
    assert message in result.stderr and result.stdout == ""


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_probe_needs_a_gpu() -> None:
    result = CliRunner().invoke(main, ["plan", "gpt2-xl-tiny", "--budget", "fit", "--probe"])
    assert result.exit_code == 2 and result.stdout == ""
    assert "on a CUDA GPU and none is here" in result.stderr
