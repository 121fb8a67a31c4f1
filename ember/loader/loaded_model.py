"""What the loader hands the engine: config, Hugging Face-named tensors and tokenizer."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ember.kernels.quantized_weight import QuantizedWeight
from ember.loader.tokenizer import Tokenizer
from ember.models.config import ModelConfig


@dataclass
class LoadedModel:
    config: ModelConfig
    # HF names, already in config.torch_dtype; quantized GGUF blocks with quantization="gguf"
    state_dict: dict[str, torch.Tensor | QuantizedWeight]
    tokenizer: Tokenizer
    source: str  # the resolved path, for logs and /v1/models
