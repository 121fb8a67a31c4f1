"""Load a Hugging Face model folder: config.json, *.safetensors (sharded too; tensors read when asked for,
whole or by rows or columns), tokenizer files."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import tokenizers
import torch
from safetensors import SafetensorError, safe_open

from ember.errors import ModelLoadError
from ember.loader.lazy_weights import LazyStateDict
from ember.loader.loaded_model import LoadedModel
from ember.loader.tokenizer import Tokenizer
from ember.loader.weights import check_state_dict
from ember.models.config import ModelConfig, token_id_list

_SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")


def _read_json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}") from None
    if not isinstance(value, dict):
        raise ModelLoadError(f"cannot read {path}: expected a JSON object")
    return value


def _weight_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelLoadError(f"{index} has no weight_map")
        files = [folder / name for name in dict.fromkeys(weight_map.values())]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"{folder}: shard{'s' if len(missing) > 1 else ''} {', '.join(missing)} "
                                 f"listed in model.safetensors.index.json {'are' if len(missing) > 1 else 'is'} missing")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        other = sorted(p.name for p in folder.glob("*.bin")) + sorted(p.name for p in folder.glob("*.pt*"))
        hint = f" (found {', '.join(other)}: only safetensors weights are supported)" if other else ""
        raise ModelLoadError(f"{folder}: no *.safetensors weights{hint}")
    return files


class SafetensorsTensor:
    """A tensor of a memory-mapped safetensors file; get_slice copies out only the indexed bytes."""

    def __init__(self, handle: Any, name: str, path: Path) -> None:
        self.handle, self.name, self.path = handle, name, path
        self.shape = tuple(handle.get_slice(name).get_shape())

    def read(self, dim: int, start: int, length: int) -> torch.Tensor:
        rows = slice(start, start + length)
        try:
            return self.handle.get_slice(self.name)[rows if dim == 0 else (slice(None), rows)]
        except (SafetensorError, OSError) as exc:
            raise ModelLoadError(f"cannot read weights {self.path}: {exc}") from None


def safetensors_sources(files: list[Path]) -> dict[str, SafetensorsTensor]:
    """Every tensor of `files`, by name, not yet read."""
    sources: dict[str, SafetensorsTensor] = {}
    for file in files:
        try:
            handle = safe_open(file, framework="pt")  # open while its tensors may be read
            sources |= {name: SafetensorsTensor(handle, name, file) for name in handle.keys()}
        except (SafetensorError, OSError) as exc:
            raise ModelLoadError(f"cannot read weights {file}: {exc}") from None
    return sources


def _special_tokens(tokenizer_config: dict[str, Any]) -> dict[str, str | None]:
    tokens: dict[str, str | None] = {}
    for name in _SPECIAL_TOKEN_NAMES:
        value = tokenizer_config.get(name)
        tokens[name] = value.get("content") if isinstance(value, dict) else value
    return tokens


def _chat_template(folder: Path, tokenizer_config: dict[str, Any]) -> str | None:
    """As transformers: chat_template.jinja wins over the template inside tokenizer_config.json."""
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = tokenizer_config.get("chat_template")
    if template is None and (folder / "chat_template.json").is_file():
        template = _read_json(folder / "chat_template.json").get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def _special_token_ids(folder: Path, config: dict[str, Any]) -> tuple[int | None, list[int]]:
    """(bos id, eos ids) from config.json plus generation_config.json, whose eos list is what generate() stops on."""
    generation_file = folder / "generation_config.json"
    generation = _read_json(generation_file) if generation_file.is_file() else {}
    eos = token_id_list(config.get("eos_token_id")) + token_id_list(generation.get("eos_token_id"))
    bos = config.get("bos_token_id", generation.get("bos_token_id"))
    return bos, list(dict.fromkeys(eos))


def load_hf_folder_tokenizer(folder: Path) -> Tokenizer:
    """Only the tokenizer of a Hugging Face folder (config.json, if present, supplies bos/eos ids)."""
    config_file = folder / "config.json"
    bos_token_id, eos_token_ids = _special_token_ids(folder, _read_json(config_file) if config_file.is_file() else {})
    return load_hf_tokenizer(folder, eos_token_ids, bos_token_id)


def load_hf_tokenizer(folder: Path, eos_token_ids: list[int], bos_token_id: int | None) -> Tokenizer:
    tokenizer_file = folder / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise ModelLoadError(f"{folder}: no tokenizer.json (only fast tokenizers are supported)")
    try:
        hf_tokenizer = tokenizers.Tokenizer.from_file(str(tokenizer_file))
    except Exception as exc:  # tokenizers raises a bare Exception on malformed files
        raise ModelLoadError(f"cannot read {tokenizer_file}: {exc}") from None
    config_file = folder / "tokenizer_config.json"
    tokenizer_config = _read_json(config_file) if config_file.is_file() else {}
    special = _special_tokens(tokenizer_config)
    if bos_token_id is None and special["bos_token"] is not None:
        bos_token_id = hf_tokenizer.token_to_id(special["bos_token"])
    if not eos_token_ids and special["eos_token"] is not None:
        eos_id = hf_tokenizer.token_to_id(special["eos_token"])
        eos_token_ids = [eos_id] if eos_id is not None else []
    return Tokenizer(hf_tokenizer, eos_token_ids=eos_token_ids, bos_token_id=bos_token_id,
                     special_tokens=special, chat_template=_chat_template(folder, tokenizer_config))


def load_hf_folder(folder: Path, dtype: str | torch.dtype = "auto", device: str | torch.device = "cpu") -> LoadedModel:
    config_file = folder / "config.json"
    if not config_file.is_file():
        ggufs = sorted(p.name for p in folder.glob("*.gguf"))
        hint = f" (it holds {', '.join(ggufs)}: pass that file instead)" if ggufs else ""
        raise ModelLoadError(f"{folder} is not a model folder: no config.json{hint}")
    config_dict = _read_json(config_file)
    config = ModelConfig.from_hf_config(config_dict, dtype=dtype, device=device)
    bos_token_id, eos_token_ids = _special_token_ids(folder, config_dict)
    tokenizer = load_hf_tokenizer(folder, eos_token_ids, bos_token_id)
    config = replace(config, bos_token_id=bos_token_id, eos_token_ids=list(tokenizer.eos_token_ids))
    sources = check_state_dict(config, safetensors_sources(_weight_files(folder)), str(folder))
    state_dict = LazyStateDict(sources, config.torch_dtype)
    return LoadedModel(config=config, state_dict=state_dict, tokenizer=tokenizer, source=str(folder))

