"""Rebuild a `tokenizers.Tokenizer` (and chat template) from a GGUF file's tokenizer metadata.

A GGUF carries no tokenizer.json, only llama.cpp's `tokenizer.ggml.*` keys: the vocabulary, merges
(byte-level BPE) or scores (SentencePiece BPE), per-token types and special ids. The result matches
what transformers builds from the same file."""

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


def _merges_from_scores(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """SentencePiece files list no merges; every split of a token into two vocabulary pieces is one,
    ranked by the token's score (higher first), then by longer pieces (as transformers ranks them)."""
    merges: list[tuple[str, str, float]] = []
    for token, score in scores.items():
        pairs = [(token[:i], token[i:], score) for i in range(1, len(token)) if token[:i] in vocab and token[i:] in vocab]
        merges.extend(sorted(pairs, key=lambda pair: (vocab[pair[0]], vocab[pair[1]])))
    merges.sort(key=lambda merge: (merge[2], len(merge[0]), len(merge[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]


def _sentencepiece_bpe(tokens: list[str], scores: list[float]) -> tokenizers.Tokenizer:
    """Llama 2 / Mistral style: "▁" marks spaces, unknown characters fall back to <0xNN> byte tokens."""
    vocab = {token: index for index, token in enumerate(tokens)}
    bpe = models.BPE(vocab=vocab, merges=_merges_from_scores(vocab, dict(zip(tokens, scores, strict=True))), fuse_unk=True, byte_fallback=True,
                     dropout=None)
    tokenizer = tokenizers.Tokenizer(bpe)
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                           decoders.Strip(content=" ", left=1)])
    return tokenizer


def build_gguf_tokenizer(reader: GGUFReader, path: Path) -> Tokenizer:
    model = metadata_value(reader, "tokenizer.ggml.model")
    tokens: list[str] = metadata_value(reader, "tokenizer.ggml.tokens") or []
    if model == "gpt2":
        merges: list[str] = metadata_value(reader, "tokenizer.ggml.merges") or []
        if not tokens or not merges:
            raise ModelLoadError(f"{path}: GGUF tokenizer metadata lacks tokenizer.ggml.tokens or "
                                 f"tokenizer.ggml.merges")
        hf_tokenizer = _byte_level_bpe(tokens, merges, metadata_value(reader, "tokenizer.ggml.pre"))
    elif model == "llama":
        scores: list[float] = metadata_value(reader, "tokenizer.ggml.scores") or []
        if not tokens or len(scores) != len(tokens):
            raise ModelLoadError(f"{path}: GGUF tokenizer metadata lacks tokenizer.ggml.tokens or "
                                 f"tokenizer.ggml.scores")
        hf_tokenizer = _sentencepiece_bpe(tokens, scores)
    else:
        raise ModelLoadError(f"{path}: GGUF tokenizer model {model!r} is not supported "
                             f"(supported: 'gpt2' byte-level BPE, 'llama' SentencePiece BPE)")
    token_types: list[int] = metadata_value(reader, "tokenizer.ggml.token_type") or []

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

    def framing(name: str | None, flag: str, default: bool) -> tuple[str, int] | None:
        wanted = metadata_value(reader, f"tokenizer.ggml.{flag}", default)
        return (name, vocab[name]) if wanted and name is not None and name in vocab else None

    # SentencePiece vocabularies that do not say otherwise get BOS, as llama.cpp and transformers do.
    hf_tokenizer.post_processor = _post_processor(
        framing(special["bos_token"], "add_bos_token", default=model == "llama"),
        framing(special["eos_token"], "add_eos_token", default=False))
    bos_token_id, eos_token_ids = special_token_ids(reader)
    return Tokenizer(hf_tokenizer, eos_token_ids=eos_token_ids, bos_token_id=bos_token_id,
                     special_tokens=special, chat_template=metadata_value(reader, "tokenizer.chat_template"))
