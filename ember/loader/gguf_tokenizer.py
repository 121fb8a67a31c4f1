"""Rebuild a byte-level BPE `tokenizers.Tokenizer` (and chat template) from a GGUF file's tokenizer metadata.

A GGUF carries no tokenizer.json, only llama.cpp's `tokenizer.ggml.*` keys: the vocabulary, merges,
per-token types and special ids. The result matches what transformers builds from the same file."""

from __future__ import annotations

from functools import cache
from pathlib import Path

import tokenizers
from gguf import GGUFReader
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors

from ember.errors import ModelLoadError
from ember.loader.gguf_reader import metadata_value
from ember.loader.tokenizer import Tokenizer

# llama.cpp token types (tokenizer.ggml.token_type)
_CONTROL = 3
_USER_DEFINED = 4

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre -> the split regex its merges were learned with; others use GPT-2's built-in regex.
_PRE_TOKENIZER_SPLITS = {
    "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT, "smaug-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT,
}


@cache
def _byte_spelling() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map that byte-level BPE vocabularies are written in."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    spelling = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in spelling:
            spelling[b] = chr(256 + extra)
            extra += 1
    return spelling


def _byte_level_bpe(tokens: list[str], merges: list[str], pre: str | None) -> tokenizers.Tokenizer:
    alphabet = set(_byte_spelling().values())
    spelling = _byte_spelling()
    # A few files store tokens such as runs of spaces as raw text; respell them in the byte alphabet.
    vocab = {token if set(token) <= alphabet else "".join(spelling[b] for b in token.encode("utf-8")): index
             for index, token in enumerate(tokens)}
    bpe = models.BPE(vocab=vocab, merges=[tuple(merge.split(" ")) for merge in merges], dropout=None,
                     continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False)
    tokenizer = tokenizers.Tokenizer(bpe)
    split = _PRE_TOKENIZER_SPLITS.get(pre)
    if split is None:
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _post_processor(bos: tuple[str, int] | None, eos: tuple[str, int] | None) -> processors.TemplateProcessing:
    single = " ".join(([f"{bos[0]}:0"] if bos else []) + ["$A:0"] + ([f"{eos[0]}:0"] if eos else []))
    pair = single + " " + " ".join(([f"{bos[0]}:1"] if bos else []) + ["$B:1"] + ([f"{eos[0]}:1"] if eos else []))
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=[t for t in (bos, eos) if t])


def special_token_ids(reader: GGUFReader) -> tuple[int | None, list[int]]:
    """(bos id, end-of-generation ids): llama.cpp stops on eos and also on eot/eom where a file names them."""
    eos_ids = [metadata_value(reader, f"tokenizer.ggml.{key}_token_id") for key in ("eos", "eot", "eom")]
    return metadata_value(reader, "tokenizer.ggml.bos_token_id"), list(dict.fromkeys(i for i in eos_ids if i is not None))


def build_gguf_tokenizer(reader: GGUFReader, path: Path) -> Tokenizer:
    model = metadata_value(reader, "tokenizer.ggml.model")
    if model != "gpt2":
        raise ModelLoadError(f"{path}: GGUF tokenizer model {model!r} is not supported "
                             f"(supported: 'gpt2', byte-level BPE)")
    tokens: list[str] = metadata_value(reader, "tokenizer.ggml.tokens") or []
    merges: list[str] = metadata_value(reader, "tokenizer.ggml.merges") or []
    if not tokens or not merges:
        raise ModelLoadError(f"{path}: GGUF tokenizer metadata lacks tokenizer.ggml.tokens or tokenizer.ggml.merges")
    token_types: list[int] = metadata_value(reader, "tokenizer.ggml.token_type") or []
    hf_tokenizer = _byte_level_bpe(tokens, merges, metadata_value(reader, "tokenizer.ggml.pre"))

    def token(key: str) -> str | None:
        index = metadata_value(reader, f"tokenizer.ggml.{key}_token_id")
        return tokens[index] if index is not None and 0 <= index < len(tokens) else None

    special = {"bos_token": token("bos"), "eos_token": token("eos"), "unk_token": token("unknown"),
               "pad_token": token("padding")}
    vocab = hf_tokenizer.get_vocab()
    # Control tokens and the named special tokens are matched whole and skipped when decoding with
    # skip_special_tokens. A control token spelled outside the byte alphabet is a mislabel: it is not
    # in the vocabulary, and adding it would grow the vocabulary past the embedding.
    special_strings = [t for t, kind in zip(tokens, token_types, strict=False) if kind == _CONTROL]
    special_strings += [t for t in special.values() if t is not None]
    hf_tokenizer.add_special_tokens([AddedToken(t, normalized=False, special=True)
                                     for t in dict.fromkeys(special_strings) if t in vocab])
    hf_tokenizer.add_tokens([AddedToken(t, normalized=False, special=False)
                             for t, kind in zip(tokens, token_types, strict=False)
                             if kind == _USER_DEFINED and t in vocab])

    def framing(key: str, flag: str, default: bool) -> tuple[str, int] | None:
        name = special[f"{key}_token"]
        wanted = metadata_value(reader, f"tokenizer.ggml.add_{flag}_token", default)
        return (name, vocab[name]) if wanted and name is not None and name in vocab else None

    hf_tokenizer.post_processor = _post_processor(framing("bos", "bos", False), framing("eos", "eos", False))
    bos_token_id, eos_token_ids = special_token_ids(reader)
    return Tokenizer(hf_tokenizer, eos_token_ids=eos_token_ids, bos_token_id=bos_token_id,
                     special_tokens=special, chat_template=metadata_value(reader, "tokenizer.chat_template"))
