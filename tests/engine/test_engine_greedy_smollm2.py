"""Greedy decoding of the real SmolLM2-135M (Ember's GGUF loader, float32) is token-identical to
transformers running the same GGUF in float32, for 16 prompts of different lengths in one batch,
and again when the second pass is served from the prefix cache."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ember import LLM, SamplingParams

MAX_NEW = 10
SHARED = "You are a helpful assistant. Answer briefly and precisely. "
TEXTS = [
    "The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far away,", "1, 2, 3, 4,",
    "The best way to learn a language is", "Water boils at", "import numpy as np\n", "My favourite colour is",
    "Q: What is the largest planet in the solar system?\nA:", "The quick brown fox",
    "In 1492, Columbus", "Photosynthesis is the process by which plants",
    "SELECT name FROM users WHERE", "Dear Sir or Madam, I am writing to",
    "The three primary colours are red,", "To make a cup of tea, first",
]


@pytest.fixture(scope="module")
def hf_smollm2(smollm2_gguf_path: Path):
    """transformers' model built by its own GGUF loading code (from_pretrained(gguf_file=...) would also
    demand the accelerate package, so its loader function is called directly)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = AutoConfig.from_pretrained(smollm2_gguf_path.parent, gguf_file=smollm2_gguf_path.name)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    tensors = load_gguf_checkpoint(smollm2_gguf_path, return_tensors=True, model_to_load=model,
                                   torch_dtype=torch.float32)["tensors"]
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}  # tied to the embeddings
    model.tie_weights()
    model.generation_config.eos_token_id = None  # run to MAX_NEW like ignore_eos
    return model


@pytest.mark.slow
def test_smollm2_greedy_batch_matches_transformers(smollm2_gguf_path, hf_smollm2, run_checked):
    # The weights dequantized at load, as transformers does (quantization auto would read the blocks in decodes).
    llm = LLM(str(smollm2_gguf_path), dtype="float32", num_threads=1, quantization="none")
    engine = llm.engine
    tokenizer = llm.get_tokenizer()
    prompts = [tokenizer.encode(SHARED + text) for text in TEXTS]
    assert len({len(p) for p in prompts}) >= 8
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    references = []
    with torch.inference_mode():
        for prompt in prompts:
            out = hf_smollm2.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt)),
                                      max_new_tokens=MAX_NEW, do_sample=False, pad_token_id=0)
            references.append(out[0, len(prompt):].tolist())
    for round_ in ("cold", "cached"):
        for i, prompt in enumerate(prompts):
            engine.add_request(f"{round_}{i}", prompt, params)
        finals = run_checked(engine)
        for i, reference in enumerate(references):
            assert finals[f"{round_}{i}"].outputs[0].token_ids == reference, f"{round_} prompt {i}: {TEXTS[i]!r}"
    # The second round reuses every full block of every prompt.
    assert [finals[f"cached{i}"].num_cached_tokens for i in range(len(prompts))] == [
        (len(p) - 1) // 16 * 16 for p in prompts]
    assert engine.stats().prefix_cache_hits >= sum((len(p) - 1) // 16 * 16 for p in prompts)
