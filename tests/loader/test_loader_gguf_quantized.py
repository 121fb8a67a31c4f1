"""quantization="gguf": a GGUF file's Q8_0/Q4_0/Q4_1/Q5_0/Q5_1/Q4_K/Q5_K/Q6_K Linear weights come out in their
blocks (rows in Hugging Face order, a tied output layer from the embedding's blocks), everything else dequantized as without it; and
a tiny model with a mix of block and float types in one fused projection runs through the engine."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType

from ember import LLM, SamplingParams
from ember.errors import ModelLoadError
from ember.kernels.build import compiler
from ember.kernels.cpu import cpu_isa_level, level_at_least
from ember.kernels.quantized_weight import cat_rows
from ember.loader import load_model


@pytest.mark.parametrize("tied", [True, False])
def test_block_types_stay_quantized_and_dequantize_to_the_files_values(gguf_writer, tied: bool) -> None:
    tiny = gguf_writer(
        tied=tied,
        qtype_overrides={
            "token_embd.weight": GGMLQuantizationType.Q8_0,
            "output.weight": GGMLQuantizationType.Q4_1,
        },
    )
    loaded = load_model(tiny.path, dtype="float32", quantization="gguf")
    expected = dict(tiny.expected)
    if tied:  # the output layer is the embedding's blocks
        expected["lm_head.weight"] = expected["model.embed_tokens.weight"]
    assert sorted(loaded.state_dict) == sorted(expected)
    formats = {}
    for name in loaded.state_dict:
        quantized = loaded.state_dict.quantized(name)
        if quantized is not None:
            formats[name] = quantized.format
            assert tuple(quantized.shape) == tuple(expected[name].shape), name
            assert torch.equal(quantized.dequantize(), expected[name]), name
        else:
            assert torch.equal(loaded.state_dict[name], expected[name]), name
    assert formats["lm_head.weight"] == ("q8_0" if tied else "q4_1")
    assert loaded.state_dict.quantized("model.embed_tokens.weight") is None
    # Q8_0, Q4_0 and Q4_1 cycle over the file's 2-D tensors (with F16, BF16 and F32): each is here, q and k
    # rows un-permuted inside the blocks.
    assert set(formats.values()) == {"q8_0", "q4_0", "q4_1"}
    assert any(".q_proj." in name or ".k_proj." in name for name in formats)


FIVE_BIT = {"attn_q": GGMLQuantizationType.Q5_0, "attn_k": GGMLQuantizationType.Q5_0,
            "attn_v": GGMLQuantizationType.Q5_0, "ffn_up": GGMLQuantizationType.Q5_1,
            "ffn_gate": GGMLQuantizationType.Q5_1}


def test_five_bit_blocks_stay_quantized_with_the_files_values(gguf_writer) -> None:
    """Q5_0 and Q5_1 (llama.cpp's Q4_K_M and Q5_K_M fall back to them for rows that are not whole super-blocks)
    stay in their 5-bit form, which dequantizes to the file's weights exactly; q, k and v of Q5_0 fuse into one
    q5_0 weight, gate and up into one q5_1."""
    tiny = gguf_writer(qtype_overrides={f"blk.{i}.{linear}.weight": qtype
                                        for i in range(2) for linear, qtype in FIVE_BIT.items()})
    loaded = load_model(tiny.path, dtype="float32", quantization="gguf")
    for i in range(2):
        for part, p, format in (("self_attn", "q", "q5_0"), ("self_attn", "k", "q5_0"), ("self_attn", "v", "q5_0"),
                                ("mlp", "up", "q5_1"), ("mlp", "gate", "q5_1")):
            name = f"model.layers.{i}.{part}.{p}_proj.weight"
            weight = loaded.state_dict.quantized(name)
            assert weight is not None and weight.format == format, name
            assert torch.equal(weight.dequantize(), tiny.expected[name]), name


def test_q5_0_rows_fused_with_q8_0_rows_take_q8_0s_form(gguf_writer) -> None:
    """A Q4_K_M file's q and k in Q5_0 beside a v in Q8_0 (its fallback for Q6_K): the fused projection is one q8_0
    weight holding the same values (q - 16), not a dequantized one."""
    tiny = gguf_writer(qtype_overrides={"blk.0.attn_q.weight": GGMLQuantizationType.Q5_0,
                                        "blk.0.attn_k.weight": GGMLQuantizationType.Q5_0,
                                        "blk.0.attn_v.weight": GGMLQuantizationType.Q8_0})
    loaded = load_model(tiny.path, dtype="float32", quantization="gguf")
    names = [f"model.layers.0.self_attn.{p}_proj.weight" for p in "qkv"]
    parts = [loaded.state_dict.quantized(name) for name in names]
    assert [part.format for part in parts] == ["q5_0", "q5_0", "q8_0"]
    fused = cat_rows(parts, torch.float32)
    assert fused.format == "q8_0"
    assert torch.equal(fused.dequantize(), torch.cat([tiny.expected[name] for name in names]))


def test_gguf_quantization_needs_a_gguf_file(tiny_model_dir) -> None:
    with pytest.raises(ModelLoadError, match="not a .gguf file; use --quantization int8"):
        load_model(tiny_model_dir, quantization="gguf")


def gguf_scores_the_prompt_as_none(path: Path) -> str:
    """Generates 8 tokens with quantization gguf and checks its prompt's scores against the dequantized model's
    (quantization none): a prompt of more rows than the decode kernel takes is scored with the weights
    dequantized. Returns gguf's GEMM kernel path."""
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, prompt_logprobs=0)
    outputs = {}
    for quantization in ("none", "gguf"):
        llm = LLM(str(path), dtype="float32", quantization=quantization, num_threads=1)
        outputs[quantization] = llm.generate(["hello world! " * 12], params)[0]
    assert len(outputs["gguf"].outputs[0].token_ids) == 8
    reference, quantized = (output.prompt_logprobs[1:] for output in outputs.values())
    assert len(reference) > 16
    for expected, got in zip(reference, quantized, strict=True):
        assert got.keys() == expected.keys()
        for token, logprob in expected.items():
            # float32 sums in another order (another GEMM, another ISA level) differ by ~1e-6 relative, which
            # on an unlikely token's logprob of -50 is more than 1e-4.
            assert got[token].logprob == pytest.approx(logprob.logprob, rel=1e-5, abs=1e-4)
    return llm.engine.runner.kernel_paths["gemm"]


