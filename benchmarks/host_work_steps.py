"""Planned steps of ``benchmarks/host_work.py``'s workload, one after another, for a
sampling profiler to watch (nothing is timed or printed here).

Run: py-spy record -r 1000 -f raw -o spy.txt -- \
         python benchmarks/host_work_steps.py [--budget 0.5] [--steps 80]

The workload is ``host_work.py``'s with ``--cheap-ops`` (gpt2-xl@12 on the meta device,
the ``h200`` plan, stand-in device calls); ``docs/results-host/README.md`` (tenth pass)
reads the samples in the runtime's frames.
"""

from __future__ import annotations

import argparse
import gc

import host_work as hw

import slackswap


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt2-xl")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--budget", type=float, default=0.5)
    parser.add_argument("--steps", type=int, default=80)
    args = parser.parse_args()
    net, batch, plan, profile = hw.meta_workload(args.model, args.layers, args.budget,
                                                 "slackswap")
    with hw.steps_counted("behind"), hw.cheap_ops(), hw.no_packed_sequence_check():
        for _ in range(args.steps):
            net.zero_grad(set_to_none=True)
            gc.collect()
            with slackswap.apply(net, plan, profile=profile), hw.kernels_by_name():
                loss = net(**batch).loss
            with hw.kernels_by_name():
                loss.backward()


if __name__ == "__main__":
    main()
