"""Across processes (gloo, CPU): FSDP2 and DDP training under plans is bit-identical to the
same distributed training without SlackSwap, and all ranks run one plan. Models: three
tiny presets, a GPT-NeoX that is not one, and a batch-norm CNN (each convolution its own
FSDP2 unit)."""

from __future__ import annotations

import contextlib
import copy
import faulthandler
import gc
import queue
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import slackswap
from slackswap.core.plan import Plan
from slackswap.errors import InputError
from slackswap.models import build_model
from slackswap.profiling.step import transformer_blocks

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="needs torch.distributed with gloo")

STEPS = 3


def _neox() -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """Not a preset: a GPT-NeoX causal LM with hidden and attention dropout on."""
    import transformers

    config = transformers.GPTNeoXConfig(
        vocab_size=500, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=128, hidden_dropout=0.1, attention_dropout=0.1, use_cache=False)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = transformers.GPTNeoXForCausalLM(config).train()
    ids = torch.randint(0, 500, (2, 24), generator=torch.Generator().manual_seed(1))
    return model, {"input_ids": ids, "labels": ids.clone()}


def _model(name: str) -> tuple[torch.nn.Module, Any]:
    if name == "gpt-neox-tiny":
        return _neox()
    if name == "bn-cnn":  # not a transformer: batch norm (running statistics), in-place ReLU
        from cnn_models import small_cnn

        return small_cnn()
    return build_model(name, dtype="fp32", fake=False)


def _loss(net: torch.nn.Module, batch: Any) -> torch.Tensor:
    out = net(**batch) if isinstance(batch, dict) else net(*batch)
    return out["loss"] if isinstance(out, dict) else out.loss


def _wrap(model: torch.nn.Module, wrapper: str) -> torch.nn.Module:
    if wrapper == "ddp":
        return torch.nn.parallel.DistributedDataParallel(model)
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy()
    if wrapper == "fsdp2-bf16":  # gathered and run in bf16, gradients reduced in fp32
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    # fsdp2-kept: a unit's parameters stay gathered from its forward to its backward
    kept = wrapper != "fsdp2-kept"
    modules = dict(model.named_modules())
    units = [modules[path] for path in transformer_blocks(model)] or [
        m for m in model.modules() if isinstance(m, torch.nn.Conv2d)]  # a CNN's layers
    for unit in units:
        fully_shard(unit, mp_policy=policy, reshard_after_forward=kept)
    return fully_shard(model, mp_policy=policy, reshard_after_forward=kept)


@contextlib.contextmanager
def _all_gathers() -> Any:
    """Counts FSDP2's all-gathers while it is open (one per unit gathered)."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group as group

    count, gather = [0], group.foreach_all_gather

    def counted(*args: Any, **kwargs: Any) -> Any:
        count[0] += 1
        return gather(*args, **kwargs)

    group.foreach_all_gather = counted
    try:
        yield count
    finally:
        group.foreach_all_gather = gather


def _train(net: torch.nn.Module, batch: dict, plan: Plan | None) -> tuple[list, list, int]:
    """Losses and full gradients of ``STEPS`` SGD steps, dropout seeded per step and rank,
    and how many all-gathers FSDP2 made."""
    with _all_gathers() as gathers:
        losses, grads = _steps(net, batch, plan)
    return losses, grads, gathers[0]


def _steps(net: torch.nn.Module, batch: dict, plan: Plan | None) -> tuple[list, list]:
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    losses, grads = [], []
    for step in range(STEPS):
        torch.manual_seed(100 * step + dist.get_rank())
        with slackswap.apply(net, plan, verify=True) if plan else torch.enable_grad():
            loss = _loss(net, batch)
        loss.backward()
        losses.append(loss.detach().clone())
        grads.append({n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor")
                          else p.grad).clone() for n, p in net.named_parameters()})
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return losses, grads


def _uniform(plan: Plan, decision: str) -> Plan:
    """Every planable activation of the plan's profile kept (``keep``) or moved."""
    profile = plan._profile
    names = profile.recomputable if decision == "recompute" else {
        t.name for t in profile.saved_activations if t.producer is not None}
    uniform = Plan(fingerprint=plan.fingerprint, strategy=f"{decision}-only",
                   decisions={n: decision for n in plan.decisions if n in names})
    uniform._profile = profile
    return uniform


