"""Measure the host link as the runtime uses it: pinned-host copies on side streams.

    python benchmarks/link_bandwidth.py                 # on a machine with a CUDA GPU
    python benchmarks/link_bandwidth.py --hardware h200 # compared with a preset

Prints GB/s for device-to-host and host-to-device alone, both at once (one stream each,
as the runtime issues them), and both while a matrix product runs on the compute stream,
next to the preset's ``[host_link]`` figures.
"""

from __future__ import annotations

import argparse

import torch

from slackswap.core.hardware import load_hardware
from slackswap.runtime.calibrate import link_rates


def rates(nbytes: int, repeats: int, d2h: bool, h2d: bool, compute: bool) -> tuple[float, float]:
    """GB/s of each direction (0 where it is off), copies of ``nbytes`` ``repeats`` times,
    as ``slackswap calibrate`` measures them (``slackswap.runtime.calibrate``)."""
    got = link_rates(nbytes, repeats, d2h, h2d, compute)
    return got[0] / 1e9, got[1] / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hardware", default="h200")
    parser.add_argument("--mib", type=int, default=256, help="bytes of one copy, MiB")
    parser.add_argument("--repeats", type=int, default=8)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("error: needs a CUDA GPU; run it on the GPU machine")
    link = load_hardware(args.hardware).host_link
    nbytes = args.mib << 20
    rates(nbytes, 2, True, True, False)  # warm-up
    print(f"{torch.cuda.get_device_name()}, {args.mib} MiB copies x {args.repeats}, GB/s")
    print(f"{'case':28s} {'d2h':>7s} {'h2d':>7s}   preset {args.hardware}")
    cases = [("alone", True, False, False, link.d2h_bandwidth, None),
             ("alone", False, True, False, None, link.h2d_bandwidth),
             ("both at once", True, True, False, link.duplex_d2h_bandwidth,
              link.duplex_h2d_bandwidth),
             ("both, with a matmul running", True, True, True, None, None)]
    for label, d2h, h2d, compute, pd, ph in cases:
        got = rates(nbytes, args.repeats, d2h, h2d, compute)
        preset = " ".join(f"{x / 1e9:7.1f}" if x else "      -" for x in (pd, ph))
        print(f"{label:28s} {got[0]:7.1f} {got[1]:7.1f}   {preset}")


if __name__ == "__main__":
    main()
