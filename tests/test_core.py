"""Data model, units, JSON files: plain Python, no torch."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import BinaryIO

import pytest
from hypothesis import given
from hypothesis import strategies as st

from slackswap.core.jsonio import atomic_write, atomic_write_text, dump_model, load_model
from slackswap.core.plan import Plan
from slackswap.core.profile import OpRecord, StepProfile, TensorRecord
from slackswap.core.result import SimResult
from slackswap.core.units import parse_bytes
from slackswap.errors import InputError


def small_profile() -> StepProfile:
    """x -> mm -> relu (saved) -> sum; backward reads the relu output."""
    ops = [
        OpRecord(index=0, name="aten.mm.default", kind="mm", phase="forward", module="lin",
                 category="matmul", dtype="bf16", flops=2e9, bytes_read=8, bytes_written=4,
                 time_s=1e-3, inputs=[0, 1], outputs=[2]),
        OpRecord(index=1, name="aten.relu.default", kind="relu", phase="forward", module="act",
                 category="memory", dtype="bf16", flops=0, bytes_read=4, bytes_written=4,
                 time_s=2e-4, inputs=[2], outputs=[3]),
        OpRecord(index=2, name="aten.threshold_backward.default", kind="threshold_backward",
                 phase="backward", module="act", category="memory", dtype="bf16", flops=0,
                 bytes_read=8, bytes_written=4, time_s=3e-4, inputs=[3], outputs=[4]),
    ]
    tensors = [
        TensorRecord(id=0, name="input:x", kind="input", bytes=4, dtype="bf16", shape=[2],
                     forward_consumers=[0], saved=True, first_backward_use=2),
        TensorRecord(id=1, name="lin.weight", kind="parameter", bytes=4, dtype="bf16",
                     shape=[2], forward_consumers=[0], saved=True),
        TensorRecord(id=2, kind="activation", bytes=4, dtype="bf16", shape=[2], producer=0,
                     forward_consumers=[1]),
        TensorRecord(id=3, name="act:relu:0", kind="activation", bytes=4, dtype="bf16",
                     shape=[2], producer=1, backward_consumers=[2], saved=True,
                     first_backward_use=2),
        TensorRecord(id=4, kind="activation", bytes=4, dtype="bf16", shape=[2], producer=2),
    ]
    return StepProfile(model="toy", fingerprint="f" * 64, hardware="a100-80gb",
                       mode="analytic", kernels="cuda", device="cpu", layers=["lin", "act"],
                       model_state_bytes=4, ops=ops, tensors=tensors)


def test_a_copy_derives_its_own_tables() -> None:
    """A profile copied with other op times simulates as a fresh profile of those times,
    not with the tables the original cached (the schedule keeps op times per profile)."""
    from slackswap.sim.simulate import simulate

    p = small_profile()
    simulate(p, Plan.keep_all(p), "a100-80gb", 1.0)  # fills the original's caches
    slower = p.model_copy(update={"ops": [op.model_copy(update={"time_s": 3 * op.time_s})
                                          for op in p.ops]})
    fresh = StepProfile.model_validate(slower.model_dump())
    copied, rebuilt = (simulate(q, Plan.keep_all(q), "a100-80gb", 1.0) for q in (slower, fresh))
    assert copied.step_time_s == rebuilt.step_time_s > simulate(p).step_time_s
    assert copied.ideal_step_time_s == rebuilt.ideal_step_time_s


def test_profile_views() -> None:
    p = small_profile()
    # the parameter is excluded, the batch input is not
    assert [t.name for t in p.saved_activations] == ["input:x", "act:relu:0"]
    s = p.summary()
    assert s["saved_bytes_total"] == 8
    assert s["saved_bytes_per_layer"] == [0, 4]
    assert s["forward_time_s"] == pytest.approx(1.2e-3)
    assert s["backward_time_s"] == pytest.approx(3e-4)
    assert s["forward_flops"] == 2e9 and s["backward_flops"] == 0


@pytest.mark.parametrize("make", [
    small_profile,
    lambda: Plan.keep_all(small_profile()),
    lambda: SimResult(fingerprint="f", strategy="keep-all", feasible=True, step_time_s=2.0,
                      ideal_step_time_s=1.0, retention=0.5, peak_bytes=10, peak_time_s=0.5,
                      stall_s={"reload": 0.25}),
])
def test_json_round_trip(tmp_path, make) -> None:
    obj = make()
    path = tmp_path / "obj.json"
    dump_model(obj, path)
    data = json.loads(path.read_text())
    assert data["schema_version"] == type(obj).model_fields["schema_version"].default
    assert load_model(type(obj), path) == obj


@pytest.mark.parametrize("cls", [StepProfile, SimResult])
def test_files_of_an_older_schema_load(tmp_path, cls) -> None:
    """Profiles and results of schema 1 (before weight gradients were their own kind and
    were reported apart) still load."""
    obj = small_profile() if cls is StepProfile else SimResult(
        fingerprint="f", strategy="keep-all", feasible=True, step_time_s=2.0,
        ideal_step_time_s=1.0, retention=0.5, peak_bytes=10, peak_time_s=0.5)
    data = obj.model_dump()
    data["schema_version"] = 1
    data.pop("gradient_bytes", None)
    path = tmp_path / "old.json"
    path.write_text(json.dumps(data))
    assert load_model(cls, path).schema_version == 1


def test_newer_schema_is_refused(tmp_path) -> None:
    path = tmp_path / "plan.json"
    data = Plan.keep_all(small_profile()).model_dump()
    data["schema_version"] = 99
    path.write_text(json.dumps(data))
    with pytest.raises(InputError, match="schema_version 99 is newer"):
        load_model(Plan, path)


def test_malformed_file_names_file_and_field(tmp_path) -> None:
    path = tmp_path / "profile.json"
    data = small_profile().model_dump()
    data["ops"][1]["phase"] = "sideways"
    path.write_text(json.dumps(data))
    with pytest.raises(InputError, match=r"profile\.json: field 'ops\.1\.phase'"):
        load_model(StepProfile, path)
    path.write_text("{not json")
    with pytest.raises(InputError, match=r"profile\.json: not valid JSON"):
        load_model(StepProfile, path)


def test_plan_check() -> None:
    p = small_profile()
    Plan.keep_all(p).check(p)
    with pytest.raises(InputError, match="different model or batch shape"):
        Plan(fingerprint="0" * 64, strategy="x", decisions={}).check(p)
    with pytest.raises(InputError, match="does not save"):
        Plan(fingerprint=p.fingerprint, strategy="x", decisions={"lin:mm:7": "offload"}).check(p)
    with pytest.raises(InputError, match="'lin.weight', a parameter or buffer"):
        Plan(fingerprint=p.fingerprint, strategy="x", decisions={"lin.weight": "offload"}).check(p)
    with pytest.raises(InputError, match="'input:x', a batch input"):
        Plan(fingerprint=p.fingerprint, strategy="x", decisions={"input:x": "recompute"}).check(p)


def test_atomic_write_leaves_old_file_on_failure(tmp_path) -> None:
    path = tmp_path / "out.json"
    atomic_write_text(path, "old")

    def fail(f: BinaryIO) -> None:
        f.write(b"half")
        raise ValueError("the writer failed")

    with pytest.raises(ValueError, match="the writer failed"):
        atomic_write(path, fail)
    assert path.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["out.json"]


@given(st.integers(min_value=1, max_value=2**33 - 1),  # under 8 EiB, the most a count holds
       st.sampled_from([("", 1), ("KiB", 2**10), ("MiB", 2**20), ("GiB", 2**30), ("GB", 10**9)]))
def test_parse_bytes(n: int, unit: tuple[str, int]) -> None:
    suffix, scale = unit
    assert parse_bytes(f"{n}{suffix}") == n * scale
    assert parse_bytes(f"{n} {suffix.lower()}") == n * scale


@pytest.mark.parametrize("bad", ["", "GiB", "-5GiB", "0", "12 parsecs", "1e-3", "1e19",
                                 "9000000000GiB"])
def test_parse_bytes_rejects(bad: str) -> None:
    with pytest.raises(InputError):
        parse_bytes(bad)


def test_core_does_not_import_torch() -> None:
    code = (
        "import sys, slackswap, slackswap.core.costmodel, slackswap.core.plan, "
        "slackswap.core.result, slackswap.core.jsonio, slackswap.core.units, "
        "slackswap.sim, slackswap.sim.outputs, slackswap.sim.host, slackswap.planners, "
        "slackswap.planners.bound, slackswap.core.watched, slackswap.runtime, "
        "slackswap.runtime.watch, "
        "slackswap.runtime.checks\n"
        "from slackswap.core.plan import Plan\n"
        "slackswap.load_hardware('a100-80gb')\n"
        "plan = Plan(fingerprint=profile.fingerprint, strategy='x', decisions={'act:relu:0': "
        "'recompute'})\n"
        "r = slackswap.simulate(profile, plan)  # the host asks core.watched what it watches\n"
        "assert r.run.host is not None and r.stall_s['host'] >= 0\n"
        "assert 'torch' not in sys.modules, 'core imported torch'"
    )
    profile = small_profile().model_copy(update={"saves": [(0, 0), (3, 2)],
                                                 "module_events": [0, 1, 2]})
    setup = f"import json\nfrom slackswap.core.profile import StepProfile\n" \
            f"profile = StepProfile.model_validate(json.loads({profile.model_dump_json()!r}))\n"
    subprocess.run([sys.executable, "-c", setup + code], check=True)
