"""The runtime's asynchronous (CUDA) branch on a CPU, with stand-ins at the device calls
(NOTE [stand-ins for the device calls]): exact as the synchronous branch, and the host
work it does per saved tensor and per watched op counted, not timed
(``benchmarks/host_work.py`` predicts the time from these counts; "A hot path the GPU
never waits for")."""

from __future__ import annotations

import functools
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from test_runtime import assert_identical, assert_runs_as_simulated, planned_step, setup

import slackswap
from slackswap.core.offloads import offload_issues
from slackswap.runtime.streams import bytes_of, stand_ins
from slackswap.sim.schedule import build_schedule

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
from host_work import (  # noqa: E402
    CheapOps,
    cheap_ops,
    keeping,
    meta_workload,
    one_step,
    read_costs,
    steps_counted,
)

POLICIES = ["behind", "done"]


def _workload(budget: float, strategy: str) -> tuple:
    """Two layers of gpt2-xl on the meta device, planned for the H200: a model of its own,
    the plan from the test run's plan cache (the tests here plan each budget and strategy
    several times over; the slackswap plan took 2-3 s each), a plan object of its own
    (its pool of host buffers too: NOTE [plan cache])."""
    return meta_workload("gpt2-xl", 2, budget, strategy, cached=True)


def _asynchronous_cases() -> list:
    """Every model under each strategy. SlackSwap's plans at 0.6 keep some activations
    and offload the rest, with a prefetch point each: the offload-only plans of the same
    models offload those and more, each at its prefetch point, on the same branch. The
    default run takes SlackSwap's plan on DistilBERT (its search the shortest: 3 s;
    GPT-2's and Llama's 6-9 s, most of their cells) and the other strategies on all
    three; ``pytest -m heavy`` SlackSwap's on GPT-2 and Llama."""
    return [pytest.param(name, strategy, marks=pytest.mark.heavy)
            if strategy == "slackswap" and name != "distilbert-mlm-tiny" else (name, strategy)
            for name in ["gpt2-xl-tiny", "llama-7b-tiny", "distilbert-mlm-tiny"]
            for strategy in ["slackswap", "offload-only", "checkpoint-offload"]]


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize(("name", "strategy"), _asynchronous_cases())
def test_the_asynchronous_branch_is_exact_on_a_cpu(name: str, strategy: str,
                                                   policy: str) -> None:
    """Copies on side streams, events, deadlines and the pool, run on real CPU tensors:
    the same gradients, bit for bit, as the synchronous branch, and the work the
    simulator scheduled. ``behind`` makes every reload a stall and every deadline a
    wait; ``done`` never waits."""
    profile, model, batch, _, _ = setup(name)
    # both policies run one plan: made once per test run (NOTE [plan cache])
    plan = slackswap.plan(profile, 0.6, strategy=strategy, cached=True)
    expected = planned_step(model, batch, plan, profile)[0]
    calls: Counter = Counter()
    with stand_ins(calls, policy):
        got, runtime = planned_step(model, batch, plan, profile)
    assert_identical(got, expected)
    assert_runs_as_simulated(profile, plan, runtime.stats)
    assert calls["copy"] > 0  # it took the asynchronous branch
    if policy == "done":
        assert runtime.stats.stalls == runtime.stats.offload_waits == 0


