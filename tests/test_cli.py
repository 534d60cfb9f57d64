"""The command line: one-line errors, the summary JSON other tools read, the profile file."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
from click.testing import CliRunner

from slackswap.cli import main
from slackswap.core.jsonio import load_model
from slackswap.core.profile import StepProfile
from slackswap.sim.schedule import min_working_set


def run(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, list(args))
    return result.exit_code, result.stdout, result.stderr


def test_summary_json(tmp_path) -> None:
    out = tmp_path / "p.json"
    code, stdout, _ = run("profile", "gpt2-xl-tiny", "--summary", "-o", str(out))
    assert code == 0
    summary = json.loads(stdout)
    for key in ("saved_bytes_total", "saved_bytes_per_layer", "forward_flops", "backward_flops",
                "forward_time_s", "backward_time_s", "num_saved_tensors"):
        assert key in summary
    assert len(summary["saved_bytes_per_layer"]) == 2
    profile = load_model(StepProfile, out)
    assert profile.summary()["saved_bytes_total"] == summary["saved_bytes_total"]
    assert profile.hardware == "a100-80gb"


def test_table_output_and_shape_options() -> None:
    code, stdout, _ = run("profile", "bert-large-tiny", "--batch", "3", "--seq", "16",
                          "--attn", "eager", "--hardware", "h200")
    assert code == 0
    assert "Saved activation bytes by layer" in stdout and "by op kind" in stdout
    assert "h200" in stdout


def test_factory_model() -> None:
    code, stdout, _ = run("profile", "factories:mlp", "--summary")
    assert code == 0
    assert len(json.loads(stdout)["saved_bytes_per_layer"]) == 3


def test_measured_mode() -> None:
    code, stdout, _ = run("profile", "llama-7b-tiny", "--mode", "measured", "--summary")
    assert code == 0
    assert json.loads(stdout)["mode"] == "measured"


@pytest.mark.parametrize(("args", "message"), [
    (["nope"], "unknown model 'nope'; presets: bert-large, gpt2-xl, llama-7b"),
    (["bert-large-tiny", "--hardware", "tpu"], "unknown hardware 'tpu'; presets: a100-40gb"),
    (["missing_module:make"], "cannot import factory 'missing_module:make'"),
    (["factories:nothing_here"], "cannot import factory 'factories:nothing_here'"),
    (["factories:raises"], "raised in forward: ValueError: shape mismatch"),
    (["factories:no_loss"], "returned no loss"),
    (["factories:frozen"], "not a differentiable scalar"),
    (["factories:mlp", "--batch", "2"], "--batch apply to presets only"),
    (["bert-large-tiny", "--batch", "0"], "must be positive"),
    (["factories:empty_batch"], "the example batch is empty"),
])
def test_errors_are_one_line(args: list[str], message: str) -> None:
    code, stdout, stderr = run("profile", *args)
    assert code == 2
    assert message in stderr
    assert stderr.count("\n") == 1 and "Traceback" not in stderr
    assert stdout == ""


def test_bad_hardware_file(tmp_path) -> None:
    path = tmp_path / "hw.toml"
    path.write_text('schema_version = 1\nname = "x"\n[compute]\n')
    code, _, stderr = run("profile", "bert-large-tiny", "--hardware", str(path))
    assert code == 2 and "field 'compute.peak_flops'" in stderr


def test_console_script_end_to_end() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "slackswap", "profile", "nope"],
        capture_output=True, text=True,
    )
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: unknown model 'nope'") and "Traceback" not in proc.stderr


def test_simulate_command(tmp_path) -> None:
    prof = tmp_path / "p.json"
    assert run("profile", "gpt2-xl-tiny", "-o", str(prof), "--summary")[0] == 0
    code, stdout, _ = run("simulate", str(prof), "--json")
    assert code == 0
    result = json.loads(stdout)
    for key in ("step_time_s", "ideal_step_time_s", "retention", "peak_bytes", "feasible",
                "stall_s", "d2h_bytes", "h2d_bytes", "recompute_s"):
        assert key in result
    assert result["retention"] == 1.0
    trace, plot = tmp_path / "t.json", tmp_path / "m.png"
    code, stdout, _ = run("simulate", str(prof), "--memory-limit", "0.99", "--trace",
                          str(trace), "--plot", str(plot), "--hardware", "h200")
    assert "throughput retained" in stdout
    assert json.loads(trace.read_text())["traceEvents"]
    assert plot.stat().st_size > 0


def test_simulate_errors(tmp_path) -> None:
    prof = tmp_path / "p.json"
    run("profile", "bert-large-tiny", "-o", str(prof), "--summary")
    code, _, stderr = run("simulate", str(prof), "--memory-limit", "10")
    assert code == 2 and "irreducible working set" in stderr
    plan = tmp_path / "plan.json"
    plan.write_text('{"schema_version": 1, "fingerprint": "x", "strategy": "s"}')
    code, _, stderr = run("simulate", str(prof), "--plan", str(plan))
    assert code == 2 and "plan.json: field 'decisions': Field required" in stderr
    code, _, stderr = run("simulate", str(tmp_path / "missing.json"))
    assert code == 2 and "cannot read" in stderr
    code, _, stderr = run("simulate", str(prof), "--memory-limit", "-3")
    assert code == 2 and "must be positive" in stderr
    minimum, _ = min_working_set(load_model(StepProfile, prof))
    code, stdout, _ = run("simulate", str(prof), "--memory-limit", str(minimum))
    assert code == 1 and "INFEASIBLE" in stdout and "short by" in stdout


def test_gpus_of_a_node(tmp_path) -> None:
    """``--gpus N`` plans and simulates one of N ranks of a node preset; a one-GPU preset
    is refused in one line."""
    prof, plan = tmp_path / "p.json", tmp_path / "plan.json"
    run("profile", "gpt2-xl-tiny", "--hardware", "dgx-a100", "-o", str(prof), "--summary")
    code, stdout, _ = run("plan", str(prof), "--budget", "0.8", "--gpus", "8", "-o", str(plan))
    assert code == 0, stdout
    code, stdout, _ = run("simulate", str(prof), "--plan", str(plan), "--gpus", "8", "--json")
    assert code == 0 and json.loads(stdout)["feasible"]
    for command in (("simulate", str(prof)), ("plan", str(prof), "--budget", "0.5")):
        code, _, stderr = run(*command, "--hardware", "a100-80gb", "--gpus", "8")
        assert code == 2 and "describes one GPU, not a node" in stderr
        assert len(stderr.strip().splitlines()) == 1
    code, _, stderr = run("simulate", str(prof), "--gpus", "0")
    assert code == 2 and "--gpus" in stderr


def test_plan_command(tmp_path) -> None:
    prof, out = tmp_path / "p.json", tmp_path / "plan.json"
    run("profile", "gpt2-xl-tiny", "-o", str(prof), "--summary")
    code, stdout, _ = run("plan", str(prof), "--budget", "0.8", "-o", str(out))
    assert code == 0, stdout
    assert "predicted retention" in stdout and "by op kind" in stdout and "by layer" in stdout
    plan = json.loads(out.read_text())
    assert plan["strategy"] == "slackswap" and plan["schema_version"] == 1
    code, stdout, _ = run("simulate", str(prof), "--plan", str(out), "--memory-limit", "0.8",
                          "--json")
    assert code == 0 and json.loads(stdout)["feasible"]
    code, stdout, _ = run("plan", "llama-7b-tiny", "--budget", "0.8", "--strategy",
                          "checkpoint-blocks")
    assert code == 0 and "checkpoint-blocks" in stdout
    code, stdout, _ = run("plan", "llama-7b-tiny", "--budget", "0.8", "--strategy",
                          "checkpoint-offload")
    assert code == 0 and re.search(r"checkpoints \(.*\): keep 0 B\s+offload 16\.00 KiB",
                                   " ".join(stdout.split()))


@pytest.mark.parametrize(("args", "message"), [
    (["--budget", "0.01"], "smallest budget known to fit this profile is"),
    (["--budget", "-1"], "must be positive"),
    (["--budget", "lots"], "'lots' is not a byte count"),
    (["--budget", "0.5", "--strategy", "magic"], "unknown strategy 'magic'; strategies:"),
])
def test_plan_errors(tmp_path, args: list[str], message: str) -> None:
    prof = tmp_path / "p.json"
    run("profile", "bert-large-tiny", "-o", str(prof), "--summary")
    code, _, stderr = run("plan", str(prof), *args)
    assert code == 2 and message in stderr and stderr.count("\n") == 1


def test_reproduce_command(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("SLACKSWAP_CACHE", str(tmp_path / "cache"))
    out, js = tmp_path / "results", tmp_path / "r.json"
    code, stdout, _ = run("reproduce", "--workloads", "gpt2-xl-tiny", "--out", str(out),
                          "--json", str(js), "--budget", "0.85", "--sweep")
    assert code == 0, stdout
    results = json.loads(js.read_text())
    assert results["budget_fraction"] == 0.85 and results["hardware"] == "a100-80gb"
    w = results["workloads"][0]
    assert w["name"] == "gpt2-xl-tiny"
    for key in ("ideal_step_time_s", "keep_all_peak_bytes", "budget_bytes", "bound_retention"):
        assert key in w
    for entry in w["strategies"].values():
        assert set(entry) >= {"retention", "peak_bytes", "feasible", "offloaded_bytes",
                              "recomputed_bytes", "plan_time_s"}
        # an infeasible strategy has no retention (null), not 0
        assert entry["feasible"] == (entry["retention"] is not None)
        assert not entry["feasible"] or entry["retention"] <= w["bound_retention"] + 1e-9
    for name in ("report.md", "results.json", "gpt2-xl-tiny-retention.png",
                 "gpt2-xl-tiny-slackswap-trace.json"):
        assert (out / name).exists(), name
    assert list((tmp_path / "cache" / "profiles").glob("gpt2-xl-tiny-*.json"))
    quick = tmp_path / "quick"  # no sweep: the table and traces, no plot
    code, stdout, _ = run("reproduce", "--workloads", "gpt2-xl-tiny", "--out", str(quick),
                          "--budget", "0.85")
    assert code == 0, stdout
    assert not list(quick.glob("*.png")) and ".png" not in (quick / "report.md").read_text()
    assert (quick / "gpt2-xl-tiny-slackswap-trace.json").exists()
    code, _, stderr = run("reproduce", "--workloads", "gpt3")
    assert code == 2 and "unknown workload 'gpt3'" in stderr


@pytest.mark.heavy  # CLI runs in subprocesses (10 s on two loaded cores)
def test_a_cache_that_cannot_be_written_is_read_only(tmp_path, monkeypatch) -> None:
    """Issue 50: ``fit`` and ``reproduce`` run on a cache they cannot write (its root is a
    file here), saying so once per folder in one line, not refusing to run."""
    root = tmp_path / "a-file"
    root.write_text("not a folder")
    monkeypatch.setenv("SLACKSWAP_CACHE", str(root))
    code, stdout, stderr = run("fit", "gpt2-xl-tiny", "--seq", "64", "--json")
    assert code == 0, stderr
    assert json.loads(stdout)["model"] == "gpt2-xl-tiny"
    assert sorted(stderr.splitlines()) == [
        f"warning: cache {root}/{folder} cannot be written (Not a directory): results are "
        "not stored" for folder in ("plans", "profiles")]
    code, _, stderr = run("reproduce", "--workloads", "gpt2-xl-tiny", "--out",
                          str(tmp_path / "out"), "--budget", "0.85")
    assert code == 0, stderr
    assert "Traceback" not in stderr and root.read_text() == "not a folder"


def test_a_damaged_cache_entry_is_rebuilt_with_one_warning(tmp_path, monkeypatch) -> None:
    """Issue 50: a NaN written into a cached plan's time never reaches results.json."""
    monkeypatch.setenv("SLACKSWAP_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "out"
    args = ("reproduce", "--workloads", "gpt2-xl-tiny", "--out", str(out), "--budget", "0.85")
    assert run(*args)[0] == 0
    [entry] = (tmp_path / "cache" / "plans").glob("slackswap-*.json")
    data = json.loads(entry.read_text())
    entry.write_text(entry.read_text().replace(f'"seconds": {data["seconds"]}',
                                               '"seconds": NaN'))
    code, _, stderr = run(*args)
    assert code == 0, stderr
    assert stderr == (f"warning: cache entry {entry} is damaged (not valid JSON (NaN is not a "
                      "number JSON holds)): made again\n")
    assert "NaN" not in (out / "results.json").read_text()
