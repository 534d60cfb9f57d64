"""``benchmarks/gpu_diag.py`` on a CPU: its trace summary on a made-up trace, its memory
verdicts, one tiny workload end to end (so the GPU session does not fail on a typo),
and the measured profiles a GPU session saved under ``docs/results-gpu/``, replayed in
the simulator."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import slackswap
from slackswap.core.plan import Plan
from slackswap.core.profile import StepProfile

ROOT = Path(__file__).parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import gpu_diag  # noqa: E402


def _kernel(ts: float, dur: float, correlation: int, stream: int = 7) -> dict:
    return {"ph": "X", "cat": "kernel", "name": f"k{correlation}", "ts": ts, "dur": dur,
            "args": {"stream": stream, "correlation": correlation}}


def _launch(ts: float, dur: float, correlation: int) -> dict:
    return {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": ts,
            "dur": dur, "args": {"correlation": correlation}}


def _copy(ts: float, dur: float, direction: str, nbytes: int, stream: int) -> dict:
    kind = "Device -> Pinned" if direction == "DtoH" else "Pinned -> Device"
    return {"ph": "X", "cat": "gpu_memcpy", "name": f"Memcpy {direction} ({kind})",
            "ts": ts, "dur": dur, "args": {"stream": stream, "bytes": nbytes}}


def test_the_trace_summary_splits_compute_idle_by_cause() -> None:
    """Compute stream 7 runs three kernels (us): 0-100, 200-300 (launched at 150, after
    the gap began: the host was late), 500-600 (launched at 120, long before: it waited
    for a copy). A D2H copy of 1 GB in 20 ms, an H2D one of 0.5 GB in 10 ms."""
    trace = {"traceEvents": [
        {"ph": "X", "cat": "user_annotation", "name": "STEP_FORWARD", "ts": 0, "dur": 250},
        {"ph": "X", "cat": "user_annotation", "name": "STEP_BACKWARD", "ts": 260, "dur": 100},
        _launch(-10, 5, 1), _kernel(0, 100, 1),
        _launch(150, 10, 2), _kernel(200, 100, 2),
        _launch(120, 5, 3), _kernel(500, 100, 3),
        _copy(50, 20_000, "DtoH", 10**9, stream=20),
        _copy(30_000, 10_000, "HtoD", 5 * 10**8, stream=21),
        {"ph": "i", "name": "ignored"},
    ]}
    s = gpu_diag.summarise_trace(trace)
    assert s["compute_stream"] == "7"
    assert s["compute_busy_ms"] == pytest.approx(0.3)
    assert s["compute_idle_ms"] == {"host": pytest.approx(0.1), "copies": pytest.approx(0.2)}
    assert s["compute_idle_by_phase_ms"] == {"forward_host": pytest.approx(0.1),
                                             "forward_copies": pytest.approx(0.2)}
    assert s["host_ms"] == {"forward": 0.25, "backward": 0.1}
    assert s["copies"]["DtoH"]["GBps"] == pytest.approx(50.0)
    assert s["copies"]["HtoD"]["GBps"] == pytest.approx(50.0)
    assert s["gpu_span_ms"] == pytest.approx(40.0)
    assert set(s["streams"]) == {"7", "20", "21"}
    assert s["runtime_calls"]["cudaLaunchKernel"]["n"] == 3
    assert "GB/s" in gpu_diag.trace_line("x", s)
    # a CPU's trace has no device events: an empty summary, not an error
    empty = gpu_diag.summarise_trace({"traceEvents": trace["traceEvents"][:2]})
    assert empty["gpu_span_ms"] == 0.0 and empty["host_ms"]["forward"] == 0.25


def test_the_memory_check_allows_one_percent_over_the_budget() -> None:
    row = {"budget_bytes": 1000, "sim_peak_bytes": 990}
    assert gpu_diag.memory_check("a", row | {"peak_bytes": 1010})[0] == "PASS"
    assert gpu_diag.memory_check("a", row | {"peak_bytes": 1011})[0] == "FAIL"
    assert gpu_diag.memory_check("a", row | {"peak_bytes": None})[0] == "SKIP"
    assert gpu_diag.memory_check("a", {"error": "no plan"})[0] == "SKIP"


def _replays(profile_path: Path) -> None:
    """A saved measured profile and its plans, simulated on the h200 preset."""
    profile = StepProfile.load(profile_path)
    keep = slackswap.simulate(profile, None, "h200")
    assert keep.feasible and keep.step_time_s > 0
    assert keep.peak_bytes == profile.keep_all_peak
    for path in sorted((profile_path.parent / "plans").glob("*.json")):
        plan = Plan.load(path)
        assert plan.fingerprint == profile.fingerprint, path
        sim = slackswap.simulate(profile, plan, "h200", memory_limit=plan.budget_bytes)
        assert sim.step_time_s > 0, path


def test_a_tiny_workload_runs_end_to_end_on_a_cpu(tmp_path: Path,
                                                  capsys: pytest.CaptureFixture) -> None:
    """What the GPU session runs, on gpt2-xl-tiny: a plan, a strategy that cannot plan,
    a trace, the saved profile replayed, and the session's table."""
    out = tmp_path / "gpt2-xl-tiny"
    rc = gpu_diag.main(["--device", "cpu", "--model", "gpt2-xl-tiny", "--steps", "1",
                        "--strategies", "offload-only,recompute-only",
                        "--trace", "keep-all,offload-only", "--out", str(out)])
    assert rc == 0
    diag = json.loads((out / "diag.json").read_text())
    assert diag["keep_all"]["step_ms"] > 0
    assert diag["plans"]["offload-only"]["sim_retention"] > 0
    assert "error" in diag["plans"]["recompute-only"]  # out of reach at 50%
    assert [c["verdict"] for c in diag["memory_checks"]] == ["SKIP", "SKIP"]  # no CUDA
    assert set(diag["traces"]) == {"keep-all", "offload-only"}
    assert (out / "trace-offload-only.json.gz").stat().st_size > 0
    _replays(out / "profile.json")
    capsys.readouterr()
    assert gpu_diag.main(["--summary", str(tmp_path)]) == 0
    table = capsys.readouterr().out
    assert "gpt2-xl-tiny | offload-only" in table and "no plan" in table


COMMITTED = sorted((ROOT / "docs" / "results-gpu").glob("**/profile.json"))


@pytest.mark.skipif(not COMMITTED, reason="no measured profile is committed under "
                    "docs/results-gpu/ yet (benchmarks/gpu_session.sh saves them)")
@pytest.mark.parametrize("path", COMMITTED, ids=lambda p: str(p.parent.relative_to(ROOT)))
def test_a_committed_measured_profile_replays_on_a_cpu(path: Path) -> None:
    _replays(path)


def test_the_session_script_parses() -> None:
    """``bash -n``: the GPU session does not fail on a shell typo (``--cpu-smoke`` runs it
    whole on a CPU, in about a minute)."""
    script = ROOT / "benchmarks" / "gpu_session.sh"
    done = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True,
                          check=False)
    assert done.returncode == 0, done.stderr
