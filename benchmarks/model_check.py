"""The block's model checks per step: five walks (as before NOTE [the model checked in one
walk]) against the one walk and its cache, on gpt2-xl@12 on the meta device.

Run: python benchmarks/model_check.py

Both alternate in one process, 15 rounds of 3 x 20 calls each, timed with this thread's
CPU time; the least and the median of each are printed (``docs/results-host/README.md``,
"Third pass").
"""

from __future__ import annotations

import gc
import sys
import time
import timeit
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import host_work  # noqa: E402

import slackswap  # noqa: E402
from slackswap.profiling.sharding import fsdp_units  # noqa: E402
from slackswap.profiling.step import (  # noqa: E402
    model_fingerprint,
    model_state,
    refuse_own_checkpointing,
)
from slackswap.runtime.block import _CHECKED, _Walk  # noqa: E402


def main() -> None:
    net, _, plan, profile = host_work.meta_workload("gpt2-xl", 12, 0.5, "slackswap")

    def five_walks() -> None:
        modules = list(net.named_modules())
        state = model_state(net, modules)
        {id(b): b for _, m in modules for b in m._buffers.values() if b is not None}
        refuse_own_checkpointing(net, modules)
        model_fingerprint(net, modules, state)
        fsdp_units(net)

    def one_walk() -> None:
        walk = _Walk(net)
        seen = _CHECKED[net]
        assert seen.key == walk.key
        refuse_own_checkpointing(net, walk.named_as_seen())
        dict(zip(seen.names, walk.tensors, strict=True))

    slackswap.apply(net, plan, profile=profile)._check_model(net)  # the cache filled
    gc.disable()
    times: dict[str, list[float]] = {"five walks": [], "one walk": []}
    for _ in range(15):
        for name, check in (("five walks", five_walks), ("one walk", one_walk)):
            times[name].append(min(timeit.repeat(check, number=20, repeat=3,
                                                 timer=time.thread_time)) / 20)
    for name, seconds in times.items():
        seconds.sort()
        print(f"{name}: least {1e6 * seconds[0]:.0f} us, median {1e6 * seconds[7]:.0f} us")


if __name__ == "__main__":
    main()
