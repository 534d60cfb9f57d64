"""benchmarks/published/runs.toml: every row parses, has its configuration and a source,
and the rows span the GPUs and workload families issue 13 asks for (no model is built)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

from slackswap.core.hardware import load_hardware
from slackswap.errors import InputError

ROOT = Path(__file__).resolve().parent.parent


def _fidelity() -> ModuleType:
    spec = importlib.util.spec_from_file_location("fidelity", ROOT / "benchmarks" / "fidelity.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["fidelity"] = module  # dataclasses resolve annotations through it
    spec.loader.exec_module(module)
    return module


def test_every_row_parses_with_a_source_and_a_preset() -> None:
    runs = _fidelity().load_runs()
    assert len(runs) >= 10
    for run in runs:
        assert run.source_repo and run.source_file and run.source_where, run.id
        assert run.published_per_gpu > 0, run.id
        assert load_hardware(run.hardware).name == run.hardware
        assert run.micro_batch > 0 and run.seq > 0 and run.gpus > 0 and run.grad_accum > 0
    assert {r.hardware for r in runs} >= {"a100-80gb", "h100-sxm", "h200"}
    assert {r.family for r in runs} >= {"bert", "gpt2", "llama"}


def test_published_figures_become_per_gpu_throughput() -> None:
    runs = {r.id: r for r in _fidelity().load_runs()}
    assert runs["gpt3-1.3b-flash-a100"].published_per_gpu == 169000 / 8  # tokens/s of 8 GPUs
    # 164 model TFLOP/s per A100 over 72 l h^2 (1 + s/6h + V/16lh) FLOPs per token
    assert runs["gpt2-xl-flash-a100"].published_per_gpu == pytest.approx(16153, rel=1e-3)
    assert runs["bert-large-p2-a100"].published_per_gpu == 210


def test_a_row_without_its_source_is_refused(tmp_path: Path) -> None:
    fidelity = _fidelity()
    text = (ROOT / "benchmarks" / "published" / "runs.toml").read_text()
    rows = text.split("\n[[run]]\n")
    first = rows[0] + "\n[[run]]\n" + rows[1]
    bad = tmp_path / "runs.toml"
    bad.write_text("\n".join(line for line in first.splitlines()
                             if not line.startswith("source_where")))
    with pytest.raises(InputError, match="source"):
        fidelity.load_runs(bad)


def test_each_row_has_a_stack_an_optimizer_share_and_a_ratio_before() -> None:
    fidelity = _fidelity()
    runs = fidelity.load_runs()
    before = fidelity.load_before()
    assert {r.id for r in runs} == set(before)  # every row's ratio before calibration
    for run in runs:
        assert run.simulated_stack in ("eager", "fused")
        assert 1 <= run.optimizer_shards <= run.gpus
    # the runs whose stack fuses their memory-bound ops are simulated fused
    assert {r.id for r in runs if r.simulated_stack == "fused"} >= {
        "bert-large-p1-a100", "bert-large-p2-a100", "gpt2-xl-flash-a100"}


def test_a_row_with_an_unknown_stack_is_refused(tmp_path: Path) -> None:
    fidelity = _fidelity()
    text = (ROOT / "benchmarks" / "published" / "runs.toml").read_text()
    bad = tmp_path / "runs.toml"
    bad.write_text(text.replace('simulated_stack = "fused"', 'simulated_stack = "compiled"', 1))
    with pytest.raises(InputError, match="simulated_stack"):
        fidelity.load_runs(bad)


def test_data_parallel_rows_state_their_collectives() -> None:
    fidelity = _fidelity()
    runs = {r.id: r for r in fidelity.load_runs()}
    for run in runs.values():  # a run over several GPUs says how they share the model
        assert (run.data_parallel == "none") == (run.gpus == 1), run.id
    # inside a node: NVLink's bus bandwidth; a shard group over 4 nodes, a 400 Gb/s NIC
    # per GPU: the lesser of NVLink's and the node's 8 NICs' (8 x 46 GB/s)
    assert fidelity.data_parallel(runs["mpt-7b-h100"]).intra_busbw == 360e9
    assert fidelity.data_parallel(runs["llama3.1-8b-fsdp-h200"]).intra_busbw == 360e9
    hsdp = fidelity.data_parallel(runs["llama2-7b-fsdp-a100"])
    assert (hsdp.kind, hsdp.replicas, hsdp.inter_busbw) == ("hsdp", 16, 46e9)
    assert fidelity.data_parallel(runs["bert-large-p1-a100"]) is None


def test_a_data_parallel_row_without_its_source_is_refused(tmp_path: Path) -> None:
    fidelity = _fidelity()
    text = (ROOT / "benchmarks" / "published" / "runs.toml").read_text()
    bad = tmp_path / "runs.toml"
    bad.write_text("\n".join(line for line in text.splitlines()
                             if not line.startswith("comm_source")))
    with pytest.raises(InputError, match="comm_source"):
        fidelity.load_runs(bad)