def _checkpoints_offloaded(plan: Plan) -> Plan:
    """Every activation recomputed, every tensor autograd does not save offloaded as a
    checkpoint (but those changed in place later, which are kept)."""
    profile = plan._profile
    decisions = {n: "recompute" for n in plan.decisions if n in profile.recomputable}
    decisions.update({n: "offload" if t.id not in profile.changed_in_place else "keep"
                      for n, t in profile.checkpointable.items()})
    offloaded = Plan(fingerprint=plan.fingerprint, strategy="checkpoints-offloaded",
                     decisions=decisions)
    offloaded._profile = profile
    return offloaded


def _check(rank: int, wrapper: str, name: str) -> None:
    model, batch = _model(name)
    reference = _train(_wrap(copy.deepcopy(model), wrapper), batch, None)
    net = _wrap(copy.deepcopy(model), wrapper)
    # planned on rank 0, broadcast, checked on every rank
    budget = 0.7 if wrapper == "fsdp2-bf16" else 0.5  # a bf16 step has less to move
    planned = slackswap.plan(net, batch, budget=budget, group=dist.group.WORLD)
    for plan in (planned, _uniform(planned, "recompute"), _uniform(planned, "offload"),
                 _checkpoints_offloaded(planned)):
        net = _wrap(copy.deepcopy(model), wrapper)
        losses, grads, gathers = _train(net, batch, plan)
        where = f"rank {rank}, {wrapper}, {name}, {plan.strategy}"
        # a rebuild that gathers a unit FSDP2 freed does that unit's own backward gather
        # early: no all-gather is added (NOTE [rebuilds across FSDP2 units])
        assert gathers == reference[2], where
        assert all(torch.equal(a, b) for a, b in zip(losses, reference[0], strict=True)), where
        for got, want in zip(grads, reference[1], strict=True):
            assert got.keys() == want.keys(), where
            for key in got:
                assert torch.equal(got[key], want[key]), f"{where}: {key}"


def _run(rank: int, wrapper: str, names: list[str]) -> None:
    for name in names:
        _check(rank, wrapper, name)  # its wrapped models are gone when it returns


def _serve(rank: int, world: int, folder: str, tasks: Any, results: Any) -> None:
    """One rank of a ``_Group``: in a gloo group, ``fn(rank, *args)`` for each task sent,
    each answered with None or the traceback it raised, until None is sent."""
    faulthandler.enable()  # a crash prints every thread's stack to the captured stderr
    dist.init_process_group("gloo", init_method=f"file://{folder}/rendezvous", rank=rank,
                            world_size=world)
    torch.set_num_threads(1)
    try:
        while (task := tasks.get()) is not None:
            fn, args = task
            try:
                fn(rank, *args)
                error = None
            except BaseException:  # noqa: BLE001 - the test fails with it, in the parent
                error = traceback.format_exc()
            # NOTE: a DDP reducer freed after the group is destroyed drops the group's last
            # reference while holding the GIL; gloo's worker thread may then wait on the
            # GIL to free a finished work item, and the process hangs at exit
            gc.collect()
            results.put((rank, error))
    finally:
        gc.collect()
        dist.destroy_process_group()


