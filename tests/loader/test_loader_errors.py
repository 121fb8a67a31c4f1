"""Every bad input gives a ModelLoadError whose message names the problem."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType

from ember.errors import ModelLoadError
from ember.loader import load_model, resolve_model
from ember.models.config import ModelConfig, cpu_supports_bfloat16, resolve_dtype


def _copy_folder(source: Path, target: Path) -> Path:
    shutil.copytree(source, target)
    return target


def _edit_config(folder: Path, **changes) -> None:
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **changes}))


def test_missing_path(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"model '.*nope\.gguf' not found: no such file or folder"):
        load_model(tmp_path / "nope.gguf")
    with pytest.raises(ModelLoadError, match=r"model 'no-such-model' not found.*known: smollm2-135m-instruct"):
        load_model("no-such-model")


def test_folder_without_config_or_weights(tiny_model_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="is not a model folder: no config.json"):
        load_model(tmp_path)
    folder = _copy_folder(tiny_model_dir, tmp_path / "model")
    (folder / "model.safetensors").rename(folder / "pytorch_model.bin")
    with pytest.raises(ModelLoadError, match=r"no \*\.safetensors weights \(found pytorch_model\.bin"):
        load_model(folder)


def test_file_that_is_not_a_model(tmp_path: Path) -> None:
    path = tmp_path / "weights.txt"
    path.write_text("hello")
    with pytest.raises(ModelLoadError, match="not a model folder or a .gguf file"):
        load_model(path)


def test_unsupported_architecture(tiny_model_dir: Path, tmp_path: Path, gguf_writer) -> None:
    folder = _copy_folder(tiny_model_dir, tmp_path / "model")
    _edit_config(folder, architectures=["GPT2LMHeadModel"])
    with pytest.raises(ModelLoadError, match=r"unsupported architecture 'GPT2LMHeadModel' \(supported: Llama"):
        load_model(folder)
    with pytest.raises(ModelLoadError, match="unsupported GGUF architecture 'phi3'"):
        load_model(gguf_writer(arch="phi3").path)


def test_unsupported_config_features(tiny_model_dir: Path, tmp_path: Path) -> None:
    base = json.loads((tiny_model_dir / "config.json").read_text())
    with pytest.raises(ModelLoadError, match="rope scaling type 'yarn' is not supported"):
        ModelConfig.from_hf_config({**base, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    with pytest.raises(ModelLoadError, match="unsupported activation 'gelu'"):
        ModelConfig.from_hf_config({**base, "hidden_act": "gelu"})
    with pytest.raises(ModelLoadError, match="lacks the required field 'hidden_size'"):
        ModelConfig.from_hf_config({k: v for k, v in base.items() if k != "hidden_size"})


def test_dtype_choices(tiny_model_dir: Path) -> None:
    native_bf16 = cpu_supports_bfloat16()
    assert resolve_dtype("auto") == (torch.bfloat16 if native_bf16 else torch.float32)
    assert load_model(tiny_model_dir).config.torch_dtype == resolve_dtype("auto")
    assert resolve_dtype("bf16") == torch.bfloat16 and resolve_dtype("float32") == torch.float32
    with pytest.raises(ModelLoadError, match="float16 is not supported on CPU"):
        load_model(tiny_model_dir, dtype="float16")
    with pytest.raises(ModelLoadError, match="unsupported dtype 'int8'"):
        load_model(tiny_model_dir, dtype="int8")


def test_unsupported_quant_type(gguf_writer) -> None:
    tiny = gguf_writer(qtype_overrides={"blk.1.ffn_up.weight": GGMLQuantizationType.Q8_1})
    with pytest.raises(ModelLoadError, match="tensor blk.1.ffn_up.weight uses quantization type Q8_1"):
        load_model(tiny.path)


def test_unsupported_tokenizer_model(gguf_writer) -> None:
    with pytest.raises(ModelLoadError, match="GGUF tokenizer model 'bert' is not supported"):
        load_model(gguf_writer(tokenizer_model="bert").path)


@pytest.mark.parametrize("keep_fraction", [0.0, 0.001, 0.3, 0.9, 0.999])
def test_truncated_gguf(gguf_writer, keep_fraction: float) -> None:
    path = gguf_writer().path
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep_fraction)])
    with pytest.raises(ModelLoadError, match="not a valid GGUF file, corrupt or truncated"):
        load_model(path)


def test_garbage_gguf(tmp_path: Path) -> None:
    path = tmp_path / "model.gguf"
    path.write_bytes(b"not a gguf file at all" * 100)
    with pytest.raises(ModelLoadError, match=r"not a valid GGUF file.*magic"):
        load_model(path)


def test_missing_and_misshapen_tensors(gguf_writer, tiny_model_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="missing tensor model.layers.1.mlp.up_proj.weight"):
        load_model(gguf_writer("dropped.gguf", drop=("blk.1.ffn_up.weight",)).path)
    with pytest.raises(ModelLoadError, match=r"tensor model.layers.0.mlp.gate_proj.weight has shape \(128, 64\), "
                                             r"expected \(96, 64\)"):
        load_model(gguf_writer("misshapen.gguf", intermediate_in_metadata=96).path)
    folder = _copy_folder(tiny_model_dir, tmp_path / "model")
    _edit_config(folder, num_hidden_layers=3)
    with pytest.raises(ModelLoadError, match="missing tensors model.layers.2.input_layernorm.weight"):
        load_model(folder)


def test_split_gguf(tmp_path: Path) -> None:
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(tmp_path / "model.gguf", "llama", split_max_tensors=1)
    writer.add_tensor("a.weight", np.zeros(4, dtype=np.float32))
    writer.add_tensor("b.weight", np.zeros(4, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    first = tmp_path / "model-00001-of-00002.gguf"
    with pytest.raises(ModelLoadError, match="is part 1 of a GGUF split into 2 files"):
        load_model(first)


def test_local_path_wins_over_alias(tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    shutil.copytree(tiny_model_dir, tmp_path / "SmolLM2-135M-Instruct")
    monkeypatch.chdir(tmp_path)
    assert resolve_model("SmolLM2-135M-Instruct") == tmp_path / "SmolLM2-135M-Instruct"
    assert resolve_model("smollm2-135m-instruct").suffix == ".gguf"
