"""What docs/paper-gap.md's rows are made with: hardware overrides (`--set`), the
`bert-large-mlm` preset and the budget's reference peak."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from slackswap.cli import main
from slackswap.core.hardware import load_hardware, parse_overrides
from slackswap.errors import InputError
from slackswap.models import MODEL_PRESETS, build_model
from slackswap.profiling import profile
from slackswap.reproduce import cached_profile, loss_ops, reference_peak


def test_override_changes_the_value_and_the_name() -> None:
    hw = load_hardware("a100-80gb", {"host_link.duplex_h2d_bandwidth": 24.8e9})
    assert hw.host_link.duplex_h2d_bandwidth == 24.8e9
    assert hw.name == "a100-80gb+1 override"
    assert "overridden" in hw.sources["host_link.duplex_h2d_bandwidth"]
    assert load_hardware("a100-80gb").host_link.duplex_h2d_bandwidth == 12e9  # preset intact
    two = load_hardware("a100-80gb", {"compute.peak_flops.bf16": 300e12,
                                      "memory.bandwidth_efficiency": [[0, 1.0]]})
    assert two.name == "a100-80gb+2 overrides"
    assert two.peak("bf16") == 300e12 and two.memory.bandwidth_efficiency == [(0.0, 1.0)]
    assert load_hardware("a100-80gb", {}) == load_hardware("a100-80gb")


@pytest.mark.parametrize(("overrides", "message"), [
    ({"host_link.nope": 1.0}, "unknown hardware field 'host_link.nope'; host_link has kind"),
    ({"gpu.speed": 1.0}, "unknown hardware field 'gpu.speed'"),
    ({"compute": 1.0}, "unknown hardware field 'compute'"),
    ({"compute.peak_flops.int8": 1.0}, "compute.peak_flops has fp32"),
    ({"node.gpus": 2}, "unknown hardware field 'node.gpus'"),  # a GPU preset has no node
    ({"host_link.h2d_bandwidth": -1.0}, "host_link.h2d_bandwidth=-1.0: Input should be greater"),
    ({"compute.matmul_efficiency_cap": 1.5}, "matmul_efficiency_cap=1.5: Input should be less"),
    ({"memory.bandwidth_efficiency": [[1, 1.0]]}, "rows must start at threshold 0"),
    ({"host.dispatch_s": "fast"}, "host.dispatch_s='fast': Input should be a valid number"),
])
def test_bad_override_is_one_line(overrides: dict, message: str) -> None:
    with pytest.raises(InputError, match=message.replace("[", r"\[").replace("(", r"\(")) as e:
        load_hardware("a100-80gb", overrides)
    assert "\n" not in str(e.value)


def test_parse_overrides() -> None:
    assert parse_overrides(["a.b=24.8e9", "c.d=[[0, 1.0]]", "e.f=pcie5", "g.h = 2 "]) == {
        "a.b": 24.8e9, "c.d": [[0, 1.0]], "e.f": "pcie5", "g.h": 2}
    with pytest.raises(InputError, match="expected KEY=VALUE"):
        parse_overrides(["host_link.h2d_bandwidth"])


def test_an_overridden_name_says_how_to_load_it() -> None:
    with pytest.raises(InputError, match="pass --hardware a100-80gb and the same --set"):
        load_hardware("a100-80gb+1 override")


def test_cached_profiles_keep_overrides_apart(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("SLACKSWAP_CACHE", str(tmp_path))
    plain = cached_profile("gpt2-xl-tiny", load_hardware("a100-80gb"))
    slow = cached_profile("gpt2-xl-tiny", load_hardware(
        "a100-80gb", {"compute.min_kernel_time_s": 1e-5}))  # a tiny step's kernels all pay it
    assert slow.hardware == "a100-80gb+1 override"
    assert sum(op.time_s for op in slow.ops) > sum(op.time_s for op in plain.ops)
    assert len(list((tmp_path / "profiles").iterdir())) == 2


def test_a_changed_profiler_never_reuses_a_cached_profile(tmp_path, monkeypatch) -> None:
    """The cache key covers the profiler's source: an edited cost model in a checkout
    whose version did not move makes a new profile, not a stale one."""
    import slackswap.reproduce as reproduce

    monkeypatch.setenv("SLACKSWAP_CACHE", str(tmp_path))
    hw = load_hardware("a100-80gb")
    cached_profile("gpt2-xl-tiny", hw)
    cached_profile("gpt2-xl-tiny", hw)
    assert len(list((tmp_path / "profiles").iterdir())) == 1
    monkeypatch.setattr(reproduce, "_profiler_digest", lambda: "edited")
    cached_profile("gpt2-xl-tiny", hw)
    assert len(list((tmp_path / "profiles").iterdir())) == 2


def _by_layer(name: str) -> tuple:
    model, batch = build_model(name)
    p = profile(model, batch, "a100-80gb", name=name)
    head = sum(t.bytes for t in p.saved_activations
               if t.producer is not None and p.layer_index(p.ops[t.producer].module) is None
               and not p.ops[t.producer].module.startswith("bert."))
    layers = {}
    for t in p.saved_activations:
        if t.producer is not None and (i := p.layer_index(p.ops[t.producer].module)) is not None:
            layers.setdefault(i, []).append((t.name, t.bytes))
    return p, head, layers, model


def test_mlm_preset_saves_fewer_head_activations_with_the_same_encoder() -> None:
    assert MODEL_PRESETS["bert-large-mlm"].predictions == 80
    assert MODEL_PRESETS["bert-large-mlm-tiny"].predictions == 5
    full, full_head, full_layers, full_model = _by_layer("bert-large-tiny")
    mlm, mlm_head, mlm_layers, mlm_model = _by_layer("bert-large-mlm-tiny")
    # the same encoder: the same parameters, and every block but the last saves the same
    assert ({n: p.shape for n, p in full_model.named_parameters()}
            == {n: p.shape for n, p in mlm_model.named_parameters()})
    assert full.layers == mlm.layers
    assert full_layers[0] == mlm_layers[0]
    # the last block's output is no longer saved by the head's first matmul: it gathers first
    assert sum(b for _, b in mlm_layers[1]) < sum(b for _, b in full_layers[1])
    assert mlm_head < full_head / 4  # 5 of 32 positions
    logits = next(t for t in mlm.tensors if t.producer is not None
                  and mlm.ops[t.producer].module == "cls.predictions.decoder"
                  and mlm.ops[t.producer].phase == "forward")
    batch, predictions, vocab = 2, 5, MODEL_PRESETS["bert-large-mlm-tiny"].vocab
    assert logits.shape == [batch * predictions, vocab]
    assert mlm.keep_all_peak < full.keep_all_peak


def test_reference_peak_outside_the_loss() -> None:
    model, batch = build_model("gpt2-xl-tiny")
    p = profile(model, batch, "a100-80gb")
    loss = loss_ops(p)
    kinds = [p.ops[i].kind for i in loss]
    assert "_log_softmax" in kinds and "_log_softmax_backward_data" in kinds
    assert all(p.ops[i].module == "" for i in loss)
    assert p.ops[loss.start - 1].module == "lm_head"  # the run stops at the model's own ops
    assert reference_peak(p) == p.keep_all_peak
    assert 0 < reference_peak(p, "outside-loss") < p.keep_all_peak
    with pytest.raises(InputError, match="unknown reference 'x'"):
        reference_peak(p, "x")


def _run(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, list(args))
    return result.exit_code, result.stdout, result.stderr


def test_cli_set_on_simulate(tmp_path) -> None:
    prof = tmp_path / "p.json"
    assert _run("profile", "gpt2-xl-tiny", "-o", str(prof))[0] == 0
    code, out, _ = _run("simulate", str(prof), "--json")
    assert code == 0
    code, slow, _ = _run("simulate", str(prof), "--json", "--set", "host.dispatch_s=1e-3",
                         "--set", "compute.min_kernel_time_s=2e-6")
    assert code == 0
    assert json.loads(slow)["step_time_s"] > json.loads(out)["step_time_s"] + 0.01
    code, _, err = _run("simulate", str(prof), "--set", "host_link.nope=1")
    assert code == 2
    assert err.strip() == ("error: unknown hardware field 'host_link.nope'; host_link has "
                           "kind, d2h_bandwidth, h2d_bandwidth, duplex_d2h_bandwidth, "
                           "duplex_h2d_bandwidth, latency_s, stream")
    code, _, err = _run("simulate", str(prof), "--set", "oops")
    assert code == 2 and "expected KEY=VALUE" in err


def test_cli_set_and_reference_on_reproduce(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("SLACKSWAP_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "out"
    code, _, err = _run("reproduce", "--workloads", "bert-large-mlm-tiny", "--budget", "0.9",
                        "--set", "host_link.duplex_h2d_bandwidth=24.8e9",
                        "--reference", "outside-loss", "--out", str(out))
    assert code == 0, err
    results = json.loads((out / "results.json").read_text())
    assert results["hardware"] == "a100-80gb+1 override"
    assert results["reference"] == "outside-loss"
    entry = results["workloads"][0]
    assert entry["reference_peak_bytes"] < entry["keep_all_peak_bytes"]
    assert entry["budget_bytes"] == int(0.9 * entry["reference_peak_bytes"])
    assert "outside the loss" in (out / "report.md").read_text()
