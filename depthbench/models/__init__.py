"""Models: the config dataclass, the shared backbone and one module per architecture."""

from depthbench.models.base import DecoderLM, ModelOutput
from depthbench.models.registry import (
    ARCHITECTURES,
    build_model,
    canonical_arch,
    count_parameters,
    registered_architectures,
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
    "registered_architectures",
    "swiglu_hidden",
]
