"""slackswap.compile on budget as measured: the compiled step's activation memory, taken
with PyTorch's memory tracker inside the compiled forward and backward, against the
plan's budget and its simulation (NOTE [inputs freed at last use])."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn as nn
import zoo
from memory_tracking import ActivationMemory

import slackswap
from slackswap.compiled import api
from tests.test_compiled import _MLP


class _GraphMemory(ActivationMemory):
    """Higher-order ops (a recomputed dropout's ``run_and_save_rng_state``) run whole,
    their outputs tracked as any op's: the graph's recomputed dropouts are one op each."""

    supports_higher_order_operators = True


class _Measured:
    """Wraps the compilers ``slackswap.compile`` hands AOTAutograd: each compiled graph
    runs as compiled (the same argument list, which it may clear), inside one
    ``ActivationMemory`` once ``memory`` is set; the backward's outputs (the weight
    gradients, which the profile leaves out) are left out of the peak."""

    def __init__(self, aot_autograd: Callable[..., Any]) -> None:
        self._aot_autograd = aot_autograd
        self.memory: _GraphMemory | None = None
        self.gradients: set[int] = set()

    def aot_autograd(self, **kwargs: Any) -> Any:
        for key in ("fw_compiler", "bw_compiler"):
            kwargs[key] = self._measuring(kwargs[key], backward=key == "bw_compiler")
        return self._aot_autograd(**kwargs)

    def _measuring(self, compiler: Callable[..., Any], backward: bool) -> Callable[..., Any]:
        def compile_graph(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
            inner = compiler(gm, example_inputs)
            assert getattr(inner, "_boxed_call", False)

            def run(args: list[Any]) -> Any:
                if self.memory is None:
                    return inner(args)
                with self.memory:
                    out = inner(args)
                if backward:
                    self.gradients.update(self.memory._serials(out))
                return out

            run._boxed_call = True  # type: ignore[attr-defined]
            return run

        return compile_graph

    @property
    def peak(self) -> int:
        assert self.memory is not None and self.gradients
        events = self.memory._events
        self.memory._events = [e for e in events if e[1] not in self.gradients]
        try:
            return self.memory.peak
        finally:
            self.memory._events = events


def _call(model: nn.Module, batch: Any) -> torch.Tensor:
    out = model(**batch) if isinstance(batch, dict) else model(batch)
    return out.loss if hasattr(out, "loss") else out


def _measured_step(model: nn.Module, batch: Any, budget: float,
                   monkeypatch: pytest.MonkeyPatch) -> tuple[int, int, int, int]:
    """(measured activation peak, simulated peak, budget, bytes of the RNG states the
    partition saved for recomputed random ops) of one compiled step."""
    torch._dynamo.reset()
    measured = _Measured(api.aot_autograd)
    monkeypatch.setattr(api, "aot_autograd", measured.aot_autograd)
    compiled = slackswap.compile(model, batch, budget=budget, strategy="recompute-only",
                                 backend="aot_eager")
    _call(compiled, batch).backward()  # compiled on the first call: measure a second
    model.zero_grad(set_to_none=True)
    measured.memory = _GraphMemory(model, batch)
    _call(compiled, batch).backward()
    state = compiled.slackswap
    assert len(state.graphs) == 1
    graph = state.graphs[0]
    simulated = slackswap.simulate(graph.profile, graph.plan, state.hardware)
    assert simulated.feasible
    return (measured.peak, simulated.peak_bytes, graph.plan.budget_bytes,
            graph.applied.rng_state_bytes)


def _mlp() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return _MLP(depth=2), torch.randn(256, 64)


def _t5() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    model, batch, _ = zoo.t5()  # dropout on: at 0.6 it recomputes dropouts
    return model, batch


def _clip() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """CLIP's text and vision towers, contrastive loss: attention with no dropout, whose
    kernel the partitioner still rebuilds under a saved RNG state."""
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    towers = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4)
    config = transformers.CLIPConfig(
        text_config=dict(vocab_size=128, max_position_embeddings=16, **towers),
        vision_config=dict(image_size=16, patch_size=4, **towers), projection_dim=16)
    model = transformers.CLIPModel(config).train()
    generator = torch.Generator().manual_seed(0)
    return model, {"input_ids": torch.randint(0, 128, (2, 16), generator=generator),
                   "pixel_values": torch.randn(2, 3, 16, 16, generator=generator),
                   "return_loss": True}


# what the tracker counts that the profile does not: the loss (4 bytes, the allocator's 8)
_LOSS = 8


# The default run: the MLP keeping all (1.0) and recomputing (0.6), T5 recomputing with
# dropouts rebuilt (0.9, below) and with them kept whole (0.6, the next test), CLIP with
# attention kernels rebuilt under saved RNG states (0.4); T5 keeping all, the MLP's regime
# on another model, under ``pytest -m full``
@pytest.mark.parametrize(("case", "budget"), [(_mlp, 1.0), (_mlp, 0.6),
                                              pytest.param(_t5, 1.0, marks=pytest.mark.full),
                                              (_t5, 0.9), (_clip, 0.4)],
                         ids=["mlp-1.0", "mlp-0.6", "t5-1.0", "t5-0.9", "clip-0.4"])
def test_the_compiled_step_holds_what_was_simulated_within_its_budget(
        case: Callable[[], tuple[nn.Module, Any]], budget: float,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Saved activations are freed at their last backward use, as simulated (a backward
    that held them all to its end peaked 21% and 71% above the simulation on the MLP at
    1.0 and 0.6): the measured peak is the simulated one, plus at most the RNG states
    saved for recomputed dropouts (NOTE [RNG states in the budget]), and within the
    budget with them. T5 at 0.9 rebuilds dropouts, each saving a CPU generator's state
    (5056 bytes): the plan is made within the budget less them. CLIP's attention kernels,
    rebuilt at 0.4, save RNG states too (tagged ``nondeterministic_seeded``, with no
    dropout): counted as random ops only where they drew, they were no plan's, and the
    step measured 15% over the budget."""
    model, batch = case()
    peak, simulated, budget_bytes, rng_states = _measured_step(model, batch, budget,
                                                               monkeypatch)
    assert simulated <= peak <= simulated + rng_states + _LOSS, (peak, simulated, rng_states)
    assert peak <= budget_bytes + _LOSS, (peak, budget_bytes)
    if case is _t5 and budget == 0.9:
        assert rng_states > 0


def test_a_plan_whose_rng_states_leave_no_room_keeps_its_dropouts_within_the_budget(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """T5 at 0.6: the RNG states rebuilt dropouts would save (49 KiB of a 150 KiB budget;
    at 0.9 the plan rebuilds them, the test above) leave no plan that rebuilds dropouts:
    the random ops are kept whole, and so is every activation whose rebuild would run one
    again (it was refused here, naming the states, while planning could still rebuild
    through a kept dropout); no state is saved and the measured peak is within the
    budget."""
    model, batch = _t5()
    peak, simulated, budget_bytes, rng_states = _measured_step(model, batch, 0.6,
                                                               monkeypatch)
    assert rng_states == 0
    assert simulated <= budget_bytes and peak <= budget_bytes + _LOSS, (peak, budget_bytes)
