"""Hardware files as text: ``slackswap hardware --template``, a file to fill in for one's
own GPU, and :func:`hardware_toml`, a :class:`Hardware` written as a file."""

from __future__ import annotations

import json
import math
from typing import Any

from slackswap.core.hardware import Hardware

__all__ = ["HARDWARE_TEMPLATE", "hardware_toml"]

# Valid as printed (its figures are the a100-80gb preset's, to be replaced), so a user
# can change one figure at a time and plan with it after each.
HARDWARE_TEMPLATE = '''\
# A SlackSwap hardware file: one GPU and its host link, as the cost model and the
# simulator see them. Replace each figure with your GPU's (the figures below are the
# a100-80gb preset's), then pass the file: slackswap plan MODEL --hardware my-gpu.toml
# (or hardware="my-gpu.toml" in Python). Every rate is per second, every size in bytes.
# The presets (src/slackswap/hardware/presets/*.toml) cite a source for each figure.
schema_version = 1
name = "my-gpu"                    # shown in outputs and stored in profiles
description = "my GPU, host link PCIe 4.0 x16"
kernels = "cuda"                   # "cuda" for NVIDIA GPUs
stack = "eager"                    # "eager" as slackswap.apply runs; "fused" for a fusing compiler

[compute]
# dense peak FLOP/s by dtype, no sparsity: the vendor datasheet's tensor-core figures
# halved where they are quoted "with sparsity"; for GeForce cards take the figure
# "with FP32 accumulate" (PyTorch's matmuls accumulate in fp32)
peak_flops = { fp32 = 19.5e12, tf32 = 156e12, fp16 = 312e12, bf16 = 312e12 }
# [minimum FLOPs of one matmul, fraction of peak]: small matmuls run below peak
matmul_efficiency = [[0, 0.1], [1e9, 0.6], [16e9, 0.9], [128e9, 0.95]]
# the best fraction of peak a large bf16 matmul reaches (time torch.matmul of 8192^2)
matmul_efficiency_cap = 0.859
# flash attention's fraction of peak, forward and backward (and causal forward)
attention_forward_efficiency = 0.59
attention_backward_efficiency = 0.63
attention_causal_forward_efficiency = 0.5
min_kernel_time_s = 1.3e-6         # the shortest kernel, launch included

[memory]
capacity_bytes = 85899345920       # device memory: 80 GiB (nvidia-smi's total, in bytes)
hbm_bandwidth = 2.039e12           # device memory bandwidth, the datasheet's figure
# [minimum bytes one op moves, fraction of the bandwidth]
bandwidth_efficiency = [[0, 0.3], [1e6, 0.6], [1e7, 0.75], [1e8, 0.88]]

[host_link]
# The link offloads cross. Measure it with NVIDIA's nvbandwidth
# (device_to_host_memcpy_ce, host_to_device_memcpy_ce and their _bidirectional_ runs):
# PCIe 4.0 x16 moves about 25 GB/s each way, PCIe 5.0 x16 about 53 GB/s.
kind = "pcie4-x16"
d2h_bandwidth = 24.8e9             # device to host alone
h2d_bandwidth = 24.8e9             # host to device alone
duplex_d2h_bandwidth = 24.0e9      # device to host while host to device also runs
duplex_h2d_bandwidth = 12.0e9      # host to device while device to host also runs
latency_s = 1e-5                   # fixed cost of one copy

[host]
dispatch_s = 7e-6                  # host time to issue one eager PyTorch op

[sources]
# where each figure comes from, by TABLE.FIELD, e.g.
# "memory.hbm_bandwidth" = "vendor datasheet, 2,039 GB/s"
'''


def _value(value: Any) -> str:
    """One TOML value: a string, a number, an array, or an inline table."""
    if isinstance(value, str):
        # a JSON string is a TOML basic string, but for DEL, which JSON leaves raw and
        # TOML refuses: a name with one (from --name, or a base file's escape) would make
        # a file that does not read back
        return json.dumps(value, ensure_ascii=False).replace("\x7f", "\\u007f")
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return "inf" if value == math.inf else _float(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{_key(k)} = {_value(v)}" for k, v in value.items()) + " }"
    raise TypeError(f"no TOML value for {value!r}")


def _float(value: float) -> str:
    """The shortest form that reads back as ``value`` (``5.53e+10``), a float in TOML."""
    text = next(t for t in (f"{value:.{p}g}" for p in range(1, 18)) if float(t) == value) \
        if value == value else repr(value)
    return text if any(c in text for c in ".en") else f"{text}.0"


def _key(key: str) -> str:
    return key if key.replace("_", "").replace("-", "").isalnum() and key.isascii() \
        else json.dumps(key)


def hardware_toml(hw: Hardware) -> str:
    """``hw`` as a hardware file that :func:`~slackswap.core.hardware.load_hardware`
    reads back equal (every field written, ``[sources]`` last)."""
    data = hw.model_dump(exclude_none=True)
    lines, tables = [], []
    for key, value in data.items():
        if isinstance(value, dict) and key != "sources":
            tables.append((key, value))
        elif key != "sources":
            lines.append(f"{_key(key)} = {_value(value)}")
    tables.append(("sources", data.get("sources", {})))
    for name, table in tables:
        lines += ["", f"[{name}]"]
        lines += [f"{_key(k)} = {_value(v)}" for k, v in table.items()]
    return "\n".join(lines) + "\n"
