"""Hardware presets and the roofline cost model."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from slackswap.core.costmodel import op_time, step_efficiency
from slackswap.core.hardware import hardware_presets, load_hardware
from slackswap.core.profile import OpRecord
from slackswap.errors import InputError

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

PRESETS = ["a100-80gb", "a100-40gb", "h100-pcie", "h200", "gh200"]


def test_presets_shipped() -> None:
    assert sorted(hardware_presets()) == sorted(PRESETS)


@pytest.mark.parametrize("name", PRESETS)
def test_every_field_cites_a_source(name: str) -> None:
    hw = load_hardware(name)
    assert hw.name == name
    for section in ("compute", "memory", "host_link", "host"):
        for field in type(getattr(hw, section)).model_fields:
            source = hw.sources.get(f"{section}.{field}", "")
            assert len(source) > 20, f"{name}: {section}.{field} has no source"


def test_reference_facts() -> None:
    """The A100 figures DESIGN.md starts from."""
    hw = load_hardware("a100-80gb")
    assert hw.peak("bf16") == 312e12
    assert hw.memory.hbm_bandwidth == 2.039e12
    assert hw.memory.capacity_bytes == 80 * 2**30
    assert hw.host_link.duplex_h2d_bandwidth < hw.host_link.h2d_bandwidth


def _write_without(tmp_path: Path, section: str, field: str, value: object = None) -> Path:
    preset = Path(load_hardware.__code__.co_filename).parent.parent / "hardware" / "presets"
    text = (preset / "a100-80gb.toml").read_text()
    data = tomllib.loads(text)
    lines = []
    current = ""
    for line in text.splitlines():
        if line.startswith("["):
            current = line.strip("[]")
        key = line.split("=")[0].strip()
        if current == section and key == field:
            if value is None:
                continue
            line = f"{field} = {value}"
        lines.append(line)
    assert field in data[section]
    path = tmp_path / "custom.toml"
    path.write_text("\n".join(lines))
    return path


def test_missing_field_is_named(tmp_path) -> None:
    path = _write_without(tmp_path, "host_link", "h2d_bandwidth")
    with pytest.raises(InputError, match=r"custom\.toml: field 'host_link\.h2d_bandwidth'"):
        load_hardware(path)


def test_negative_field_is_named(tmp_path) -> None:
    path = _write_without(tmp_path, "memory", "hbm_bandwidth", "-1.0")
    with pytest.raises(InputError, match=r"field 'memory\.hbm_bandwidth'.*greater than 0"):
        load_hardware(path)


def test_user_file_loads(tmp_path) -> None:
    path = _write_without(tmp_path, "memory", "hbm_bandwidth", "3.0e12")
    assert load_hardware(path).memory.hbm_bandwidth == 3.0e12


def test_unknown_preset_lists_presets() -> None:
    with pytest.raises(InputError, match="presets: a100-40gb, a100-80gb"):
        load_hardware("tpu-v9")


def _op(category: str, flops: float, nbytes: int, dtype: str = "bf16") -> OpRecord:
    return OpRecord(index=0, name="x", kind="x", phase="forward", module="", category=category,
                    dtype=dtype, flops=flops, bytes_read=nbytes // 2,
                    bytes_written=nbytes - nbytes // 2, time_s=0, inputs=[], outputs=[])


def test_large_gemm_is_compute_bound() -> None:
    hw = load_hardware("a100-80gb")
    flops = 2 * 8192**3
    nbytes = 3 * 8192 * 8192 * 2
    expected = flops / (312e12 * hw.compute.matmul_efficiency_cap)
    assert op_time(_op("matmul", flops, nbytes), hw) == pytest.approx(expected)


def test_elementwise_is_memory_bound() -> None:
    hw = load_hardware("a100-80gb")
    nbytes = 2 * 2**30
    assert op_time(_op("memory", 0, nbytes), hw) == pytest.approx(nbytes / (2.039e12 * 0.88))


def test_tiny_kernel_and_free_ops() -> None:
    hw = load_hardware("a100-80gb")
    assert op_time(_op("memory", 0, 16), hw) == hw.compute.min_kernel_time_s
    assert op_time(_op("free", 0, 1 << 30), hw) == 0.0


@given(st.sampled_from(["matmul", "memory", "attention_forward", "attention_backward"]),
       st.floats(0, 1e15), st.integers(0, 2**40), st.sampled_from(PRESETS))
def test_time_between_best_and_worst_roofline(category: str, flops: float, nbytes: int,
                                              name: str) -> None:
    """Every op takes between its roofline at best and at worst efficiency of the preset."""
    hw = load_hardware(name)
    c, m = hw.compute, hw.memory
    mem_eff = [e for _, e in m.bandwidth_efficiency]
    comp_eff = {
        "matmul": [min(e, c.matmul_efficiency_cap) for _, e in c.matmul_efficiency],
        "attention_forward": [c.attention_forward_efficiency],
        "attention_backward": [c.attention_backward_efficiency],
    }.get(category)
    f = flops if comp_eff else 0.0
    peak = hw.peak("bf16")

    def roof(ce: float, me: float) -> float:
        return max(f / (peak * ce), nbytes / (m.hbm_bandwidth * me), c.min_kernel_time_s)

    best = roof(max(comp_eff or [1]), max(mem_eff))
    worst = roof(min(comp_eff or [1]), min(mem_eff))
    t = op_time(_op(category, flops, nbytes), hw)
    assert best * (1 - 1e-12) <= t <= worst * (1 + 1e-12)


def test_step_efficiency() -> None:
    table = [(0, 0.1), (10, 0.5), (100, 0.9)]
    assert [step_efficiency(table, s) for s in (0, 9, 10, 99, 100, 1e9)] == [
        0.1, 0.1, 0.5, 0.5, 0.9, 0.9]
