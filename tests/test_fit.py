"""``slackswap fit``: the largest batch (or sequence) that trains at a target retention in
what the device leaves, for SlackSwap, checkpoint-blocks and keep-all, checked against
plans made and simulated independently; the command's table, JSON, plot and one-line
errors."""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from slackswap.cli import main
from slackswap.core.hardware import Hardware, load_hardware, with_overrides
from slackswap.device_budget import device_budget
from slackswap.fit import SEQ_STEP, FitResult, fit, largest_meeting
from slackswap.models import with_layers
from slackswap.planners import plan_with_result
from slackswap.reproduce import cached_profile

# Two full-width GPT-2 XL layers on a 12 GB device: keep-all fits batch 12 at seq 1024,
# SlackSwap trains batch 14 at 98.97% of ideal (measured when written); the step's
# kernels are full-size, so retention is what the planners make of it, not host cost.
CAPACITY = "memory.capacity_bytes=12e9"


@pytest.fixture(scope="module", autouse=True)
def cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SLACKSWAP_CACHE", str(tmp_path_factory.mktemp("cache")))
        yield


@pytest.fixture(scope="module")
def name() -> str:
    return with_layers("gpt2-xl", 2)


@pytest.fixture(scope="module")
def hw() -> Hardware:
    return with_overrides(load_hardware("a100-80gb"), {"memory.capacity_bytes": 12e9})


@pytest.fixture(scope="module")
def found(name: str, hw: Hardware) -> FitResult:
    return fit(name, hw)


def run(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, list(args))
    return result.exit_code, result.stdout, result.stderr


def test_search_finds_the_edge_of_a_monotone_predicate() -> None:
    calls: list[int] = []

    def upto(edge: int):
        def meets(n: int) -> bool:
            calls.append(n)
            return n <= edge
        return meets

    assert largest_meeting(upto(37)) == 37
    assert calls == [1, 2, 4, 8, 16, 32, 64, 48, 40, 36, 38, 37]  # deterministic
    assert largest_meeting(upto(1000), SEQ_STEP) == 960
    assert largest_meeting(upto(0)) is None
    assert largest_meeting(upto(10**9), doublings=5) == 32  # stops at its cap
    # not monotone: an edge the search saw, a shape that meets and the next that misses
    holes = {5, 6, 7}
    edge = largest_meeting(lambda n: n not in holes and n <= 40)
    assert edge not in holes and edge + 1 in holes | {41}


def _meets(hw: Hardware, name: str, batch: int, strategy: str, target: float) -> bool:
    """Profile, budget, plan and simulate ``batch`` from scratch: does it meet ``target``?"""
    prof = cached_profile(name, hw, batch=batch)
    budget = device_budget(prof, hw).budget_bytes
    if strategy == "keep-all":
        return prof.keep_all_peak <= budget
    attempt = plan_with_result(prof, budget, hw, strategy)
    return bool(attempt and attempt[1].feasible and attempt[1].retention >= target)


# ``heavy``: the batch search of ``found`` (80 s on two loaded cores) and the tests that read
# it, or whose command line would run it again without its cache (the table, JSON and plot)
@pytest.mark.heavy
def test_largest_batch_meets_the_target_and_the_next_does_not(
        found: FitResult, name: str, hw: Hardware) -> None:
    largest = found.largest
    assert largest["keep-all"] <= largest["checkpoint-blocks"] <= largest["slackswap"]
    assert largest["keep-all"] < largest["slackswap"]  # SlackSwap gains batch
    for strategy, batch in largest.items():
        point = found.point(batch)
        outcome = point.outcomes[strategy]
        assert outcome.meets(0.97) and outcome.retention >= 0.97
        assert outcome.tokens_per_s == pytest.approx(batch * 1024 / outcome.step_time_s)
        assert not found.point(batch + 1).outcomes[strategy].meets(0.97)
        assert point.budget_bytes == device_budget(
            cached_profile(name, hw, batch=batch), hw).budget_bytes
        # the same plans, made and simulated outside the search
        assert _meets(hw, name, batch, strategy, 0.97)
        assert not _meets(hw, name, batch + 1, strategy, 0.97)
    keep = found.point(largest["keep-all"])
    assert keep.keep_all_peak_bytes <= keep.budget_bytes < found.point(
        largest["keep-all"] + 1).keep_all_peak_bytes
    assert found.search == "batch" and found.fixed == 1024
    assert [p.batch for p in found.points] == sorted({p.batch for p in found.points})


