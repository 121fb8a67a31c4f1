"""Opening GGUF files with the `gguf` package's reader, with clear errors and faster metadata parsing."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFReader

from ember.errors import ModelLoadError


class _GGUFReader(GGUFReader):
    """GGUFReader over a plain ndarray view of its memory map.

    The reader slices its buffer once per metadata string (~100k for a BPE vocabulary); slicing an
    np.memmap runs Python-level hooks each time, which makes parsing several times slower than on an ndarray."""

    @property
    def data(self) -> np.ndarray:
        return self._buffer

    @data.setter
    def data(self, value: np.ndarray) -> None:
        self._buffer = value.view(np.ndarray)


def open_gguf(path: Path) -> GGUFReader:
    try:
        return _GGUFReader(path)
    except (ValueError, IndexError, KeyError, TypeError, OverflowError, OSError) as exc:
        # The reader reports truncation and garbage as low-level numpy errors.
        raise ModelLoadError(f"{path}: not a valid GGUF file, corrupt or truncated ({exc})") from None


def metadata_value(reader: GGUFReader, key: str, default: Any = None) -> Any:
    field = reader.get_field(key)
    return default if field is None else field.contents()
