"""The runtime's CUDA path: pinned host buffers, side-stream copies, prefetch, RNG replay.

Skipped without a CUDA GPU. Plans come from measured profiles of the same device, so ids
name the kernels that really run. Deterministic algorithms are on, and a plain run is
checked against itself first: ``torch.equal`` against the runtime means something only
when the step itself repeats exactly.
"""

from __future__ import annotations

import os

import pytest
import torch

import slackswap
from slackswap.core.plan import MIN_PLANNED_BYTES, Plan
from slackswap.models import build_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
MODELS = ["bert-large-tiny", "gpt2-xl-tiny", "llama-7b-tiny"]


@pytest.fixture(scope="module", autouse=True)
def deterministic():
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    yield
    torch.use_deterministic_algorithms(False)


def step(model, batch, plan=None, profile=None, seed=0):
    torch.manual_seed(seed)
    model.zero_grad(set_to_none=True)
    runtime = None
    if plan is None:
        loss = model(**batch).loss
    else:
        runtime = slackswap.apply(model, plan, profile=profile)
        with runtime:
            loss = model(**batch).loss
    loss.backward()
    torch.cuda.synchronize()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return (loss.detach(), grads), runtime


def identical(a, b) -> bool:
    return torch.equal(a[0], b[0]) and all(torch.equal(a[1][n], b[1][n]) for n in a[1])


def setup(name: str, **shape):
    model, batch = build_model(name, fake=False, dtype="fp32", device="cuda", **shape)
    profile = slackswap.profile(model, batch, "h200", mode="measured", name=name)
    names = [t.name for t in profile.saved_activations
             if t.producer is not None and t.bytes >= MIN_PLANNED_BYTES]
    reference, _ = step(model, batch)
    assert identical(step(model, batch)[0], reference), "the plain step does not repeat"
    return model, batch, profile, names, reference


@pytest.mark.parametrize("name", MODELS)
def test_plans_are_bit_identical_on_cuda(name: str) -> None:
    model, batch, profile, names, reference = setup(name)
    first_backward = next(op.index for op in profile.ops if op.phase == "backward")
    plans = [
        Plan(fingerprint=profile.fingerprint, strategy="offload", prefetch={},
             decisions={n: "offload" for n in names}),
        Plan(fingerprint=profile.fingerprint, strategy="offload-prefetched",
             decisions={n: "offload" for n in names},
             prefetch={n: first_backward for n in names}),
        Plan(fingerprint=profile.fingerprint, strategy="recompute",
             decisions={n: "recompute" for n in names}),
        Plan(fingerprint=profile.fingerprint, strategy="mixed",
             decisions={n: ("keep", "offload", "recompute")[i % 3] for i, n in enumerate(names)}),
        # rebuilds read inputs whose prefetched reloads may still be in flight
        Plan(fingerprint=profile.fingerprint, strategy="mixed-prefetched",
             decisions={n: ("offload", "recompute")[i % 2] for i, n in enumerate(names)},
             prefetch={n: first_backward for i, n in enumerate(names) if i % 2 == 0}),
    ]
    for plan in plans:
        result, runtime = step(model, batch, plan, profile)
        assert identical(result, reference), plan.strategy
        if "offload" in plan.decisions.values():
            assert runtime.stats.reloaded_bytes == runtime.stats.offloaded_bytes > 0
        if plan.prefetch:
            assert runtime.stats.prefetched > 0 and runtime.stats.late_reloads == 0


def test_host_copies_are_pinned_and_released() -> None:
    model, batch, profile, names, _ = setup("gpt2-xl-tiny")
    plan = Plan(fingerprint=profile.fingerprint, strategy="offload",
                decisions={n: "offload" for n in names})
    runtime = slackswap.apply(model, plan, profile=profile)
    torch.manual_seed(0)
    with runtime:
        loss = model(**batch).loss
    assert runtime.values.host and all(h.is_pinned() for h in runtime.values.host.values())
    loss.backward()
    assert runtime.values.host == {} and runtime.values.back == {}
    assert runtime.stats.resident_bytes == 0


def test_repeated_steps_hold_no_device_memory() -> None:
    model, batch, profile, names, _ = setup("llama-7b-tiny")
    plan = Plan(fingerprint=profile.fingerprint, strategy="x",
                decisions={n: ("offload", "recompute")[i % 2] for i, n in enumerate(names)})
    step(model, batch, plan, profile)
    step(model, batch, plan, profile)
    baseline = torch.cuda.memory_allocated()
    reserved = torch.cuda.memory_reserved()
    for _ in range(50):
        _, runtime = step(model, batch, plan, profile)
        # NOTE [buffers held by events]: pinned buffers come from the pool after step one
        assert runtime.stats.host_buffers_allocated == 0
    assert torch.cuda.memory_allocated() == baseline
    assert torch.cuda.memory_reserved() == reserved  # the caching allocator did not grow


