"""What a saved-tensor hook written in Python costs by itself on ``host_work.py``'s
workload: its forward plain, under an identity pack/unpack pair, under a pair that wraps
each saved tensor in a small object (as the runtime's handles do), and under the plan.

Run: python benchmarks/host_work_floor.py [--steps 12]

gpt2-xl@12 on the meta device with ``host_work.py``'s cheap ops and the ``h200`` plan at
50%; this thread's CPU time of each forward, the least and the median of ``--steps``
each, the four interleaved. ``docs/results-host/README.md`` (thirteenth pass) reads it:
the hook mechanism's own cost, against what the runtime does inside its hooks.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import statistics
import time
from typing import Any

import host_work as hw
import torch

import slackswap


class _Handle:
    __slots__ = ("tensor", "version")

    def __init__(self, t: torch.Tensor) -> None:
        self.tensor, self.version = t, t._version


def _identity(x: Any) -> Any:
    return x


def _unwrap(handle: _Handle) -> torch.Tensor:
    return handle.tensor


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    args = parser.parse_args()
    net, batch, plan, profile = hw.meta_workload("gpt2-xl", 12, 0.5, "slackswap")
    hooks = {"plain": None, "identity hooks": (_identity, _identity),
             "object hooks": (_Handle, _unwrap), "planned": "plan"}
    times: dict[str, list[float]] = {name: [] for name in hooks}
    with hw.steps_counted("behind"), hw.cheap_ops(), hw.no_packed_sequence_check():
        for _ in range(args.steps):
            for name, pair in hooks.items():
                net.zero_grad(set_to_none=True)
                gc.collect()
                begin = time.thread_time()
                if pair == "plan":
                    context: Any = slackswap.apply(net, plan, profile=profile)
                elif pair is None:
                    context = contextlib.nullcontext()
                else:
                    context = torch.autograd.graph.saved_tensors_hooks(*pair)
                with context, hw.kernels_by_name():
                    loss = net(**batch).loss
                times[name].append(time.thread_time() - begin)
                with hw.kernels_by_name():
                    loss.backward()
    for name, seconds in times.items():
        print(f"{name:15s} least {min(seconds) * 1e3:6.2f} ms, "
              f"median {statistics.median(seconds) * 1e3:6.2f} ms")


if __name__ == "__main__":
    main()
