"""What the loader hands the engine: config, Hugging Face-named tensors and tokenizer."""

from __future__ import annotations

from dataclasses import dataclass

from ember.loader.lazy_weights import LazyStateDict
from ember.loader.tokenizer import Tokenizer
from ember.models.config import ModelConfig


@dataclass
class LoadedModel:
    config: ModelConfig
    state_dict: LazyStateDict  # HF names; tensors read (whole or sliced) in config.torch_dtype when asked for
    tokenizer: Tokenizer
    source: str  # the resolved path, for logs and /v1/models