@pytest.mark.skipif(
    compiler() is None or not level_at_least(cpu_isa_level(), "avx2"),
    reason="quantized weights need a C compiler and AVX2",
)
def test_mixed_types_in_one_projection_run_in_the_engine(gguf_writer) -> None:
    gemm = gguf_scores_the_prompt_as_none(gguf_writer().path)
    # Some fused projections mix block and float types: those are dequantized, the rest run quantized.
    assert gemm.startswith("native_quant_") and "float Linear(s)" in gemm, gemm


Q4_K_DIMS = dict(hidden=256, intermediate=512, heads=4, kv_heads=2)  # K-quant rows: whole super-blocks of 256


@pytest.mark.skipif(
    compiler() is None or not level_at_least(cpu_isa_level(), "avx2"),
    reason="quantized weights need a C compiler and AVX2",
)
def test_k_quant_blocks_stay_quantized_and_run_in_the_engine(gguf_writer) -> None:
    """A file of Q4_K_M's mix (Q6_K attn_v and ffn_down, Q4_K the other Linears): kept in their super-blocks,
    which dequantize to gguf's own values; decode steps run them in the GEMV, and a prompt of more rows than it
    takes is scored with the weights dequantized by the kernels: the dequantized model's scores."""
    six_bit = ("attn_v", "ffn_down")
    layer_linears = ("attn_q", "attn_k", "attn_output", "ffn_gate", "ffn_up", *six_bit)
    tiny = gguf_writer(dims=Q4_K_DIMS, qtype_overrides={
        f"blk.{i}.{linear}.weight": GGMLQuantizationType.Q6_K if linear in six_bit else GGMLQuantizationType.Q4_K
        for i in range(2) for linear in layer_linears
    })
    loaded = load_model(tiny.path, dtype="float32", quantization="gguf")
    formats = {name: w.format for name in loaded.state_dict if (w := loaded.state_dict.quantized(name))}
    assert sorted(formats.values()).count("q4_k") == 2 * 5 and sorted(formats.values()).count("q6_k") == 2 * 2
    for name, format in formats.items():
        if format in ("q4_k", "q6_k"):
            assert torch.equal(loaded.state_dict.quantized(name).dequantize(), tiny.expected[name]), name
    gemm = gguf_scores_the_prompt_as_none(tiny.path)
    assert gemm.startswith("native_quant_") and "q4_k+q6_k" in gemm and "float Linear" not in gemm, gemm


