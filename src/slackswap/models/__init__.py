"""Reference workloads built from ``transformers`` configs, and custom model factories."""

from slackswap.models.presets import (
    MODEL_PRESETS,
    ModelPreset,
    build_model,
    load_factory,
    load_loss,
    load_workload,
    with_layers,
)

__all__ = ["MODEL_PRESETS", "ModelPreset", "build_model", "load_factory", "load_loss",
           "load_workload", "with_layers"]
