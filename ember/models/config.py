"""The model hyper-parameters Ember needs, read from a Hugging Face `config.json` (or built from GGUF metadata)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from ember.errors import ModelLoadError
from ember.kernels.cpu import auto_cpu_dtype, cpu_flags

logger = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
SUPPORTED_ROPE_TYPES = ("default", "llama3")

_DTYPE_NAMES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


def cpu_supports_bfloat16() -> bool:
    """True when this CPU computes bfloat16 natively (AVX512-BF16/AMX on x86, BF16 on Arm).

    Without it PyTorch emulates bfloat16 matmuls, which is several times slower than float32."""
    return auto_cpu_dtype_choice()[0] == torch.bfloat16


def onednn_supports_bfloat16() -> bool:
    """Whether oneDNN runs bfloat16 on this CPU at all (it emulates it on AVX-512 without AVX512-BF16)."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def auto_cpu_dtype_choice() -> tuple[torch.dtype, str]:
    """The dtype `--dtype auto` picks on this CPU, and why. x86-64 decides by its flags (ember/kernels/cpu.py):
    torch's own check only looks for AVX-512, which emulates bfloat16 on Ice Lake and older."""
    if cpu_flags():
        name, reason = auto_cpu_dtype(cpu_flags())
        return _DTYPE_NAMES[name], reason
    if onednn_supports_bfloat16():
        return torch.bfloat16, "not an x86-64 CPU, and oneDNN reports native bfloat16"
    return torch.float32, "not an x86-64 CPU with native bfloat16"


def dtype_reason(requested: str | torch.dtype, device: str | torch.device = "cpu") -> str:
    """Why `requested` resolves as it does on `device` (logged at start and reported by the server)."""
    if requested != "auto":
        return f"set by --dtype {str(requested).removeprefix('torch.')}"
    if torch.device(device).type == "cpu":
        return auto_cpu_dtype_choice()[1]
    return f"auto on {device}"


def resolve_dtype(dtype: str | torch.dtype, device: str | torch.device = "cpu") -> torch.dtype:
    """Turn `auto` / a dtype name into a torch.dtype for `device`; float16 on CPU is refused."""
    device_type = torch.device(device).type
    if isinstance(dtype, torch.dtype):
        resolved = dtype
    elif dtype == "auto":
        if device_type == "cpu":
            chosen, reason = auto_cpu_dtype_choice()
            logger.info("dtype auto: %s, as %s", str(chosen).removeprefix("torch."), reason)
            return chosen
        if device_type == "cuda" and torch.cuda.is_available() and not torch.cuda.is_bf16_supported():
            return torch.float16  # pre-Ampere GPUs
        return torch.bfloat16
    elif isinstance(dtype, str) and dtype.lower() in _DTYPE_NAMES:
        resolved = _DTYPE_NAMES[dtype.lower()]
    else:
        raise ModelLoadError(f"unsupported dtype {dtype!r}: use auto, float32 or bfloat16")
    if resolved not in (torch.float32, torch.bfloat16, torch.float16):
        raise ModelLoadError(f"unsupported dtype {resolved}: use auto, float32 or bfloat16")
    if resolved == torch.float16 and device_type == "cpu":
        raise ModelLoadError("float16 is not supported on CPU (it is hundreds of times slower there): "
                             "use float32 or bfloat16")
    return resolved


def token_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def _rope_settings(d: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) from either the classic keys or transformers 5's `rope_parameters`."""
    params = d.get("rope_parameters") or {}
    scaling = d.get("rope_scaling") or params or None
    theta = d.get("rope_theta", params.get("rope_theta", 10000.0))
    if scaling is not None:
        rope_type = scaling.get("rope_type", scaling.get("type", "default"))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ModelLoadError(f"rope scaling type {rope_type!r} is not supported "
                                 f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
        if rope_type == "default":
            scaling = None
        else:
            scaling = {k: v for k, v in scaling.items() if k not in ("type", "rope_theta")}
            scaling["rope_type"] = rope_type
    return float(theta), scaling


@dataclass
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    bos_token_id: int | None
    eos_token_ids: list[int]
    torch_dtype: torch.dtype

    @classmethod
    def from_hf_config(cls, d: dict[str, Any], dtype: str | torch.dtype = "auto",
                       device: str | torch.device = "cpu") -> ModelConfig:
        """Validate a Hugging Face config dict and keep what the Llama-family decoder needs.

        Raises ModelLoadError for architectures or features the decoder does not implement."""
        architectures = d.get("architectures") or []
        architecture = architectures[0] if architectures else None
        if architecture not in SUPPORTED_ARCHITECTURES:
            raise ModelLoadError(f"unsupported architecture {architecture!r} "
                                 f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
        hidden_act = d.get("hidden_act", "silu")
        if hidden_act != "silu":
            raise ModelLoadError(f"unsupported activation {hidden_act!r} for {architecture} (only silu)")
        if d.get("mlp_bias"):
            raise ModelLoadError(f"{architecture} with mlp_bias=true is not supported")
        try:
            hidden_size = int(d["hidden_size"])
            num_heads = int(d["num_attention_heads"])
            rope_theta, rope_scaling = _rope_settings(d)
            max_positions = int(d.get("max_position_embeddings", 2048))
            max_positions = _clamp_to_sliding_window(d, architecture, max_positions)
            return cls(
                architecture=architecture,
                vocab_size=int(d["vocab_size"]),
                hidden_size=hidden_size,
                intermediate_size=int(d["intermediate_size"]),
                num_hidden_layers=int(d["num_hidden_layers"]),
                num_attention_heads=num_heads,
                num_key_value_heads=int(d.get("num_key_value_heads") or num_heads),
                head_dim=int(d.get("head_dim") or hidden_size // num_heads),
                rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
                rope_theta=rope_theta,
                rope_scaling=rope_scaling,
                max_position_embeddings=max_positions,
                tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
                attention_bias=architecture == "Qwen2ForCausalLM" or bool(d.get("attention_bias", False)),
                bos_token_id=d.get("bos_token_id"),
                eos_token_ids=token_id_list(d.get("eos_token_id")),
                torch_dtype=resolve_dtype(dtype, device),
            )
        except KeyError as exc:
            raise ModelLoadError(f"config for {architecture} lacks the required field {exc.args[0]!r}") from None
        except (TypeError, ValueError) as exc:
            raise ModelLoadError(f"invalid config for {architecture}: {exc}") from None


def _clamp_to_sliding_window(d: dict[str, Any], architecture: str, max_positions: int) -> int:
    """The decoder attends to the whole context. A model trained with a sliding window gives the same
    outputs as long as the context never exceeds the window, so the context is capped there."""
    window = d.get("sliding_window")
    uses_window = d.get("use_sliding_window", architecture == "MistralForCausalLM")
    if not uses_window or not window or int(window) >= max_positions:
        return max_positions
    logger.warning("%s uses sliding-window attention (window %d), which Ember does not implement: "
                   "limiting the context to %d tokens, where full attention is identical",
                   architecture, window, window)
    return int(window)