@pytest.mark.skipif(
    compiler() is None or not level_at_least(cpu_isa_level(), "avx2"),
    reason="quantized weights need a C compiler and AVX2",
)
def test_five_bit_blocks_run_in_the_engine(gguf_writer) -> None:
    """Q5_0 and Q5_1 Linears (the rest Q8_0) run quantized in the engine, every one of them: decode steps in the
    GEMV, a long prompt on the dequantized weights, scored as the dequantized model scores it."""
    linears = {**FIVE_BIT, "attn_output": GGMLQuantizationType.Q5_1, "ffn_down": GGMLQuantizationType.Q5_0}
    tiny = gguf_writer(qtype_overrides={f"blk.{i}.{linear}.weight": qtype
                                        for i in range(2) for linear, qtype in linears.items()})
    gemm = gguf_scores_the_prompt_as_none(tiny.path)
    assert gemm.startswith("native_quant_") and "q5_0" in gemm and "q5_1" in gemm, gemm
    assert "float Linear" not in gemm, gemm


@pytest.mark.skipif(
    compiler() is None or not level_at_least(cpu_isa_level(), "avx2"),
    reason="quantized weights need a C compiler and AVX2",
)
def test_a_q5_k_m_mix_stays_quantized_and_runs_in_the_engine(gguf_writer) -> None:
    """llama.cpp's Q5_K_M mix where rows are not whole super-blocks: Q5_1 q, k, o, gate and up, v in Q8_0 (its
    fallback for Q6_K), Q5_K ffn_down: q, k and v fuse into one q8_0_min weight, ffn_down stays q5_k (both
    dequantizing to the file's values), and every Linear runs quantized, scored as the dequantized model."""
    linears = {"attn_q": GGMLQuantizationType.Q5_1, "attn_k": GGMLQuantizationType.Q5_1,
               "attn_v": GGMLQuantizationType.Q8_0, "attn_output": GGMLQuantizationType.Q5_1,
               "ffn_gate": GGMLQuantizationType.Q5_1, "ffn_up": GGMLQuantizationType.Q5_1,
               "ffn_down": GGMLQuantizationType.Q5_K}
    tiny = gguf_writer(dims=Q4_K_DIMS, qtype_overrides={f"blk.{i}.{linear}.weight": qtype
                                                        for i in range(2) for linear, qtype in linears.items()})
    loaded = load_model(tiny.path, dtype="float32", quantization="gguf")
    down = loaded.state_dict.quantized("model.layers.0.mlp.down_proj.weight")
    assert down.format == "q5_k" and torch.equal(down.dequantize(), tiny.expected["model.layers.0.mlp.down_proj.weight"])
    names = [f"model.layers.0.self_attn.{p}_proj.weight" for p in "qkv"]
    fused = cat_rows([loaded.state_dict.quantized(name) for name in names], torch.float32)
    assert fused.format == "q8_0_min"
    assert torch.equal(fused.dequantize(), torch.cat([tiny.expected[name] for name in names]))
    gemm = gguf_scores_the_prompt_as_none(tiny.path)
    assert "q5_1" in gemm and "q5_k" in gemm and "q8_0_min" in gemm and "float Linear" not in gemm, gemm
