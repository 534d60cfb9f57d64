"""The target machine: compute roofline, HBM, and the host link used for offloading.

Presets ship as TOML files in ``slackswap/hardware/presets``; each field cites its source
in the file's ``[sources]`` table. Users pass a preset name or a path to their own file.
"""

from __future__ import annotations

import sys
from importlib import resources
from pathlib import Path
from typing import Annotated, Literal

import pydantic
from pydantic import Field

from slackswap.errors import InputError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

__all__ = ["Hardware", "Compute", "Memory", "HostLink", "load_hardware", "hardware_presets"]

Positive = Annotated[float, Field(gt=0)]
Fraction = Annotated[float, Field(gt=0, le=1)]
# A step table: rows of [threshold, efficiency]; the row with the largest threshold <= size applies.
StepTable = list[tuple[Annotated[float, Field(ge=0)], Fraction]]


def _check_table(table: StepTable) -> StepTable:
    thresholds = [row[0] for row in table]
    if not table or thresholds[0] != 0 or thresholds != sorted(set(thresholds)):
        raise ValueError("rows must start at threshold 0 and ascend strictly")
    return table


class _Strict(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid", frozen=True)


class Compute(_Strict):
    peak_flops: dict[Literal["fp32", "tf32", "fp16", "bf16"], Positive]
    matmul_efficiency: StepTable
    matmul_efficiency_cap: Fraction
    attention_forward_efficiency: Fraction
    attention_backward_efficiency: Fraction
    min_kernel_time_s: Positive

    _table = pydantic.field_validator("matmul_efficiency")(_check_table)


class Memory(_Strict):
    capacity_bytes: Positive
    hbm_bandwidth: Positive
    bandwidth_efficiency: StepTable

    _table = pydantic.field_validator("bandwidth_efficiency")(_check_table)


class HostLink(_Strict):
    kind: str
    d2h_bandwidth: Positive
    h2d_bandwidth: Positive
    duplex_d2h_bandwidth: Positive
    duplex_h2d_bandwidth: Positive
    latency_s: Annotated[float, Field(ge=0)]


class Hardware(_Strict):
    """One GPU and its host link, as the cost model and the simulator see it."""

    schema_version: int = 1
    name: str
    description: str = ""
    kernels: Literal["cuda", "native"] = "cuda"
    compute: Compute
    memory: Memory
    host_link: HostLink
    sources: dict[str, str] = {}

    def peak(self, dtype: str) -> float:
        """Dense peak FLOP/s for ``dtype`` (fp32 matmuls run without TF32, as PyTorch's default)."""
        return self.compute.peak_flops.get(dtype, self.compute.peak_flops["fp32"])


def hardware_presets() -> list[str]:
    """Names of the hardware presets shipped with SlackSwap."""
    folder = resources.files("slackswap") / "hardware" / "presets"
    return sorted(p.name[: -len(".toml")] for p in folder.iterdir() if p.name.endswith(".toml"))


def _parse(text: str, source: str) -> Hardware:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise InputError(f"{source}: not valid TOML ({e})") from None
    try:
        return Hardware.model_validate(data)
    except pydantic.ValidationError as e:
        err = e.errors()[0]
        field = ".".join(str(p) for p in err["loc"])
        raise InputError(f"{source}: field '{field}': {err['msg']}") from None


def load_hardware(spec: str | Path | Hardware) -> Hardware:
    """A preset by name (see :func:`hardware_presets`) or a TOML file by path."""
    if isinstance(spec, Hardware):
        return spec
    path = Path(spec)
    if path.suffix == ".toml" or path.exists():
        try:
            return _parse(path.read_text(encoding="utf-8"), str(path))
        except OSError as e:
            raise InputError(f"cannot read hardware file {path}: {e.strerror}") from None
    names = hardware_presets()
    if str(spec) not in names:
        raise InputError(
            f"unknown hardware '{spec}'; presets: {', '.join(names)} (or a path to a .toml file)"
        )
    folder = resources.files("slackswap") / "hardware" / "presets"
    return _parse((folder / f"{spec}.toml").read_text(encoding="utf-8"), f"preset {spec}")
