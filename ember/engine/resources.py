"""The engine's device, KV-cache size and max_model_len, each decided here once.

The KV cache is sized first (from --kv-cache-memory, or from what max_num_seqs sequences of the default
max_model_len need); max_model_len is then checked against the model and that cache."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ember.errors import EmberError

if TYPE_CHECKING:  # the CLI imports this module for its defaults on hosts without torch (ember[gateway])
    import torch

    from ember.models.config import ModelConfig

MiB = 1 << 20
GiB = 1 << 30
# Without --max-model-len: the model's max_position_embeddings, capped at this.
DEFAULT_MAX_MODEL_LEN_CAP = 8192
# Without --kv-cache-memory: what max_num_seqs sequences of max_model_len need, at most this much.
DEFAULT_KV_CACHE_GIB = {"cpu": 1.0, "cuda": 4.0}


def resolve_device(device: str) -> torch.device:
    """EngineArgs.device as a torch device: auto -> cuda if available, else cpu."""
    import torch

    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def default_max_model_len(config: ModelConfig) -> int:
    """max_model_len without --max-model-len, before the KV cache caps it."""
    return min(config.max_position_embeddings, DEFAULT_MAX_MODEL_LEN_CAP)


def kv_block_bytes(config: ModelConfig, block_size: int, dtype: torch.dtype, kv_cache_dtype: str = "auto") -> int:
    """Bytes of one KV-cache block: K and V of block_size tokens in every layer, in kv_cache_dtype's format."""
    from ember.layers.kv_cache import kv_bytes_per_token

    per_token = kv_bytes_per_token(config.num_key_value_heads, config.head_dim, dtype, kv_cache_dtype)
    return config.num_hidden_layers * block_size * per_token


def num_kv_blocks(config: ModelConfig, block_size: int, dtype: torch.dtype, device: torch.device,
                  kv_cache_memory: float | None, max_num_seqs: int, max_model_len: int | None,
                  kv_cache_dtype: str = "auto") -> int:
    """How many KV-cache blocks to allocate: kv_cache_memory GiB when given, else enough for max_num_seqs
    sequences of max_model_len (or its default), at most DEFAULT_KV_CACHE_GIB for the device."""
    bytes_per_block = kv_block_bytes(config, block_size, dtype, kv_cache_dtype)
    if kv_cache_memory is not None:
        num_blocks = int(kv_cache_memory * GiB // bytes_per_block)
        if num_blocks < 1:
            raise EmberError(f"kv_cache_memory {kv_cache_memory} GiB holds no KV block "
                             f"({bytes_per_block} bytes each): raise it")
        return num_blocks
    needed = max_num_seqs * -(-(max_model_len or default_max_model_len(config)) // block_size)
    budget = int(DEFAULT_KV_CACHE_GIB.get(device.type, 1.0) * GiB // bytes_per_block)
    return max(1, min(needed, budget))


def resolve_max_model_len(config: ModelConfig, max_model_len: int | None, kv_capacity: int) -> int:
    """The longest prompt + completion served: max_model_len checked against the model and the KV cache's
    kv_capacity tokens, or by default default_max_model_len capped by the cache."""
    if max_model_len is None:
        return min(default_max_model_len(config), kv_capacity)
    model_max = config.max_position_embeddings
    if max_model_len > model_max:
        raise EmberError(f"max_model_len {max_model_len} exceeds the model's max_position_embeddings ({model_max})")
    if max_model_len > kv_capacity:
        raise EmberError(f"max_model_len {max_model_len} does not fit the KV cache ({kv_capacity} tokens): "
                         "raise kv_cache_memory or lower max_model_len")
    return max_model_len
