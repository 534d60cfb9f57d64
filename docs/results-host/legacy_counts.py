"""Host work per step of the runtime as it was before its device calls went through
links (commit 21db781), counted on a CPU: the counts ``benchmarks/host_work.py`` makes
for today's code, for the code the H200 evidence measured (``docs/results-gpu/``).

That code called ``torch.cuda`` directly and took its asynchronous branch only for
``device.type == "cuda"``; ``legacy.patch`` (beside this file) makes that a set this
script adds "meta" to. The CUDA API is replaced by counters that call
``current_stream`` where PyTorch's own wrappers do (a stream context's enter, an
``Event.record()`` without a stream), so counts compare with the evidence's cProfile.

Run, from a checkout of 21db781 with legacy.patch applied:
    PYTHONPATH=src python /path/to/this/legacy_counts.py [slackswap|offload-only]
(``COSTS`` below names the cost table of today's checkout.)
"""
import contextlib
import json
import sys
import time
from collections import Counter
from pathlib import Path

import torch
import transformers.masking_utils as masking

import slackswap
from slackswap.models import build_model, with_layers
from slackswap.profiling.kernels import TargetKernels
from slackswap.runtime import stats as runtime_stats
from slackswap.runtime.copies import HostCopies
from slackswap.runtime.saved import SavedValues

calls: Counter = Counter()
# the per-call host costs benchmarks/host_work.py prices today's calls with
COSTS = Path(__file__).resolve().parents[2] / "benchmarks" / "host_costs_h200.json"


class Event:
    def __init__(self, enable_timing=False):
        calls["new_event"] += 1

    def record(self, stream=None):
        if stream is None:
            calls["current_stream"] += 1
        calls["event_record"] += 1

    def query(self):
        calls["event_query"] += 1
        return False  # "behind": no copy seen finished until waited for

    def synchronize(self):
        calls["event_synchronize"] += 1

    def elapsed_time(self, end):
        return 0.0


class Stream:
    def __init__(self, device=None):
        pass

    def wait_event(self, event):
        calls["wait_event"] += 1

    def wait_stream(self, stream):
        Event().record(stream)
        self.wait_event(None)


def current_stream(device=None):
    calls["current_stream"] += 1
    return Stream()


@contextlib.contextmanager
def stream(s):
    calls["current_stream"] += 1  # StreamContext.__enter__ asks for the current stream
    calls["stream_switch"] += 1
    yield


_empty = torch.empty


def empty(*args, pin_memory=False, **kwargs):
    if pin_memory:
        calls["host_buffer"] += 1
        kwargs["device"] = "meta"
    return _empty(*args, **kwargs)


def storage_copy(self, src, non_blocking=False):
    calls["copy_d2h"] += 1
    return self


def counted(cls, attr):
    original = getattr(cls, attr)

    def call(*args, **kwargs):
        calls[attr] += 1
        return original(*args, **kwargs)
    setattr(cls, attr, call)


runtime_stats.ASYNC.add("meta")
torch.cuda.Event, torch.cuda.Stream, torch.cuda.current_stream = Event, Stream, current_stream
torch.cuda.stream, torch.empty = stream, empty
torch.UntypedStorage.copy_ = storage_copy
masking.find_packed_sequence_indices = lambda position_ids: None
counted(HostCopies, "poll")
counted(SavedValues, "pack")

strategy = sys.argv[1] if len(sys.argv) > 1 else "slackswap"
name = with_layers("gpt2-xl", 12)
net, batch = build_model(name, dtype="bf16", fake=False, device="meta")
batch = {k: v.to("meta") for k, v in batch.items()}
with TargetKernels("cuda", dense_masks_are_causal=True):
    profile = slackswap.profile(net, batch, "h200", mode="traced", name=name)
plan = slackswap.plan(profile, 0.5, "h200", strategy=strategy)
def step(planned: bool) -> tuple[float, Counter, Counter, object]:
    calls.clear()
    with TargetKernels("cuda", dense_masks_are_causal=True):
        begin = time.thread_time()
        if planned:
            with slackswap.apply(net, plan, profile=profile) as runtime:
                loss = net(**batch).loss
        else:
            loss, runtime = net(**batch).loss, None
        forward_s = time.thread_time() - begin
        forward = Counter(calls)
        loss.backward()
    net.zero_grad(set_to_none=True)
    return forward_s, forward, Counter(calls), runtime


step(True), step(False)
runs = [(step(True), step(False)) for _ in range(9)]
(_, forward, total, runtime), _ = runs[-1]
planned_s = min(p[0] for p, _ in runs)  # the fastest: another process only adds time
plain_s = min(q[0] for _, q in runs)
decisions = Counter(d.value for d in plan.decisions.values())
print(f"gpt2-xl@12 {strategy} at 50% ({dict(decisions)}), commit 21db781, per step "
      f"(the last of 9), forward + backward:")
for key in sorted(total):
    print(f"  {key:18} {forward[key]:6d} + {total[key] - forward[key]:6d} = {total[key]:6d}")
print("  runtime:", {k: v for k, v in runtime.stats.as_dict().items() if not k.endswith("_s")})
costs = json.loads(COSTS.read_text())["costs_us"]
forward["copy_storage"] = forward.pop("copy_d2h", 0)  # the storage's copy_ then
calls_ms = sum(n * costs.get(k, 0.0) for k, n in forward.items()) / 1e3
python_ms = 1e3 * (planned_s - plain_s)
print(f"  forward: {1e3 * planned_s:.1f} ms planned, {1e3 * plain_s:.1f} ms plain here (CPU "
      f"time); predicted host time added on the H200: {python_ms + calls_ms:.1f} ms "
      f"({python_ms:.1f} Python + {calls_ms:.1f} device calls)")
