"""Hardware presets and the roofline cost model."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from slackswap.core.costmodel import OpDetail, op_time, step_efficiency, step_times, unaligned
from slackswap.core.hardware import hardware_presets, load_hardware, on_node
from slackswap.core.profile import OpRecord, TensorRecord
from slackswap.errors import InputError

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

PRESETS = ["a100-80gb", "a100-40gb", "h100-pcie", "h100-sxm", "h200", "gh200", "dgx-a100",
           "dgx-h200", "l4", "l40s", "a10g", "rtx-4090", "rtx-6000-ada"]
NODES = {"dgx-a100": "a100-80gb", "dgx-h200": "h200"}  # node preset -> its GPU's preset


def test_presets_shipped() -> None:
    assert sorted(hardware_presets()) == sorted(PRESETS)


COPY_COSTS = ("offload_s", "reload_s")
# fields a preset may leave unset, then absent from it and its JSON
OPTIONAL = ("matmul_unaligned_efficiency", "attention_reference_seq",
            "attention_causal_forward_overhead", "attention_causal_backward_overhead",
            "reduction_bandwidth_efficiency", "unvectorized_elements_per_s", "kernel_passes",
            "random_elements_per_s")


@pytest.mark.parametrize("name", PRESETS)
def test_every_field_cites_a_source(name: str) -> None:
    hw = load_hardware(name)
    assert hw.name == name
    for section in ("compute", "memory", "host_link", "host", "node"):
        if getattr(hw, section) is None:  # a GPU preset has no node
            continue
        for field in type(getattr(hw, section)).model_fields:
            if section == "host" and field in COPY_COSTS and not getattr(hw.host, field):
                continue  # not counted: absent from the preset and its JSON (NOTE [copy costs])
            if field in OPTIONAL and getattr(getattr(hw, section), field) is None:
                continue  # unset: absent from the preset and its JSON
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
       st.floats(0, 1e15), st.integers(0, 2**40), st.sampled_from(PRESETS), st.booleans())
def test_time_between_best_and_worst_roofline(category: str, flops: float, nbytes: int,
                                              name: str, causal: bool) -> None:
    """Every op takes between its roofline at best and at worst efficiency of the preset."""
    hw = load_hardware(name)
    c, m = hw.compute, hw.memory
    mem_eff = [e for _, e in m.bandwidth_efficiency]
    comp_eff = {
        "matmul": [min(e, c.matmul_efficiency_cap) for _, e in c.matmul_efficiency],
        "attention_forward": [c.attention_forward_efficiency,
                              c.attention_causal_forward_efficiency or 1],
        "attention_backward": [c.attention_backward_efficiency,
                               c.attention_causal_backward_efficiency or 1],
    }.get(category)
    f = flops if comp_eff else 0.0
    peak = hw.peak("bf16")

    def roof(ce: float, me: float) -> float:
        return max(f / (peak * ce), nbytes / (m.hbm_bandwidth * me), c.min_kernel_time_s)

    best = roof(max(comp_eff or [1]), max(mem_eff))
    worst = roof(min(comp_eff or [1]), min(mem_eff))
    t = op_time(_op(category, flops, nbytes), hw, causal=causal)
    assert best * (1 - 1e-12) <= t <= worst * (1 + 1e-12)


def test_causal_attention_has_its_own_efficiency() -> None:
    """A causal attention kernel runs at the preset's causal figure (its FLOPs already
    halved); a preset without one uses the figure without the mask."""
    flops = 1e12  # compute-bound: a few MB moved
    h100, a100 = load_hardware("h100-sxm"), load_hardware("a100-80gb")
    for hw, kind, plain, masked in (
            (h100, "attention_forward", h100.compute.attention_forward_efficiency,
             h100.compute.attention_causal_forward_efficiency),
            (h100, "attention_backward", h100.compute.attention_backward_efficiency,
             h100.compute.attention_causal_backward_efficiency),
            (a100, "attention_backward", a100.compute.attention_backward_efficiency,
             a100.compute.attention_backward_efficiency)):  # a100: no causal figure
        op = _op(kind, flops, 1 << 22)
        assert op_time(op, hw) == pytest.approx(flops / (989e12 if hw is h100 else 312e12)
                                                / plain)
        assert op_time(op, hw, causal=True) == pytest.approx(
            flops / (989e12 if hw is h100 else 312e12) / masked)
    assert a100.compute.attention_causal_backward_efficiency is None


def test_the_stack_is_a_hardware_setting() -> None:
    eager = load_hardware("a100-80gb")
    assert eager.stack == "eager" and "eager" in eager.sources["stack"]
    fused = load_hardware("a100-80gb", overrides={"stack": "fused"})
    assert fused.stack == "fused" and fused.name == "a100-80gb+1 override"
    assert fused.compute == eager.compute and "stack='fused'" in fused.description
    with pytest.raises(InputError, match="stack"):
        load_hardware("a100-80gb", overrides={"stack": "compiled"})
    with pytest.raises(InputError, match="unknown hardware field 'stacks'"):
        load_hardware("a100-80gb", overrides={"stacks": "fused"})


def _tensor(tid: int, nbytes: int, producer: int | None, consumers: list[int],
            saved: bool = False, kind: str = "activation") -> TensorRecord:
    phase_split = 3  # ops 0-2 forward, 3 on backward
    return TensorRecord(id=tid, kind=kind, bytes=nbytes, dtype="bf16", shape=[nbytes // 2],
                        producer=producer, saved=saved,
                        forward_consumers=[c for c in consumers if c < phase_split],
                        backward_consumers=[c for c in consumers if c >= phase_split])


def _step(saved_middle: bool) -> tuple[list[OpRecord], list[TensorRecord], list[OpDetail]]:
    """x -> mul -> y -> add -> z -> matmul -> w (forward), then a mul of w in backward."""
    n = 64 << 20
    tensors = [_tensor(0, n, None, [0]), _tensor(1, n, 0, [1, 3] if saved_middle else [1],
                                                  saved=saved_middle),
               _tensor(2, n, 1, [2]), _tensor(3, n, 2, [3]), _tensor(4, n, 3, [])]
    io = [([0], [1], "memory"), ([1], [2], "memory"), ([2], [3], "matmul"),
          ([3, 1] if saved_middle else [3], [4], "memory")]
    ops, details = [], []
    for i, (ins, outs, category) in enumerate(io):
        ops.append(OpRecord(index=i, name="x", kind="x", phase="forward" if i < 3 else
                            "backward", module="", category=category, dtype="bf16",
                            flops=2e12 if category == "matmul" else 0,
                            bytes_read=n * len(ins), bytes_written=n * len(outs), time_s=0,
                            inputs=ins, outputs=outs))
        details.append(OpDetail(reads={t: n for t in ins}, writes={t: n for t in outs}))
    return ops, tensors, details


@pytest.mark.parametrize("saved_middle", [False, True])
def test_the_fused_stack_moves_only_what_enters_and_outlives_a_run(saved_middle: bool) -> None:
    """NOTE [stacks]: mul and add between two compute kernels are one kernel that reads x
    and writes z, and y only when autograd saves it; the matmul and the lone backward op
    are priced as in the eager stack."""
    ops, tensors, details = _step(saved_middle)
    eager_hw = load_hardware("a100-80gb")
    fused_hw = load_hardware("a100-80gb", overrides={"stack": "fused"})
    eager = step_times(ops, tensors, eager_hw, details)
    fused = step_times(ops, tensors, fused_hw, details)
    m, n = eager_hw.memory, 64 << 20

    def kernel(nbytes: int) -> float:
        return nbytes / (m.hbm_bandwidth * step_efficiency(m.bandwidth_efficiency, nbytes))

    assert eager[:2] == [pytest.approx(kernel(2 * n))] * 2
    moved = (3 if saved_middle else 2) * n
    assert fused[0] + fused[1] == pytest.approx(kernel(moved))
    assert fused[0] == pytest.approx(fused[1])  # shared as their eager times are
    assert fused[2:] == eager[2:] == [op_time(ops[2], eager_hw), op_time(ops[3], eager_hw)]
    assert step_times(ops, tensors, fused_hw) == eager  # no details: priced op by op


def _gemm(n: int, k: int = 1600, dtype: str = "bf16") -> tuple[OpRecord, list[TensorRecord]]:
    """mm of [8192, k] by [k, n], as the profiler records it: the output's shape and the
    FLOPs (the inputs do not matter here)."""
    flops = 2.0 * 8192 * n * k
    op = OpRecord(index=0, name="aten.mm.default", kind="mm", phase="forward", module="",
                  category="matmul", dtype=dtype, flops=flops, bytes_read=2 * 8192 * k,
                  bytes_written=2 * 8192 * n, time_s=0, inputs=[], outputs=[0])
    out = TensorRecord(id=0, kind="activation", bytes=2 * 8192 * n, dtype=dtype,
                       shape=[8192, n], producer=0)
    return op, [out]


def test_an_unaligned_gemm_runs_at_the_presets_figure_for_it() -> None:
    """NOTE [unaligned matmuls]: on the h200 preset gpt2's LM head (8192 x 50257 x 1600,
    bf16), or a GEMM whose K is odd, is capped at ``matmul_unaligned_efficiency``; the
    same GEMM with a vocabulary padded to 50304 or BERT's (30522, even: not measured), an
    fp32 one, and any GEMM on a preset without the figure are priced as before."""
    h200, a100 = load_hardware("h200"), load_hardware("a100-80gb")
    cap = h200.compute.matmul_unaligned_efficiency
    assert cap is not None and a100.compute.matmul_unaligned_efficiency is None
    head, tensors = _gemm(50257)
    assert unaligned(head, tensors) and unaligned(*_gemm(4096, k=1601))
    assert step_times([head], tensors, h200) == [pytest.approx(head.flops / (989e12 * cap))]
    assert step_times([head], tensors, h200)[0] > 5 * op_time(head, h200)
    for op, ts in (_gemm(50304), _gemm(30522), _gemm(50257, dtype="fp32")):
        assert not unaligned(op, ts)
        assert step_times([op], ts, h200) == [op_time(op, h200)]
    assert step_times([head], tensors, a100) == [op_time(head, a100)]
    assert "unaligned" not in a100.model_dump_json()  # unset: the preset's JSON is as it was


def _attention(category: str, seq: int, heads: int = 25, dim: int = 64,
               batch: int = 8) -> tuple[OpRecord, list[TensorRecord]]:
    """A causal fused attention kernel as the profiler records it: its first output is
    [batch, heads, seq, dim] (the output forward, the query's gradient backward)."""
    flops = 4.0 * batch * heads * seq * seq * dim / 2 * (2.5 if "backward" in category else 1)
    op = OpRecord(index=0, name="slackswap.fused_attention.default", kind="fused_attention",
                  phase="forward", module="", category=category, dtype="bf16", flops=flops,
                  bytes_read=4 * 2 * batch * heads * seq * dim, bytes_written=0, time_s=0,
                  inputs=[], outputs=[0])
    out = TensorRecord(id=0, kind="activation", bytes=2 * batch * heads * seq * dim,
                       dtype="bf16", shape=[batch, heads, seq, dim], producer=0)
    return op, [out]


def test_causal_attention_slows_as_its_sequence_shortens() -> None:
    """NOTE [causal attention by sequence]: on h200 a causal kernel at sequence S runs at
    its causal figure times g(S) / g(8192), g(S) = n / (n + 1 + 2c) with n = S / 128 key
    blocks; at 8192 tokens at the figure itself; non-causal kernels, and every kernel on a
    preset without the overhead, as before."""
    h200, h100 = load_hardware("h200"), load_hardware("h100-sxm")
    c = h200.compute
    assert c.attention_reference_seq == 8192 and h100.compute.attention_reference_seq is None
    for category, figure, overhead in (
            ("attention_forward", c.attention_causal_forward_efficiency,
             c.attention_causal_forward_overhead),
            ("attention_backward", c.attention_causal_backward_efficiency,
             c.attention_causal_backward_overhead)):
        assert figure is not None and overhead is not None
        for seq in (1024, 4096, 8192):
            op, tensors = _attention(category, seq)
            n = seq / 128
            scale = (n / (n + 1 + 2 * overhead)) / (64 / (65 + 2 * overhead))
            assert step_times([op], tensors, h200, [OpDetail(causal=True)]) == [
                pytest.approx(op.flops / (989e12 * figure * scale))]
            assert step_times([op], tensors, h100, [OpDetail(causal=True)]) == [
                op_time(op, h100, causal=True)]
            plain = step_times([op], tensors, h200, [OpDetail(causal=False)])
            assert plain == [op_time(op, h200)]  # the non-causal figure, at any sequence
        short = _attention(category, 1024)
        assert step_times([short[0]], short[1], h200, [OpDetail(causal=True)])[0] > (
            1.2 * op_time(short[0], h200, causal=True))
    assert "attention_reference_seq" not in h100.model_dump_json()  # unset: left out
    with pytest.raises(ValueError, match="attention_reference_seq"):
        type(c).model_validate({**c.model_dump(), "attention_reference_seq": None})


def _reduction(kind: str, read: int, written: int) -> OpRecord:
    return OpRecord(index=0, name=f"aten.{kind}.default", kind=kind, phase="backward",
                    module="", category="memory", dtype="bf16", flops=0, bytes_read=read,
                    bytes_written=written, time_s=0, inputs=[], outputs=[])


def test_reductions_read_at_the_presets_reduction_rate() -> None:
    """NOTE [reductions]: on h200 a sum, a mean or a LayerNorm moves its bytes at
    ``reduction_bandwidth_efficiency`` of HBM bandwidth, LayerNorm's backward reading its
    inputs twice; an elementwise op, and a reduction on a preset without the table, as
    before."""
    h200, a100 = load_hardware("h200"), load_hardware("a100-80gb")
    table = h200.memory.reduction_bandwidth_efficiency
    assert table == [(0, 0.3), (1e6, 0.316), (1e8, 0.405)]
    assert a100.memory.reduction_bandwidth_efficiency is None
    mb = 10**6
    column_sum = _reduction("sum", 40 * mb, 3200)
    assert op_time(column_sum, h200) == pytest.approx((40 * mb + 3200) / (4.8e12 * 0.316))
    norm_backward = _reduction("native_layer_norm_backward", 52 * mb, 26 * mb)
    assert op_time(norm_backward, h200) == pytest.approx(130 * mb / (4.8e12 * 0.405))
    norm = _reduction("native_layer_norm", 26 * mb, 26 * mb)
    assert op_time(norm, h200) == pytest.approx(52 * mb / (4.8e12 * 0.316))
    for op in (column_sum, norm_backward, norm):
        assert op_time(op, a100) == op_time(op.model_copy(update={"kind": "add"}), a100)
        assert op_time(op, h200) > 2 * op_time(op.model_copy(update={"kind": "add"}), h200)
    add = _reduction("add", 40 * mb, 20 * mb)
    assert op_time(add, h200) == pytest.approx(60 * mb / (4.8e12 * 0.75))


_ITEM = {"fp32": 4, "bf16": 2, "int64": 8}


def _one_op(kind: str, ins: list[tuple[list[int], str]], out: tuple[list[int], str]
            ) -> tuple[list[OpRecord], list[TensorRecord]]:
    """One memory-bound op reading tensors of ``ins`` (shape, dtype) and writing ``out``,
    its record counting each once."""
    tensors = []
    for shape, dtype in [*ins, out]:
        n = 1
        for d in shape:
            n *= d
        tensors.append(TensorRecord(id=len(tensors), kind="activation", bytes=n * _ITEM[dtype],
                                    dtype=dtype, shape=shape))
    op = OpRecord(index=0, name=f"aten.{kind}.default", kind=kind, phase="forward", module="",
                  category="memory", dtype=out[1], flops=0,
                  bytes_read=sum(t.bytes for t in tensors[:-1]), bytes_written=tensors[-1].bytes,
                  time_s=0, inputs=list(range(len(ins))), outputs=[len(ins)])
    return [op], tensors


def _elementwise_s(moved: float, hw_name: str = "h200") -> float:
    hw = load_hardware(hw_name)
    eff = step_efficiency(hw.memory.bandwidth_efficiency, moved)
    return max(moved / (hw.memory.hbm_bandwidth * eff), hw.compute.min_kernel_time_s)


def test_softmax_and_loss_kernels_move_their_passes() -> None:
    """NOTE [kernel passes]: a log-softmax over rows longer than 48 KiB reads its input
    three times, its backward the output's gradient twice; shorter rows once;
    ``nll_loss_forward`` reads one 32-byte sector a row and the targets,
    ``nll_loss_backward`` writes the gradient and reads the targets; on a preset without
    ``kernel_passes``, as recorded."""
    h200 = load_hardware("h200")
    logp = 8192 * 50257 * 4
    ops, ts = _one_op("_log_softmax", [([8192, 50257], "fp32")], ([8192, 50257], "fp32"))
    assert step_times(ops, ts, h200)[0] == pytest.approx(_elementwise_s(4 * logp))
    ops, ts = _one_op("_log_softmax", [([8192, 1024], "fp32")], ([8192, 1024], "fp32"))
    assert step_times(ops, ts, h200)[0] == pytest.approx(_elementwise_s(2 * 8192 * 1024 * 4))
    ops, ts = _one_op("_log_softmax_backward_data", [([8192, 50257], "fp32")] * 2,
                      ([8192, 50257], "fp32"))
    assert step_times(ops, ts, h200)[0] == pytest.approx(_elementwise_s(4 * logp))
    ops, ts = _one_op("nll_loss_forward", [([8192, 50257], "fp32"), ([8192], "int64")],
                      ([], "fp32"))
    assert step_times(ops, ts, h200)[0] == pytest.approx(_elementwise_s(8192 * 40 + 4))
    ops, ts = _one_op("nll_loss_backward", [([8192, 50257], "fp32"), ([8192], "int64")],
                      ([8192, 50257], "fp32"))
    assert step_times(ops, ts, h200)[0] == pytest.approx(_elementwise_s(8192 * 8 + logp))
    ops, ts = _one_op("_log_softmax", [([8192, 50257], "fp32")], ([8192, 50257], "fp32"))
    assert step_times(ops, ts, load_hardware("a100-80gb"))[0] == pytest.approx(
        _elementwise_s(2 * logp, "a100-80gb"))  # no kernel_passes: the record's bytes


def test_unvectorized_kernels_are_bound_by_elements() -> None:
    """NOTE [unvectorized kernels]: a bf16 to fp32 copy and a pointwise op with a broadcast
    operand write at most ``unvectorized_elements_per_s`` elements a second on h200; an
    fp32 to bf16 copy and an add without broadcast are priced by their bytes, and so is
    every op on a preset without the figure."""
    h200 = load_hardware("h200")
    rate = h200.memory.unvectorized_elements_per_s
    assert rate == 343e9 and load_hardware("a100-80gb").memory.unvectorized_elements_per_s is None
    n = 8192 * 50257
    up = _one_op("_to_copy", [([8192, 50257], "bf16")], ([8192, 50257], "fp32"))
    assert step_times(*up, h200)[0] == pytest.approx(n / rate)
    assert n / rate > 2 * _elementwise_s(6 * n)
    down = _one_op("_to_copy", [([8192, 50257], "fp32")], ([8192, 50257], "bf16"))
    assert step_times(*down, h200)[0] == pytest.approx(_elementwise_s(6 * n))
    m = 8 * 1024 * 1600
    bcast = _one_op("add", [([8, 1024, 1600], "bf16"), ([1, 1024, 1600], "bf16")],
                    ([8, 1024, 1600], "bf16"))
    assert step_times(*bcast, h200)[0] == pytest.approx(m / rate)
    assert step_times(*bcast, load_hardware("a100-80gb"))[0] == pytest.approx(
        _elementwise_s(bcast[0][0].bytes_read + bcast[0][0].bytes_written, "a100-80gb"))
    plain = _one_op("add", [([8, 1024, 1600], "bf16")] * 2, ([8, 1024, 1600], "bf16"))
    assert step_times(*plain, h200)[0] == pytest.approx(_elementwise_s(3 * 2 * m))


def test_dropout_is_bound_by_its_random_numbers() -> None:
    """NOTE [random kernels]: on h200 dropout's forward writes at most
    ``random_elements_per_s`` elements a second; its backward, and dropout on a preset
    without the figure, are priced by their bytes."""
    h200, a100 = load_hardware("h200"), load_hardware("a100-80gb")
    assert h200.memory.random_elements_per_s == 528e9
    assert a100.memory.random_elements_per_s is None
    m = 8 * 1024 * 1600
    ops, ts = _one_op("native_dropout", [([8, 1024, 1600], "bf16")], ([8, 1024, 1600], "bf16"))
    ops = [ops[0].model_copy(update={"random": True})]
    assert step_times(ops, ts, h200)[0] == pytest.approx(m / 528e9)
    assert m / 528e9 > _elementwise_s(ops[0].bytes_read + ops[0].bytes_written)
    assert step_times(ops, ts, a100)[0] == pytest.approx(
        _elementwise_s(ops[0].bytes_read + ops[0].bytes_written, "a100-80gb"))
    back = [ops[0].model_copy(update={"kind": "native_dropout_backward"})]
    assert step_times(back, ts, h200)[0] == pytest.approx(
        _elementwise_s(ops[0].bytes_read + ops[0].bytes_written))


def test_step_efficiency() -> None:
    table = [(0, 0.1), (10, 0.5), (100, 0.9)]
    assert [step_efficiency(table, s) for s in (0, 9, 10, 99, 100, 1e9)] == [
        0.1, 0.1, 0.5, 0.5, 0.9, 0.9]


# -- the node (NOTE [the node]) ----------------------------------------------------------


@pytest.mark.parametrize("name", sorted(NODES))
def test_a_node_preset_is_its_gpu_and_the_server_around_it(name: str) -> None:
    node, gpu = load_hardware(name), load_hardware(NODES[name])
    for section in ("compute", "memory", "host_link", "host"):
        assert getattr(node, section) == getattr(gpu, section), section
    assert gpu.sources.items() <= node.sources.items()  # the GPU's sources come along
    assert node.node is not None and node.node.gpus == 8 and gpu.node is None
    assert on_node(node, 1) is node


@pytest.mark.parametrize("gpus", [1, 2, 3, 4, 5, 8])
def test_ranks_share_the_links_and_the_host_memory_bandwidth(gpus: int) -> None:
    """dgx-a100: 4 PCIe switches of 2 GPUs each, 409.6 GB/s of DRAM; ranks are spread
    over the switches, so the busiest carries ceil(gpus / 4)."""
    one = load_hardware("dgx-a100")
    hw, link = on_node(one, gpus), one.host_link
    sharing = -(-gpus // 4)
    dram = 409.6e9 / gpus
    assert hw.ranks == gpus
    assert hw.host_link.d2h_bandwidth == pytest.approx(min(24.8e9 / sharing, dram))
    assert hw.host_link.h2d_bandwidth == pytest.approx(min(24.8e9 / sharing, dram))
    duplex = hw.host_link.duplex_d2h_bandwidth + hw.host_link.duplex_h2d_bandwidth
    assert duplex == pytest.approx(min(36e9 / sharing, dram))
    assert hw.host_link.duplex_d2h_bandwidth / hw.host_link.duplex_h2d_bandwidth == (
        pytest.approx(link.duplex_d2h_bandwidth / link.duplex_h2d_bandwidth))
    assert hw.compute == one.compute and hw.memory == one.memory
    assert load_hardware(hw.name) == hw  # a profile made on it names it so


def test_dram_caps_a_rank_whose_link_is_its_own() -> None:
    """dgx-h200: a PCIe 5.0 link per GPU, 563.2 GB/s of DRAM for 8: 70.4 GB/s each,
    below what both directions of one link carry at once."""
    link = load_hardware("h200").host_link
    assert link.d2h_bandwidth < 563.2e9 / 8 < link.duplex_d2h_bandwidth + link.duplex_h2d_bandwidth
    hw = on_node(load_hardware("dgx-h200"), 8)
    assert hw.host_link.d2h_bandwidth == link.d2h_bandwidth  # one direction fits the share
    assert (hw.host_link.duplex_d2h_bandwidth + hw.host_link.duplex_h2d_bandwidth
            == pytest.approx(563.2e9 / 8))


def test_gpus_need_a_node() -> None:
    with pytest.raises(InputError, match="describes one GPU, not a node.*dgx-a100"):
        on_node(load_hardware("a100-80gb"), 8)
    with pytest.raises(InputError, match="dgx-a100 has 8 GPUs, not 9"):
        on_node(load_hardware("dgx-a100"), 9)


def _llama_on_a_node():
    from slackswap.models import build_model, with_layers
    from slackswap.profiling import profile

    name = with_layers("llama-7b", 4)
    model, batch = build_model(name)
    return profile(model, batch, load_hardware("dgx-a100"), name=name)


def test_a_plan_for_one_gpu_stalls_on_a_full_node_and_one_for_the_node_does_not() -> None:
    """Eight ranks offloading at once get half a PCIe switch each: a plan made for one
    GPU leans on a link that is not there; planned for the node, it is not."""
    from slackswap.planners import plan_with_result
    from slackswap.sim import simulate

    prof = _llama_on_a_node()
    one, node = load_hardware("dgx-a100"), on_node(load_hardware("dgx-a100"), 8)
    for_one, alone = plan_with_result(prof, 0.7, one)
    on_node_result = simulate(prof, for_one, node, 0.7)
    for_node, planned = plan_with_result(prof, 0.7, node)
    def stalled(r):  # waiting on copies, not recomputing
        return sum(v for k, v in r.stall_s.items() if k != "recompute")

    assert alone.retention > 0.95 and planned.retention > 0.95
    assert on_node_result.retention < planned.retention - 0.1
    assert stalled(on_node_result) > 10 * stalled(planned)


@pytest.mark.heavy  # 9 s on two loaded cores
def test_the_host_memory_of_the_node_bounds_what_its_ranks_pin(tmp_path) -> None:
    from slackswap.planners import plan_with_result
    from slackswap.sim import simulate

    prof = _llama_on_a_node()
    plan, result = plan_with_result(prof, 0.5, on_node(load_hardware("dgx-a100"), 8))
    pinned = result.d2h_bytes
    assert pinned > 0
    text = (Path(load_hardware.__code__.co_filename).parent.parent / "hardware" / "presets"
            / "dgx-a100.toml").read_text()
    small = tmp_path / "small.toml"  # host memory for 7 ranks' pinned bytes, not 8
    small.write_text(text.replace("host_memory_bytes = 2199023255552",
                                  f"host_memory_bytes = {7 * pinned}"))
    node = on_node(load_hardware(small), 8)
    refused = simulate(prof, plan, node, 0.5)
    assert not refused.feasible and refused.retention == 0
    assert refused.infeasible_reason.startswith("host memory: 8 ranks pin")
    assert simulate(prof, plan, on_node(load_hardware(small), 7), 0.5).feasible
