"""The hardware a step is planned for: the one named, the default said aloud, or
``auto``, the GPU this process sees (NOTE [assumed hardware] in
:mod:`slackswap.core.hardware`)."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from slackswap.core.hardware import (
    AUTO,
    DEFAULT_HARDWARE,
    Hardware,
    default_hardware,
    hardware_presets,
    load_hardware,
    notice,
    preset_for_gpu,
)
from slackswap.errors import InputError

__all__ = ["resolve_hardware", "auto_hardware", "gpu_name"]

# a hardware file ``auto`` takes before the GPU's preset (one written for this machine)
HARDWARE_ENV = "SLACKSWAP_HARDWARE"


def gpu_name() -> str | None:
    """The CUDA device's name (``NVIDIA L4``); None without one."""
    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_name()


def auto_hardware() -> Hardware:
    """``hardware="auto"``: the file ``$SLACKSWAP_HARDWARE`` names when set (one written
    for this machine), else the preset of the GPU this process sees, else (no GPU) the
    default preset; which one is said once (a :class:`~slackswap.HardwareNotice`)."""
    if file := os.environ.get(HARDWARE_ENV):
        hw = load_hardware(Path(file))
        notice(f"hardware 'auto': {hw.name} from ${HARDWARE_ENV} ({file})")
        return hw
    name = gpu_name()
    if name is None:
        hw = load_hardware(DEFAULT_HARDWARE)
        notice(f"hardware 'auto': no CUDA GPU here, so preset {hw.name} "
               f"({hw.description}) is assumed; name a preset or a hardware file to plan "
               "for another GPU")
        return hw
    preset = preset_for_gpu(name)
    if preset is None:
        raise InputError(
            f"hardware 'auto': this machine's GPU, {name}, matches no preset "
            f"({', '.join(hardware_presets())}); describe it in a hardware file "
            "(`slackswap hardware --template > gpu.toml`, then fill it in) and pass that file")
    hw = load_hardware(preset)
    notice(f"hardware 'auto': this machine's GPU, {name}, is preset {hw.name} "
           f"({hw.description})")
    return hw


def resolve_hardware(spec: str | Path | Hardware | None) -> Hardware:
    """The hardware ``spec`` names: a preset, a file, ``auto`` (:func:`auto_hardware`),
    or, for None, the default preset, said (NOTE [assumed hardware])."""
    if spec is None:
        return default_hardware()
    if isinstance(spec, str) and spec == AUTO:
        return auto_hardware()
    return load_hardware(spec)
