"""``reproduce``'s report, results JSON and plot when strategies, or all of them, find no
plan: an infeasible point is null and a gap, never 0%, and no file is named that was not
written."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from slackswap.cli import main
from slackswap.reproduce import reproduce, sweep_figure

NAME = "gpt2-xl-tiny"


@pytest.fixture(autouse=True)
def _cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLACKSWAP_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))


def _linked(report: str) -> set[str]:
    """The files the report names: images and backquoted file names."""
    return set(re.findall(r"\]\(([^)]+)\)", report)) | set(
        re.findall(r"`([^`]+\.(?:json|png))`", report))


def _no_zero_for_infeasible(results: dict[str, Any]) -> None:
    for w in results["workloads"]:
        for entry in w["strategies"].values():
            assert entry["feasible"] == (entry["retention"] is not None), entry
            assert entry["feasible"] or entry["reason"], entry
        assert w["bound_retention"] is None or w["bound_retention"] > 0
        for key, values in w.get("sweep", {}).items():
            if key not in ("budgets", "peak_bytes"):
                assert 0.0 not in values, (key, values)


def test_every_strategy_infeasible(tmp_path: Path) -> None:
    out = tmp_path / "out"
    code = CliRunner().invoke(main, ["reproduce", "--workloads", NAME, "--budget", "0.01",
                                     "--out", str(out)])
    assert code.exit_code == 0, code.output
    results = json.loads((out / "results.json").read_text())
    _no_zero_for_infeasible(results)
    w = results["workloads"][0]
    assert w["bound_retention"] is None
    assert not any(e["feasible"] for e in w["strategies"].values())
    assert "budget is below" in w["strategies"]["slackswap"]["reason"]
    assert w["working_set_bytes"] > 0 and w["budget_bytes"] < w["working_set_bytes"]
    assert w["budget_bytes"] < w["smallest_feasible_budget_bytes"] <= w["keep_all_peak_bytes"]
    report = (out / "report.md").read_text()
    assert "0.0%" not in report and "| infeasible |" in report
    assert f"No strategy fits {NAME}" in report and "smallest budget" in report
    assert "trace" not in report.lower()
    assert not list(out.glob("*trace*")) and "trace" not in w
    for name in _linked(report):
        assert (out / name).exists(), name
    printed = " ".join(code.stdout.split())  # the console wraps a long path anywhere
    assert "0.0%" not in printed and "traces" not in printed and "plots" not in printed
    assert "(results.json, report.md)" in printed


def test_sweep_gaps(tmp_path: Path) -> None:
    out = tmp_path / "out"
    results = reproduce(out, budget=0.85, workloads=(NAME,), sweep=(0.01, 0.85, 1.0))
    _no_zero_for_infeasible(results)
    w = results["workloads"][0]
    sweep = w["sweep"]
    assert sweep["bound"][0] is None and sweep["slackswap"][0] is None
    assert sweep["slackswap"][2] == 1.0 and sweep["bound"][2] == 1.0
    assert w["plot"] == f"{NAME}-retention.png" and (out / w["plot"]).exists()
    assert w["trace"] == f"{NAME}-slackswap-trace.json" and (out / w["trace"]).exists()
    report = (out / "report.md").read_text()
    assert "0.0%" not in report and "No strategy fits" not in report
    for name in _linked(report):
        assert (out / name).exists(), name
    fig = sweep_figure(w)
    lines = {line.get_label(): line for line in fig.axes[0].get_lines()}
    for label in ("bound", "slackswap", "recompute-only"):
        ys = list(lines[label].get_ydata())
        assert math.isnan(ys[0]) and ys[2] == 100.0, (label, ys)
    assert any("no plan fits" in t.get_label() for t in fig.axes[0].patches)
