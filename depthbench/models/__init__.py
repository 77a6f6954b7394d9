"""Models: the config dataclass, the shared backbone and one module per architecture."""

from depthbench.models.base import (
    ARCHITECTURES,
    DecoderLM,
    ModelOutput,
    build_model,
    canonical_arch,
    count_parameters,
)
from depthbench.models.config import ModelConfig, swiglu_hidden

__all__ = [
    "ARCHITECTURES",
    "DecoderLM",
    "ModelConfig",
    "ModelOutput",
    "build_model",
    "canonical_arch",
    "count_parameters",
    "swiglu_hidden",
]