@pytest.mark.parametrize("policy", POLICIES)
def test_an_offload_copies_the_storage_bytes_whatever_the_view(policy: str) -> None:
    """NOTE [a tensor's copy, not its storage's]: the host copy is the storage's bytes,
    whether copied as the tensor (a whole contiguous storage) or as the bytes under it (a
    slice, a conjugate or negative view, whose copy as itself would resolve the bit)."""
    from slackswap.runtime.copies import HostCopies
    from slackswap.runtime.stats import RuntimeStats

    z = torch.randn(64, 32, dtype=torch.complex64, generator=torch.Generator().manual_seed(0))
    views = {"whole": z, "conj": z.conj(), "neg": z.conj().imag, "slice": z[3:40],
             "transposed": z.t()}
    calls: Counter = Counter()
    with stand_ins(calls, policy):
        copies = HostCopies()
        for label, t in views.items():
            host = copies.offload(t, RuntimeStats())
            raw = torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage())
            assert torch.equal(bytes_of(host), raw), label
            # laid out as what it copies: the tensor, or its storage's bytes
            assert host.dtype == (z.dtype if label == "whole" else torch.uint8), label
    assert calls["copy"] == len(views) and calls["byte_view"] == len(views) - 1
    assert calls["copy_storage"] == 0  # a storage's own copy is four times a tensor's


@functools.cache
def _counted(strategy: str, budget: float, policy: str = "behind") -> dict:
    """Two layers of gpt2-xl on the meta device, planned for the H200: one warm step,
    then the counts of the next."""
    net, batch, plan, profile = _workload(budget, strategy)
    with steps_counted(policy) as links:  # NOTE [links kept across steps]
        one_step(net, batch, plan, profile, policy, links=links)
        return one_step(net, batch, plan, profile, policy, links=links)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize(("strategy", "budget"), [("slackswap", 0.9), ("offload-only", 0.9),
                                                  ("recompute-only", 0.9),
                                                  ("slackswap", 1.0)])
def test_host_work_per_saved_tensor(strategy: str, budget: float, policy: str) -> None:
    """Per group of offloads (NOTE [offloads issued in groups]): one wait for
    the compute stream, one stream switch and one event, and a copy per offload, no poll
    (each offload goes at its deadline); per reload a poll, the same and a device
    buffer; per stall and per rebuild a pair of timing
    events; the streams resolved once per block, and nothing per pack or per watched op
    (NOTE [streams resolved once per block])."""
    step = _counted(strategy, budget, policy)
    groups = _groups(strategy, budget)
    forward, backward, stats = Counter(step["forward"]), Counter(step["backward"]), step["stats"]
    offloads = forward["copy"]
    reloads = backward["copy"]
    assert offloads == reloads == stats["prefetched"] + stats["late_reloads"]
    if strategy == "slackswap" and budget == 1.0:
        # nothing moved: no device call but resolving the compute stream
        assert set(forward) == {"current_stream"} and not backward
        return
    assert forward["current_stream"] <= 2 and backward["current_stream"] == 0
    # forward polls only for offloads with no deadline: with a profile, none
    assert forward["stream_switch"] == groups and forward["poll"] == 0
    assert backward["poll"] == backward["stream_switch"] == backward["device_empty"] == reloads
    # a group: the compute marker and its own event; a wait only at a deadline
    assert forward["event_record"] == 2 * groups
    assert forward["new_event"] == groups
    rebuilds = stats["recomputed_ops"] and backward["new_event"] - reloads - 2 * stats["stalls"]
    assert rebuilds % 2 == 0 and rebuilds <= 2 * stats["recomputed_ops"]
    assert backward["event_record"] == 2 * reloads + 2 * stats["stalls"] + rebuilds
    # waits: a copy's side stream for the compute marker; a reload's for its offload's
    # copy and the compute stream for the reload, each unless seen done already; the
    # compute stream for an offload that reached its deadline unfinished
    waits = forward["wait_event"] + backward["wait_event"]
    base = groups + reloads + stats["offload_waits"]
    assert base <= waits <= base + 2 * reloads
    # a deadline asks about its group's copy once
    assert forward["event_query"] <= groups
    if policy == "behind":  # the compute stream waits for a group at most once
        assert stats["stalls"] == reloads and stats["offload_waits"] <= groups
        assert stats["offload_waits"] > 0 or not groups
    else:
        assert stats["stalls"] == stats["offload_waits"] == 0


