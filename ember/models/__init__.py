"""Model definitions: `build_model(config)` returns the decoder for a ModelConfig's architecture."""

from __future__ import annotations

import torch

from ember.engine.parallel import TensorParallelGroup
from ember.models.config import ModelConfig
from ember.models.llama import LlamaForCausalLM

__all__ = ["ModelConfig", "build_model"]


def build_model(config: ModelConfig, device: torch.device | str = "cpu",
                tp: TensorParallelGroup | None = None) -> LlamaForCausalLM:
    """The decoder skeleton for `config` (Llama, Mistral and Qwen2 share it), parameters on the "meta" device
    until `load_weights(state_dict)` materializes them on `device` in config.torch_dtype; `tp`'s shard of it
    under tensor parallelism."""
    with torch.device("meta"):
        return LlamaForCausalLM(config, device, tp)