class _Group:
    """``world`` processes in one gloo group, started once and handed the file's tests in
    turn. Started for each test, a rank (a process importing torch and SlackSwap, then the
    group's rendezvous and, after the test, its teardown) took 15 s on two loaded cores,
    most of the three cheapest tests' 21 to 26 s. A test whose rank raised, crashed or
    hung stops the group (the others may wait in a collective for it); the next test
    starts another."""

    def __init__(self, world: int) -> None:
        context = mp.get_context("spawn")
        self.world, self.broken = world, False
        self._folder = tempfile.TemporaryDirectory()
        self._tasks = [context.SimpleQueue() for _ in range(world)]
        self._results = context.Queue()
        self._processes = [
            context.Process(target=_serve, daemon=True,
                            args=(rank, world, self._folder.name, self._tasks[rank],
                                  self._results))
            for rank in range(world)]
        for process in self._processes:
            process.start()

    def run(self, fn: Any, *args: Any, limit_s: float) -> None:
        """``fn(rank, *args)`` on every rank; a rank that raises or crashes fails the test,
        and so does a hang (after ``limit_s``)."""
        for tasks in self._tasks:
            tasks.put((fn, args))
        errors: dict[int, str | None] = {}
        deadline = time.monotonic() + limit_s
        while len(errors) < self.world:
            if any(errors.values()):  # the other ranks get a moment to say theirs
                deadline = min(deadline, time.monotonic() + 10)
            try:
                rank, error = self._results.get(timeout=1)
                errors[rank] = error
                continue
            except queue.Empty:
                pass
            dead = [r for r, p in enumerate(self._processes) if not p.is_alive()]
            if dead or time.monotonic() > deadline:
                codes = [self._processes[r].exitcode for r in dead]
                self.close(kill=True)
                why = (f"ranks {dead} exited (exit codes {codes})" if dead else
                       f"{self.world - len(errors)} of {self.world} ranks still ran " + (
                           "10 s after another raised" if any(errors.values())
                           else f"after {limit_s:.0f} s"))
                pytest.fail("\n".join([why, *(f"rank {r} raised:\n{e}"
                                              for r, e in sorted(errors.items()) if e)]))
        failed = {r: e for r, e in errors.items() if e}
        if failed:
            self.close(kill=True)
            pytest.fail("\n".join(f"rank {r} raised:\n{e}" for r, e in sorted(failed.items())))

    def close(self, kill: bool = False) -> None:
        """Stop the ranks; ranks that hang or crash while exiting (PyTorch's gloo teardown,
        see ``_serve``) after every test passed are stopped with a warning."""
        self.broken = True
        if not kill:
            for tasks in self._tasks:
                tasks.put(None)
            for process in self._processes:
                process.join(timeout=30)
            if any(p.is_alive() or p.exitcode for p in self._processes):
                warnings.warn("every test's ranks passed, but one hung or crashed while "
                              "exiting; stopped it", stacklevel=2)
        for process in self._processes:
            if process.is_alive():
                process.kill()
                process.join()
        self._folder.cleanup()


_GROUPS: dict[int, _Group] = {}


@pytest.fixture(scope="module", autouse=True)
def _groups() -> Any:
    """The file's groups of ranks, stopped after its last test."""
    yield
    while _GROUPS:
        _GROUPS.popitem()[1].close()


def _spawn(fn: Any, world: int, *args: Any, limit_s: float = 240) -> None:
    """``fn(rank, *args)`` on ``world`` ranks of a gloo group, the group this file's tests
    share (``_Group``)."""
    group = _GROUPS.get(world)
    if group is None or group.broken:
        group = _GROUPS[world] = _Group(world)
    group.run(fn, *args, limit_s=limit_s)


@pytest.mark.heavy  # 44 s of worker time; the README example under FSDP2 stays in the default run
def test_two_ranks_train_bit_identically_under_fsdp2() -> None:
    _spawn(_run, 2, "fsdp2", ["gpt2-xl-tiny", "bert-large-tiny", "llama-7b-tiny",
                              "gpt-neox-tiny", "bn-cnn"])


@pytest.mark.heavy  # the multi-process tests past FSDP2's own (45 s of worker time)
def test_two_ranks_train_bit_identically_under_ddp() -> None:
    """What DDP adds to a step, its gradient buckets' hooks and its buffers broadcast, on
    tied weights (GPT-2's head), dropout (GPT-NeoX) and batch norm: the other presets'
    own ops are FSDP2's test's (about 11 s less of planning and training)."""
    _spawn(_run, 2, "ddp", ["gpt2-xl-tiny", "gpt-neox-tiny", "bn-cnn"])


@pytest.mark.heavy
def test_four_ranks_train_bit_identically_under_fsdp2() -> None:
    """Four shards of each parameter, the plan broadcast to three ranks: GPT-2 (tied
    weights). GPT-NeoX's dropout seeded per rank is the two-rank tests' (FSDP2, DDP, bf16);
    on four ranks it is ``pytest -m full``'s (four processes on two cores: 20 s more).
    ``heavy``: a group of four ranks of its own, started for this test alone (150 s of
    worker time in the default run on two cores)."""
    _spawn(_run, 4, "fsdp2", ["gpt2-xl-tiny"])


@pytest.mark.full
def test_four_ranks_train_gpt_neox_bit_identically_under_fsdp2() -> None:
    _spawn(_run, 4, "fsdp2", ["gpt-neox-tiny"])


@pytest.mark.heavy  # 64 s of worker time on two loaded cores
def test_two_ranks_under_fsdp2_mixed_precision() -> None:
    _spawn(_run, 2, "fsdp2-bf16", ["gpt2-xl-tiny", "gpt-neox-tiny"])