@functools.cache
def _groups(strategy: str, budget: float) -> int:
    """Groups of offloads the profile's packs make (NOTE [offloads issued in groups])."""
    _, _, plan, profile = _workload(budget, strategy)
    offloaded = {c.tensor for c in build_schedule(profile, plan).d2h}
    return len(set(offload_issues(profile, offloaded).values()))


def test_each_step_counts_the_device_calls_it_made() -> None:
    """NOTE [links kept across steps]: with the links kept from step to step, as on a
    GPU, the compute stream is resolved once a block, and an event a step waits for
    is counted in that step, wherever it was recorded: two repeated steps count alike,
    and a host buffer's wait for its last copy (an event of the step before) is the
    later step's."""
    net, batch, plan, profile = _workload(0.9, "offload-only")
    with steps_counted("behind") as links:
        one_step(net, batch, plan, profile, links=links)
        second = one_step(net, batch, plan, profile, links=links)
        third = one_step(net, batch, plan, profile, links=links)
    assert second["forward"] == third["forward"] and second["backward"] == third["backward"]
    assert second["forward"]["current_stream"] == 1
    # the pool hands out buffers whose copies (the last backward's reloads) it waits for
    assert second["forward"].get("event_synchronize", 0) > 0
    alone = one_step(net, batch, plan, profile)  # a link of its own: that wait is not its
    assert alone["forward"].get("event_synchronize", 0) == 0


@pytest.mark.parametrize("kind", ["offload", "recompute"])
def test_a_plan_with_one_kind_of_decision_kept_does_none_of_it(kind: str) -> None:
    """``--keep``: the plan's offloads (or rebuilds) kept, what the other kind costs the
    host alone: no copy (or no watched op) in the step, the same packs."""
    net, batch, plan, profile = _workload(0.9, f"{kind}-only")
    kept = keeping(plan, kind)
    assert kind in {d.value for d in plan.decisions.values()}
    assert kind not in {d.value for d in kept.decisions.values()}
    one_step(net, batch, kept, profile)
    step = one_step(net, batch, kept, profile)
    assert step["forward"].get("copy", 0) == 0 and not step["watched_ops"]
    assert step["packs"] == len(profile.saves)


def test_offloads_packed_before_one_op_are_issued_together() -> None:
    """The offload-only plan's saves come several before one op (an op's inputs, a
    module's outputs): fewer groups than offloads."""
    step = _counted("offload-only", 0.9)
    offloads = step["forward"]["copy"]
    assert 0 < _groups("offload-only", 0.9) < offloads


def test_ops_at_a_gpu_hosts_cost_leave_the_runtimes_work_as_it_was() -> None:
    """NOTE [ops at a GPU host's cost]: with the meta kernels' outputs handed out by
    geometry, the planned step does the same work, call for call (the same packs,
    watched ops, rebuilds and device calls); and an op's output made again is a new
    storage of the first call's geometry, as the op makes it."""
    for strategy in ("slackswap", "recompute-only"):  # offloads; rebuilds
        net, batch, plan, profile = _workload(0.9, strategy)
        one_step(net, batch, plan, profile)
        counted = one_step(net, batch, plan, profile)
        with cheap_ops():
            one_step(net, batch, plan, profile)
            cheap = one_step(net, batch, plan, profile)
        assert counted["forward"]["copy"] if strategy == "slackswap" else counted["watched_ops"]
        for key in ("forward", "backward", "packs", "watched_ops", "stats"):
            assert cheap[key] == counted[key], (strategy, key)
    x = torch.empty(4, 6, device="meta")
    with CheapOps() as mode:
        a, b = torch.mm(x, x.T), torch.mm(x, x.T)
        view = x.t()
    assert len(mode.seen) == 1 and a.untyped_storage()._cdata != b.untyped_storage()._cdata
    assert (b.shape, b.stride(), b.dtype) == (a.shape, a.stride(), a.dtype) == ((4, 4), (4, 1),
                                                                              torch.float32)
    assert view.untyped_storage()._cdata == x.untyped_storage()._cdata  # views run as they are


