"""The tensors a Llama-family checkpoint must hold, by Hugging Face name, and checks against them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, TypeVar

from ember.errors import ModelLoadError
from ember.loader.lazy_weights import QuantizedSource
from ember.models.config import ModelConfig

# Old checkpoints store RoPE's inverse frequencies; the decoder computes its own.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    hidden, inter = config.hidden_size, config.intermediate_size
    q_size = config.num_attention_heads * config.head_dim
    kv_size = config.num_key_value_heads * config.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config.vocab_size, hidden),
                                          "model.norm.weight": (hidden,)}
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, hidden)
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (hidden,),
            p + "post_attention_layernorm.weight": (hidden,),
            p + "self_attn.q_proj.weight": (q_size, hidden),
            p + "self_attn.k_proj.weight": (kv_size, hidden),
            p + "self_attn.v_proj.weight": (kv_size, hidden),
            p + "self_attn.o_proj.weight": (hidden, q_size),
            p + "mlp.gate_proj.weight": (inter, hidden),
            p + "mlp.up_proj.weight": (inter, hidden),
            p + "mlp.down_proj.weight": (hidden, inter),
        }
        if config.attention_bias:
            shapes |= {p + "self_attn.q_proj.bias": (q_size,), p + "self_attn.k_proj.bias": (kv_size,),
                       p + "self_attn.v_proj.bias": (kv_size,)}
            # Llama's attention_bias also puts a bias on o_proj; Qwen2's q/k/v biases do not.
            if config.architecture != "Qwen2ForCausalLM":
                shapes[p + "self_attn.o_proj.bias"] = (hidden,)
    return shapes


class Shaped(Protocol):
    @property
    def shape(self) -> Sequence[int]: ...


TensorLike = TypeVar("TensorLike", bound=Shaped)


def check_state_dict(config: ModelConfig, state_dict: dict[str, TensorLike], source: str) -> dict[str, TensorLike]:
    """Drop tensors the decoder ignores; raise ModelLoadError naming any missing, unexpected or misshapen one.
    Only shapes are looked at: the tensors may be unread checkpoint sources."""
    expected = expected_shapes(config)
    state_dict = {k: v for k, v in state_dict.items() if not k.endswith(_IGNORED_SUFFIXES)}
    if config.tie_word_embeddings:
        if isinstance(state_dict.get("lm_head.weight"), QuantizedSource):
            # A quantized GGUF's tied output layer, from the embedding's blocks (ember/loader/gguf.py).
            expected["lm_head.weight"] = (config.vocab_size, config.hidden_size)
        else:
            # Some tied checkpoints also store a copy of the embedding as lm_head; transformers ignores it.
            state_dict.pop("lm_head.weight", None)
    missing = [name for name in expected if name not in state_dict]
    if missing:
        raise ModelLoadError(f"{source}: missing tensor{'s' if len(missing) > 1 else ''} "
                             f"{', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}")
    unexpected = [name for name in state_dict if name not in expected]
    if unexpected:
        raise ModelLoadError(f"{source}: unexpected tensor{'s' if len(unexpected) > 1 else ''} "
                             f"{', '.join(unexpected[:5])}{' ...' if len(unexpected) > 5 else ''} "
                             f"for {config.architecture}")
    for name, shape in expected.items():
        if tuple(state_dict[name].shape) != shape:
            raise ModelLoadError(f"{source}: tensor {name} has shape {tuple(state_dict[name].shape)}, "
                                 f"expected {shape} from the config")
    return state_dict