def test_two_ranks_under_fsdp2_that_keeps_units_gathered_until_backward() -> None:
    """``reshard_after_forward=False``: no rebuild finds a unit freed."""
    _spawn(_run, 2, "fsdp2-kept", ["gpt2-xl-tiny", "bn-cnn"])


def _attached(rank: int, wrapper: str) -> None:
    """``slackswap.attach`` on the wrapped model, planned at its first call by rank 0 for
    both ranks (``group=``)."""
    model, batch = _model("gpt-neox-tiny")
    reference = _steps(_wrap(copy.deepcopy(model), wrapper), batch, None)
    net = _wrap(copy.deepcopy(model), wrapper)
    # rank 1 names other hardware, as measured profiles differ by rank: rank 0 plans
    hardware = "a100-80gb" if rank == 0 else "h100-sxm"
    with slackswap.attach(net, budget=0.5, hardware=hardware,
                          group=dist.group.WORLD) as attached:
        losses, grads = _steps(net, batch, None)
    assert len(attached.plans) == 1, rank
    # every rank runs rank 0's plan, received whole (its profile, priced on rank 0's
    # hardware, with it)
    (plan,) = attached.plans.values()
    plans: list[Any] = [None, None]
    dist.all_gather_object(plans, (plan.model_dump_json(), plan._profile.model_dump_json()))
    assert plans[0] == plans[1], rank
    assert all(torch.equal(a, b) for a, b in zip(losses, reference[0], strict=True)), rank
    for got, want in zip(grads, reference[1], strict=True):
        assert got.keys() == want.keys() and all(
            torch.equal(got[k], want[k]) for k in got), (rank, wrapper)
    if wrapper != "ddp":
        assert all(type(p).__name__ == "DTensor" for p in net.parameters())  # sharded again


@pytest.mark.heavy  # 32 s of worker time on two loaded cores
def test_two_ranks_attached_under_fsdp2_train_bit_identically() -> None:
    """attach profiles inside the model's call, after FSDP2's root pre-forward hook has
    gathered the root unit: the profile left the root resharded under that forward, whose
    first op failed on a sharded ``DTensor`` (NOTE [units gathered before the profile])."""
    _spawn(_attached, 2, "fsdp2")


def _mismatch(rank: int) -> None:
    model, batch = _model("gpt2-xl-tiny")
    if rank == 1:  # this rank's batch has another shape
        batch = {k: v[:, :16] for k, v in batch.items()}
    net = _wrap(model, "fsdp2")
    if rank == 0:  # rank 0 planned for its own batch: nothing to refuse
        slackswap.plan(net, batch, group=dist.group.WORLD)
    else:
        with pytest.raises(InputError, match="^rank 1: the plan from rank 0 was made"):
            slackswap.plan(net, batch, group=dist.group.WORLD)
    # the planning rank's error reaches every rank, none is left waiting
    prefix = "" if rank == 0 else "rank 0 could not plan: "
    with pytest.raises(InputError, match=f"^{prefix}budget .* fits no plan"):
        slackswap.plan(net, batch, budget=1024, group=dist.group.WORLD)


def test_a_rank_refuses_a_plan_for_another_batch_and_says_which() -> None:
    """Each rank checks the plan it is sent; a rank that cannot plan tells the others."""
    _spawn(_mismatch, 2)


# --ddp: ``heavy`` (two more processes under torchrun, 25 s; DDP is the group's test's too)
@pytest.mark.parametrize("flag", [[], pytest.param(["--ddp"], marks=pytest.mark.heavy)],
                         ids=["fsdp2", "ddp"])
def test_the_readme_example_runs_as_written(flag: list[str]) -> None:
    """docs/training/distributed.md: ``torchrun --nproc-per-node 2 examples/train_fsdp.py``
    on a CPU (the page shows the example's core; tests/test_docs_snippets.py checks it)."""
    root = Path(__file__).parents[1]
    page = (root / "docs" / "training" / "distributed.md").read_text()
    assert "torchrun --nproc-per-node 2 examples/train_fsdp.py" in page
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         str(root / "examples" / "train_fsdp.py"), "--steps", "2", *flag],
        capture_output=True, text=True, timeout=240, cwd=root)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "step 1: loss" in run.stdout


