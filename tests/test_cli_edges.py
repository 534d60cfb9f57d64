"""What a user meets first: the command line's help, outputs and errors, and how a plan
prints (issue: a newcomer's rough edges)."""

from __future__ import annotations

import inspect
import json
import pydoc

import pytest
import torch
from click.testing import CliRunner

import slackswap
from slackswap.cli import main
from slackswap.core.jsonio import load_model
from slackswap.core.plan import Plan
from slackswap.core.profile import StepProfile
from slackswap.planners import STRATEGIES
from slackswap.reproduce import report
from slackswap.runtime.checks import shapes_differ
from slackswap.sim.schedule import min_working_set


def run(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, list(args))
    return result.exit_code, result.stdout, result.stderr


def test_plan_help_lists_every_strategy() -> None:
    code, stdout, _ = run("plan", "--help")
    assert code == 0
    flat = "".join(stdout.split())  # (click wraps lines at hyphens too)
    for strategy in STRATEGIES:
        assert strategy in flat, strategy


def test_a_model_without_a_loss_says_how_to_give_one() -> None:
    code, _, stderr = run("plan", "factories:mlp_no_loss", "--budget", "0.5",
                          "--hardware", "a100-80gb")
    assert code == 2 and stderr.count("\n") == 1
    assert "returned no loss (its output is a tensor of shape [4, 8, 16])" in stderr
    assert "--loss package.module:f" in stderr and "loss_fn=f" in stderr


@pytest.mark.parametrize("command", ["profile", "plan"])
def test_loss_names_a_function(command: str, tmp_path) -> None:
    budget = ("--budget", "0.5") if command == "plan" else ("--summary",)
    code, stdout, stderr = run(command, "factories:mlp_no_loss", "--loss",
                               "factories:mean_square", "--hardware", "a100-80gb", *budget)
    assert code == 0, stderr
    if command == "plan":
        assert "predicted retention" in stdout and "on a100-80gb" in stdout
    else:
        assert json.loads(stdout)["num_saved_tensors"] > 0


@pytest.mark.parametrize(("args", "message"), [
    (["factories:mlp_no_loss", "--loss", "factories:nothing"],
     "cannot import function 'factories:nothing'"),
    (["factories:mlp_no_loss", "--loss", "mean_square"], "is not package.module:function"),
    (["factories:mlp_no_loss", "--loss", "factories:not_a_function"], "not a function"),
    (["gpt2-xl-tiny", "--loss", "factories:mean_square"], "--loss applies to a package"),
])
def test_loss_errors_are_one_line(args: list[str], message: str) -> None:
    code, stdout, stderr = run("profile", *args)
    assert code == 2 and message in stderr and stderr.count("\n") == 1, stderr


def test_plan_of_a_profile_refuses_a_loss(tmp_path) -> None:
    prof = tmp_path / "p.json"
    assert run("profile", "gpt2-xl-tiny", "-o", str(prof), "--summary")[0] == 0
    code, _, stderr = run("plan", str(prof), "--budget", "0.5", "--loss",
                          "factories:mean_square")
    assert code == 2 and "--loss applies when planning a MODEL" in stderr


def test_piped_tables_are_not_cut_at_80_columns(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("COLUMNS", raising=False)
    monkeypatch.setenv("SLACKSWAP_CACHE", str(tmp_path / "cache"))
    code, stdout, _ = run("reproduce", "--workloads", "gpt2-xl-tiny", "--out",
                          str(tmp_path / "out"), "--budget", "0.85")
    assert code == 0
    widths = [len(line) for line in stdout.splitlines()]
    assert max(widths) > 80  # the table has its natural width
    assert "…" not in stdout  # no cell cut short
    # and a long line is one line
    assert any("results written to" in line and "report.md" in line
               for line in stdout.splitlines())


def test_infeasible_simulation_prints_no_step_time(tmp_path) -> None:
    prof = tmp_path / "p.json"
    run("profile", "bert-large-tiny", "-o", str(prof), "--summary")
    minimum, _ = min_working_set(load_model(StepProfile, prof))
    code, stdout, _ = run("simulate", str(prof), "--memory-limit", str(minimum))
    assert code == 1 and "INFEASIBLE" in stdout
    line = next(ln for ln in stdout.splitlines() if "step time" in ln)
    assert "none: infeasible" in line and "ideal" in line
    retained = next(ln for ln in stdout.splitlines() if "throughput retained" in ln)
    assert "%" not in retained


def test_report_gives_the_reason_beside_infeasible() -> None:
    entry = {"retention": None, "peak_bytes": 123456, "feasible": False,
             "reason": "short by 1.00 KiB at op 7 | forward", "offloaded_bytes": 0,
             "recomputed_bytes": 0, "plan_time_s": 0.1}
    fine = {**entry, "retention": 0.9, "feasible": True, "reason": None}
    results = {"budget_fraction": 0.5, "hardware": "a100-80gb", "workloads": [{
        "name": "w", "paper_retention": None, "bound_retention": 0.95,
        "ideal_step_time_s": 0.01, "keep_all_peak_bytes": 10**6, "budget_bytes": 5 * 10**5,
        "strategies": {s: (fine if s == "slackswap" else entry) for s in STRATEGIES}}]}
    text = report(results)
    row = next(line for line in text.splitlines() if line.startswith("| capuchin |"))
    assert "infeasible: short by 1.00 KiB at op 7 \\| forward" in row
    assert "120.56 KiB" not in row  # the peak where it stopped is no step's peak
    ours = next(line for line in text.splitlines() if line.startswith("| slackswap |"))
    assert "90.0%" in ours and "120.56 KiB" in ours


def _tiny_plan() -> tuple[Plan, torch.nn.Module, torch.Tensor]:
    import factories

    model, batch = factories.mlp()
    return slackswap.plan(model, batch, budget=0.5, hardware="a100-80gb"), model, batch


def test_a_plan_prints_as_a_summary() -> None:
    plan, _, _ = _tiny_plan()
    text = str(plan)
    assert len(text.splitlines()) == 3
    assert "predicted retention" in text and "simulated on a100-80gb" in text
    assert f"({plan.strategy})" in text and "budget" in text
    counts = plan.counts()
    assert (f"{counts['offload']} offloaded" in text
            and f"{counts['recompute']} recomputed" in text)
    assert "decisions=" in repr(plan) and len(repr(plan)) < 300
    assert "predicted_retention=" in repr(plan)
    # read back from its file: the same plan, whose retention is not known
    again = Plan.model_validate_json(plan.model_dump_json())
    assert again == plan
    assert "not known" in str(again) and "slackswap simulate" in str(again)


def test_help_of_apply_says_what_it_returns() -> None:
    assert inspect.signature(slackswap.apply).return_annotation is inspect.Signature.empty
    text = pydoc.render_doc(slackswap.apply, renderer=pydoc.plaintext)
    call = next(line for line in text.splitlines() if "apply(model" in line)
    assert "->" not in call  # the class's call line: not "returns None"
    assert "returns the block, a context manager" in " ".join(text.split())


def test_a_batch_of_other_shapes_names_both() -> None:
    plan, model, batch = _tiny_plan()
    wider = torch.randn(4, 8, 32)
    with (pytest.raises(slackswap.InputError,
                        match=r"made for a batch of shapes \[\[4, 8, 16\]\], not "
                              r"\[\[4, 8, 32\]\]; re-plan .*slackswap\.auto"),
          slackswap.apply(model, plan)):
        model(wider)
    profile = plan._profile
    assert "dtypes ['fp32'], not ['bf16']" in shapes_differ(profile, [([4, 8, 16], "bf16")])