@pytest.mark.heavy
def test_lower_target_never_a_smaller_batch(found: FitResult, name: str, hw: Hardware) -> None:
    loose = fit(name, hw, min_retention=0.5)
    for strategy, batch in found.largest.items():
        assert loose.largest[strategy] >= batch
    assert loose.largest["keep-all"] == found.largest["keep-all"]  # no retention to lose


@pytest.mark.heavy  # a search of its own over sequence lengths (140 s on two cores)
def test_longest_sequence_at_a_batch(name: str, hw: Hardware) -> None:
    found = fit(name, hw, batch=8)  # keep-all fits batch 12 at 1024
    assert found.search == "seq" and found.fixed == 8
    seq = found.largest["slackswap"]
    assert seq % SEQ_STEP == 0 and seq > 1024
    assert found.point(seq).outcomes["slackswap"].meets(0.97)
    assert not found.point(seq + SEQ_STEP).outcomes["slackswap"].meets(0.97)
    assert found.largest["keep-all"] <= seq
    assert all(p.batch == 8 for p in found.points)


@pytest.mark.heavy
def test_cli_table_json_and_plot_agree(name: str, tmp_path) -> None:
    plot = tmp_path / "fit.png"
    code, table, _ = run("fit", name, "--set", CAPACITY, "--plot", str(plot))
    assert code == 0, table
    assert plot.read_bytes().startswith(b"\x89PNG")
    code, stdout, _ = run("fit", name, "--set", CAPACITY, "--json")
    assert code == 0
    data = json.loads(stdout)
    assert data["search"] == "batch" and data["seq"] == 1024 and data["min_retention"] == 0.97
    assert "budget fit: model states" in table and "activation budget" in table
    for strategy, chosen in data["largest"].items():
        line = re.search(rf"^  {strategy} +(\d+): ([\d.]+)% of ideal, ([\d,]+) tokens/s",
                         table, re.M)
        assert line, strategy
        assert int(line[1]) == chosen["batch"]
        assert float(line[2]) == pytest.approx(chosen["retention"] * 100, abs=0.05)
        assert int(line[3].replace(",", "")) == round(chosen["tokens_per_s"])
    batches = [p["batch"] for p in data["points"]]
    rows = re.findall(r"^│ +(\d+) │", table, re.M)
    assert [int(b) for b in rows] == batches
    assert data["device"]["activation_budget_bytes"] == data["points"][0]["budget_bytes"]
    assert data["fastest"]["tokens_per_s"] >= data["largest"]["slackswap"]["tokens_per_s"]


@pytest.mark.parametrize(("args", "message"), [
    (["gpt2-xl-tiny", "--set", "memory.capacity_bytes=1e6"],
     r"^error: the model states 3\.50 MiB .* do not fit a100-80gb\+1 override's .* memory$"),
    (["gpt2-xl-tiny", "--batch", "2", "--seq", "64"], "not both"),
    (["factories:mlp"], "is a factory"),
    (["nope"], "unknown model 'nope'; presets: bert-large"),
])
def test_one_line_errors(args: list[str], message: str) -> None:
    code, stdout, stderr = run("fit", *args)
    assert code == 2 and stdout == ""
    assert len(stderr.strip().splitlines()) == 1 and "Traceback" not in stderr
    assert re.search(message, stderr.strip()), stderr


def test_no_batch_meets_the_target(name: str) -> None:
    # room for the model states and one op's working set, not for batch 1's activations
    code, stdout, _ = run("fit", name, "--set", "memory.capacity_bytes=3.3e9", "--json")
    assert code == 1
    data = json.loads(stdout)
    assert data["largest"] == {"slackswap": None, "checkpoint-blocks": None, "keep-all": None}
    assert data["fastest"] is None and len(data["points"]) == 1


def test_readme_commands_are_the_commands() -> None:
    """The `slackswap fit` commands of docs/batch-size.md parse as written, on presets and
    hardware that exist (running them takes minutes: their figures are on that page)."""
    from slackswap.cli import fit_command
    from slackswap.models import MODEL_PRESETS

    page = (Path(__file__).parent.parent / "docs" / "batch-size.md").read_text()
    section = page.split("## `slackswap fit`", 1)[1].split("\n## ", 1)[0]
    block = section.split("```bash\n", 1)[1].split("```", 1)[0]
    commands = [shlex.split(line) for line in block.splitlines() if line.strip()]
    assert len(commands) == 3 and all(c[:2] == ["slackswap", "fit"] for c in commands)
    for command in commands:
        ctx = fit_command.make_context("fit", command[2:])
        assert ctx.params["model"] in MODEL_PRESETS
        load_hardware(ctx.params["hardware"])