def test_offloading_lowers_the_device_peak() -> None:
    """Offloaded activations leave the device during forward: less is allocated when
    forward ends, and the step's peak is no higher (a tiny model's peak can sit in the
    loss's backward, which offloading does not touch)."""
    model, batch, profile, names, _ = setup("gpt2-xl-tiny")

    def memory(plan) -> tuple[int, int]:
        step(model, batch)  # warm the allocator
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        model.zero_grad(set_to_none=True)
        with slackswap.apply(model, plan, profile=profile):
            loss = model(**batch).loss
        torch.cuda.synchronize()
        held = torch.cuda.memory_allocated() - before
        loss.backward()
        torch.cuda.synchronize()
        return held, torch.cuda.max_memory_allocated() - before

    keep = memory(Plan.keep_all(profile))
    offload = memory(Plan(fingerprint=profile.fingerprint, strategy="offload",
                          decisions={n: "offload" for n in names}))
    figures = f"keep-all (after forward, peak) {keep}, all-offload {offload}"
    assert offload[0] < keep[0], figures
    assert offload[1] <= keep[1], figures


@pytest.mark.parametrize("name", ["gpt2-xl-tiny", "llama-7b-tiny"])
def test_a_plan_traced_on_a_cpu_runs_on_the_gpu(name: str) -> None:
    """The analytic profile (fake tensors, CUDA kernel semantics, no GPU) names what the
    GPU really runs: its plan applies to the real step, bit-identical, in bf16."""
    fake, batch = build_model(name, fake=True, dtype="bf16")
    profile = slackswap.profile(fake, batch, "h200", kernels="cuda", name=name)
    model, batch = build_model(name, fake=False, dtype="bf16", device="cuda")
    names = [t.name for t in profile.saved_activations
             if t.producer is not None and t.bytes >= MIN_PLANNED_BYTES]
    reference, _ = step(model, batch)
    assert identical(step(model, batch)[0], reference), "the plain step does not repeat"
    plan = Plan(fingerprint=profile.fingerprint, strategy="mixed",
                decisions={n: ("offload", "recompute")[i % 2] for i, n in enumerate(names)})
    result, runtime = step(model, batch, plan, profile)
    assert identical(result, reference)
    assert runtime.stats.offloaded_bytes > 0 and runtime.stats.recomputed_ops > 0


def test_offloads_free_where_simulated_however_far_the_host_runs_ahead() -> None:
    """NOTE [offloads free where simulated]: with the GPU held back by a sleep kernel, the
    host issues the whole step far ahead of it, and the caching allocator (which counts
    in issue order) still peaks where the simulated step does, not near keep-all."""
    model, batch, profile, names, reference = setup("gpt2-xl-tiny", seq=512)
    plan = Plan(fingerprint=profile.fingerprint, strategy="offload",
                decisions={n: "offload" for n in names})
    simulated = slackswap.simulate(profile, plan, "h200")
    assert simulated.peak_bytes < 0.8 * profile.keep_all_peak  # offloading matters here
    first = model.transformer.h[0]
    hook = first.register_forward_pre_hook(lambda *_: torch.cuda._sleep(100_000_000))
    try:
        step(model, batch, plan, profile)  # warm-up: gradients exist from here on
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        result, runtime = step(model, batch, plan, profile)
        peak = torch.cuda.max_memory_allocated() - before
    finally:
        hook.remove()
    assert identical(result, reference)
    assert runtime.stats.offload_waits > 0  # the host was ahead: copies were waited for
    assert peak <= 1.02 * simulated.peak_bytes + (1 << 20), (peak, simulated.peak_bytes)


def test_budget_fit_reads_the_device_memory() -> None:
    """On a GPU, ``budget="fit"`` starts from the device's own memory
    (``torch.cuda.mem_get_info``), not the hardware preset's."""
    from slackswap.device_budget import RESERVE, device_budget

    model, batch, *_ = setup("gpt2-xl-tiny")
    chosen = slackswap.plan(model, batch, budget="fit")
    total = torch.cuda.mem_get_info()[1]
    states = device_budget(chosen._profile, slackswap.load_hardware("a100-80gb")).model_states
    assert chosen.budget_bytes == total - states - sum(n for n, _, _ in RESERVE.values())


def test_probe_runs_the_fit_plan() -> None:
    """``--probe``: real AdamW steps under the ``budget="fit"`` plan run, and the device's
    peak stays within its memory."""
    from slackswap.runtime.probe import probe

    found = probe("gpt2-xl-tiny", None, "slackswap")
    assert found.tries == 1 and 0 < found.peak_allocated <= found.peak_reserved
    assert found.peak_reserved <= found.capacity
    assert "AdamW steps on" in found.lines()[0]