def _profiles(rank: int) -> None:
    model, batch = _model("gpt2-xl-tiny")
    net = _wrap(copy.deepcopy(model), "fsdp2")
    shards = sum(p.to_local().untyped_storage().nbytes() for p in net.parameters())
    for mode in ("analytic", "traced"):  # analytic: no collective, no real weights
        kwargs = {"kernels": "native"} if mode == "analytic" else {}
        whole = slackswap.profile(model, batch, mode=mode, **kwargs)
        sharded = slackswap.profile(net, batch, mode=mode, **kwargs)
        assert sharded.fingerprint == whole.fingerprint, mode
        assert ([(t.name, t.bytes) for t in sharded.saved_activations]
                == [(t.name, t.bytes) for t in whole.saved_activations]), mode
        assert [o.name for o in sharded.ops] == [o.name for o in whole.ops], mode
        assert sharded.keep_all_peak == whole.keep_all_peak, mode
        # model state is this rank's: its shards of the parameters, and the buffers
        buffers = sum(b.untyped_storage().nbytes() for b in model.buffers())
        assert sharded.model_state_bytes == shards + buffers, mode
    assert all(type(p).__name__ == "DTensor" for p in net.parameters())  # sharded again


def test_a_sharded_model_is_profiled_as_its_unsharded_self() -> None:
    _spawn(_profiles, 2)


def _clamped(module: torch.nn.Module, args: tuple, output: Any) -> None:
    args[0].data.clamp_(max=0.05)  # after the module saved it: no version counter sees


class _Written(torch.nn.Module):
    """Layers each followed, on a random draw, by one more saved activation (a code path
    of the step's own, every parameter used on each), and a head whose forward hook
    writes its input, already saved by it and by the tanh before, through ``.data``."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(64, 64) for _ in range(4))
        self.head = torch.nn.Linear(64, 64)
        self.head.register_forward_hook(_clamped)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
            if torch.rand(()) > 0.5:
                x = torch.tanh(x * 2)
        return self.head(x).pow(2).mean()


def _path(seed: int) -> list[bool]:
    torch.manual_seed(seed)
    return [bool(torch.rand(()) > 0.5) for _ in range(4)]


def _written(rank: int, wrapper: str) -> None:
    """Two steps under an offload plan, the first on the profiled path, the second off it,
    against the same wrapper without SlackSwap: the same seed on every rank (FSDP2's
    ranks must take one path, their gathers are collectives), a batch of each rank's."""
    torch.manual_seed(0)
    model, x = _Written(), torch.randn(64, 64) + rank
    other = next(s for s in range(1, 50) if _path(s) != _path(0))
    torch.manual_seed(0)  # rank 0's profile takes the path of seed 0
    plan = slackswap.plan(_wrap(copy.deepcopy(model), wrapper), x, budget=0.7,
                          hardware="a100-80gb", group=dist.group.WORLD)
    assert any(d == "offload" for d in plan.decisions.values())
    got = []
    for planned in (plan, None):
        net = _wrap(copy.deepcopy(model), wrapper)
        optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
        for seed in (0, other):
            torch.manual_seed(seed)
            block = slackswap.apply(net, planned) if planned else contextlib.nullcontext()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", slackswap.PathNotice)
                with block:
                    loss = net(x)
            loss.backward()
            if planned:
                assert block.stats.off_path == (seed == other), (rank, wrapper, seed)
            got.append((loss.detach(), [(p.grad.full_tensor() if hasattr(p.grad, "full_tensor")
                                         else p.grad).clone() for p in net.parameters()]))
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    for (loss, grads), (loss0, grads0) in zip(got[:2], got[2:], strict=True):
        assert torch.equal(loss, loss0), (rank, wrapper)
        for g, g0 in zip(grads, grads0, strict=True):
            assert torch.equal(g, g0), (rank, wrapper)


def _writes(rank: int) -> None:
    for wrapper in ("ddp", "fsdp2"):
        _written(rank, wrapper)


def test_a_write_no_version_counter_sees_off_the_path_is_read_under_ddp_and_fsdp2() -> None:
    """NOTE [a step off the profiled path]: across two ranks, a step run again off the
    profiled path (``OffPathWrites``) reads a saved activation written through ``.data``
    as plain DDP and plain FSDP2 do, bit for bit, and so does the step on the path."""
    _spawn(_writes, 2)