def test_the_counts_are_of_the_step_the_gpu_runs() -> None:
    """The benchmark's step is its profile's: the plan is applied as on the GPU, packs
    named from the profile, the watch sparse, the whole forward seen."""
    step = _counted("slackswap", 0.9)
    net, batch, plan, profile = _workload(0.9, "slackswap")
    assert step["packs"] == len(profile.saves)
    assert step["stats"]["offloaded_bytes"] == slackswap.simulate(profile, plan).d2h_bytes
    # on the h200 the slackswap plan of this small step offloads only: the watch of a plan
    # that recomputes
    rebuilt = _counted("recompute-only", 0.9)
    assert rebuilt["packs"] == len(profile.saves)
    assert 0 < rebuilt["watched_ops"] < sum(op.phase == "forward" for op in profile.ops)
    assert all(p.device.type == "meta" for p in net.parameters())
    assert torch.is_grad_enabled()


def test_a_repeated_step_lays_out_no_host_buffer_again(monkeypatch) -> None:
    """NOTE [host copies laid out as their tensors]: the pool hands each offload of a
    repeated step a buffer already laid out as its tensor: no view per copy."""
    import slackswap.runtime.copies as copies_module

    net, batch, plan, profile = _workload(0.9, "offload-only")
    one_step(net, batch, plan, profile)
    laid: list[torch.Size] = []
    original = copies_module.laid_as

    def counted(buffer: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        laid.append(like.shape)
        return original(buffer, like)

    monkeypatch.setattr(copies_module, "laid_as", counted)
    step = one_step(net, batch, plan, profile)
    assert step["forward"]["copy"] > 0
    assert step["stats"]["host_buffers_allocated"] == 0 and laid == []


@pytest.mark.parametrize("content", [None, b"[1]", b'{"machine": "x"}',
                                     b'{"machine": "x", "costs_us": {"copy": NaN}}',
                                     b'{"machine": "x", "costs_us": {"copy": "1"}}'])
def test_a_costs_file_that_is_none_is_refused_in_one_line(tmp_path, content) -> None:
    """NOTE [files]: ``--costs`` was read whole (a FIFO waited on, /dev/zero read without
    end) after the measurement, and a file without ``costs_us`` was a KeyError; it is
    read first now, as every file is, and checked."""
    import os

    path = tmp_path / "costs.json"
    if content is None:
        os.mkfifo(path)
    else:
        path.write_bytes(content)
    with pytest.raises(slackswap.InputError) as caught:
        read_costs(path)
    assert "\n" not in str(caught.value)
    shipped = read_costs(Path(__file__).parents[1] / "benchmarks" / "host_costs_h200.json")
    assert shipped["costs_us"]


def test_the_harness_wrapper_is_not_counted_as_the_runtimes_work() -> None:
    """NOTE [ops at a GPU host's cost]: the wrapper that hides the pack from CheapOps
    costs this machine about a microsecond a call; the prediction takes it off forward's
    Python once per pack, and nothing off backward's."""
    from host_work import harness_cost_s, predict

    cost = harness_cost_s(2000)
    assert 0 < cost < 50e-6
    result = {"forward_s": 0.030, "plain_forward_s": 0.010, "backward_s": 0.050,
              "plain_backward_s": 0.020, "forward": {"copy": 10}, "backward": {},
              "harness_s": 300 * cost}
    out = predict(result, {"copy": 15.0})
    assert out["forward_python_ms"] == pytest.approx(20.0 - 300e3 * cost)
    assert out["forward_calls_ms"] == pytest.approx(0.15)
    assert out["backward_python_ms"] == pytest.approx(30.0)
    without = predict({**result, "harness_s": 0.0}, {"copy": 15.0})
    assert without["forward_python_ms"] == pytest.approx(20.0)
