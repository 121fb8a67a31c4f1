"""Model id/path -> LoadedModel: config, Hugging Face-named tensors in the target dtype, tokenizer."""

from __future__ import annotations

from pathlib import Path

import torch

from ember.errors import ModelLoadError
from ember.loader.loaded_model import LoadedModel
from ember.loader.resolve import resolve_model
from ember.loader.tokenizer import Tokenizer

__all__ = ["LoadedModel", "Tokenizer", "load_model", "load_tokenizer", "resolve_model"]


def load_model(model: str | Path, dtype: str | torch.dtype = "auto",
               device: str | torch.device = "cpu", quantization: str = "none") -> LoadedModel:
    """Load an alias (smollm2-135m-instruct), a Hugging Face folder or a .gguf file.

    `device` only decides what dtype "auto" means; tensors are returned on the CPU. quantization "gguf"
    keeps a GGUF file's Q8_0/Q4_0/Q4_1/Q5_0/Q5_1/Q4_K/Q5_K/Q6_K Linear weights in their blocks
    (ember/loader/gguf.py); it needs a .gguf file. "auto" keeps them too where the file is a .gguf one (the model
    runner adds their dequantized weights). Raises ModelLoadError with a message naming the problem on any bad input."""
    path = resolve_model(model)
    if quantization == "gguf" and path.suffix.lower() != ".gguf":
        raise ModelLoadError(f"--quantization gguf keeps a GGUF file's quantized blocks, and {path} is not a .gguf "
                             f"file; use --quantization int8 to quantize its weights at load")
    if path.is_dir():
        from ember.loader.hf import load_hf_folder

        return load_hf_folder(path, dtype=dtype, device=device)
    if path.suffix.lower() == ".gguf":
        from ember.loader.gguf import load_gguf

        return load_gguf(path, dtype=dtype, device=device, quantization=quantization)
    raise ModelLoadError(f"{path}: not a model folder or a .gguf file")


def load_tokenizer(model: str | Path) -> Tokenizer:
    """Only the tokenizer (and chat template) of a model, without reading its weights."""
    path = resolve_model(model)
    if path.is_dir():
        from ember.loader.hf import load_hf_folder_tokenizer

        return load_hf_folder_tokenizer(path)
    if path.suffix.lower() == ".gguf":
        from ember.loader.gguf import load_gguf_tokenizer

        return load_gguf_tokenizer(path)
    raise ModelLoadError(f"{path}: not a model folder or a .gguf file")
