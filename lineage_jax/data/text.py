"""Text corpora: the embedded default (this interpreter's standard library), any
directory of text files, and ArrayRecord files; and their tokenization into one
EOS-separated token stream.

A *corpus* is a random-access sequence of documents (``len(c)``, ``c[i] -> str``,
``c.names[i]``) in a deterministic order. ``tokenize_corpus`` turns one into a
``TokenizedCorpus``: a flat token stream in which every document is followed by
the tokenizer's EOS id, plus the end offset of every document. ``packing.py``
cuts that stream into training rows.

Train/validation split: a file of a directory corpus or of the stdlib is in "val"
when the first 8 bytes of ``sha256(relative posix path)``, read as a fraction of
2**64, fall below ``val_fraction``; so the split depends only on file names,
is stable when files are added, and is the same on every host. If no file
falls below, the file with the smallest hash is the validation set (val is
never empty); a corpus needs at least two files. ArrayRecord corpora split their
records the same way by name (``record_<i>``, ``i`` the record's index over the
files in the order given), so records appended later do not move earlier ones.

The stdlib corpus is every ``*.py`` under ``sysconfig.get_paths()["stdlib"]``
except ``site-packages``/``dist-packages``, test directories (``test``,
``tests``, ``idle_test``) and ``__pycache__``: about 730 files / 12 MB on
CPython 3.11. It differs between Python versions; it is deterministic for one
interpreter.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import pathlib
import sysconfig
from typing import Iterable, Optional, Sequence, Union

import numpy as np

from lineage_jax.data.tokenizers import get_tokenizer

__all__ = [
    "SPLITS",
    "TextFiles",
    "ArrayRecordCorpus",
    "TokenizedCorpus",
    "stdlib_corpus",
    "directory_corpus",
    "split_files",
    "write_array_record",
    "tokenize_corpus",
    "load_corpus",
]

SPLITS = ("train", "val", "all")
_STDLIB_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})
_BINARY_PROBE_BYTES = 8192


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"split: must be one of {SPLITS}, got {split!r}")


def _check_fraction(val_fraction: float) -> None:
    if not (isinstance(val_fraction, (int, float)) and 0.0 < val_fraction < 1.0):
        raise ValueError(f"val_fraction: must be in (0, 1), got {val_fraction!r}")


def _path_hash_fraction(rel: str) -> float:
    digest = hashlib.sha256(rel.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def _in_split(names: Sequence[str], split: str, val_fraction: float, what: str, noun: str) -> list[bool]:
    """For each of ``names`` (distinct), whether it belongs to ``split`` ("train" or "val")."""
    if len(names) < 2:
        raise ValueError(f"{what}: need at least 2 {noun} to split train/val, got {len(names)}")
    frac = [_path_hash_fraction(n) for n in names]
    val = [f < val_fraction for f in frac]
    if not any(val):
        val[int(np.argmin(frac))] = True
    if all(val):  # only possible with a huge val_fraction and few names
        val[int(np.argmax(frac))] = False
    return [v == (split == "val") for v in val]


def split_files(rel_paths: Sequence[str], split: str, val_fraction: float = 0.02) -> list[str]:
    """The sorted subset of ``rel_paths`` (posix, relative) belonging to ``split``."""
    _check_split(split)
    _check_fraction(val_fraction)
    paths = sorted(set(rel_paths))
    if split == "all":
        return paths
    return [p for p, keep in zip(paths, _in_split(paths, split, val_fraction, "rel_paths", "files")) if keep]


@dataclasses.dataclass(frozen=True)
class TextFiles:
    """Documents = text files under ``root`` (``names`` are sorted posix paths relative to it).

    Files are read as UTF-8 with undecodable bytes replaced by U+FFFD.
    """

    root: str
    names: tuple[str, ...]

    def __len__(self) -> int:
        return len(self.names)

    def __getitem__(self, index: int) -> str:
        data = (pathlib.Path(self.root) / self.names[index]).read_bytes()
        return data.decode("utf-8", errors="replace")

    def __iter__(self):
        return (self[i] for i in range(len(self)))


def _walk(root: pathlib.Path, keep_dir, keep_file) -> list[str]:
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if keep_dir(d))
        for f in filenames:
            p = pathlib.Path(dirpath) / f
            if p.is_file() and keep_file(p):
                out.append(p.relative_to(root).as_posix())
    return sorted(out)


def stdlib_corpus(split: str = "train", val_fraction: float = 0.02, root: Optional[str] = None) -> TextFiles:
    """The running interpreter's standard-library ``*.py`` sources (see module doc)."""
    root_path = pathlib.Path(root or sysconfig.get_paths()["stdlib"])
    if not root_path.is_dir():
        raise ValueError(f"root: {root_path} is not a directory")
    names = _walk(root_path, lambda d: d not in _STDLIB_EXCLUDED_DIRS and not d.startswith("."), lambda p: p.suffix == ".py")
    if not names:
        raise ValueError(f"root: no *.py files under {root_path}")
    return TextFiles(str(root_path), tuple(split_files(names, split, val_fraction)))


def _looks_binary(path: pathlib.Path) -> bool:
    with open(path, "rb") as f:
        return b"\x00" in f.read(_BINARY_PROBE_BYTES)


def directory_corpus(
    path: Union[str, os.PathLike],
    split: str = "train",
    val_fraction: float = 0.02,
    suffixes: Optional[Sequence[str]] = None,
) -> TextFiles:
    """Every text file under ``path`` (recursively; hidden files and dirs skipped).

    ``suffixes`` (e.g. ``(".txt", ".md")``) keeps only matching files; files with
    a NUL byte in their first 8 KiB are treated as binary and skipped.
    """
    root = pathlib.Path(path)
    if not root.is_dir():
        raise ValueError(f"path: {str(path)!r} is not a directory")
    if suffixes is not None:
        if isinstance(suffixes, str) or not all(isinstance(s, str) for s in suffixes):
            raise ValueError(f"suffixes: expected a sequence of strings like ('.txt',), got {suffixes!r}")
        suffixes = tuple(suffixes)

    def keep_file(p: pathlib.Path) -> bool:
        if p.name.startswith("."):
            return False
        if suffixes is not None and not p.name.endswith(suffixes):
            return False
        return not _looks_binary(p)

    names = _walk(root, lambda d: not d.startswith("."), keep_file)
    if not names:
        raise ValueError(f"path: no text files under {str(path)!r}" + (f" with suffixes {suffixes}" if suffixes else ""))
    return TextFiles(str(root), tuple(split_files(names, split, val_fraction)))


# --------------------------------------------------------------------------- ArrayRecord


def write_array_record(path: Union[str, os.PathLike], documents: Iterable[str], *, options: str = "group_size:1") -> int:
    """Write ``documents`` (str) as UTF-8 records of one ArrayRecord file; returns the count.

    ``group_size:1`` keeps random access cheap (one record per chunk).
    """
    from array_record.python import array_record_module as arm

    writer = arm.ArrayRecordWriter(os.fspath(path), options)
    count = 0
    try:
        for doc in documents:
            if not isinstance(doc, str):
                raise ValueError(f"documents: item {count} is {type(doc).__name__}, expected str")
            writer.write(doc.encode("utf-8"))
            count += 1
    finally:
        writer.close()
    return count


class ArrayRecordCorpus:
    """Documents stored as UTF-8 records in one or more ArrayRecord files (in the given order).

    ``split``: "all" (every record), or "train" / "val": the records of that split by the hash of their
    names (``record_<i>``; see the module docstring), in record order."""

    def __init__(self, paths: Union[str, os.PathLike, Sequence[Union[str, os.PathLike]]], split: str = "all",
                 val_fraction: float = 0.02):
        from grain.sources import ArrayRecordDataSource

        _check_split(split)
        _check_fraction(val_fraction)

        if isinstance(paths, (str, os.PathLike)):
            paths = [paths]
        paths = [os.fspath(p) for p in paths]
        if not paths:
            raise ValueError("paths: no ArrayRecord files given")
        missing = [p for p in paths if not os.path.isfile(p)]
        if missing:
            raise ValueError(f"paths: not found: {missing}")
        self.paths, self.split = tuple(paths), split
        self._source = ArrayRecordDataSource(list(self.paths))
        every = [f"record_{i}" for i in range(len(self._source))]
        keep = [True] * len(every) if split == "all" else _in_split(every, split, val_fraction, "paths", "records")
        self._index = np.flatnonzero(keep)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(f"record_{i}" for i in self._index)

    def __len__(self) -> int:
        return len(self._index)

    def __getitem__(self, index: int) -> str:
        return self._source[int(self._index[index])].decode("utf-8", errors="replace")

    def __iter__(self):
        return (self[i] for i in range(len(self)))


# --------------------------------------------------------------------------- tokenization


@dataclasses.dataclass(frozen=True)
class TokenizedCorpus:
    """A corpus as one token stream: ``doc_0 EOS doc_1 EOS ...``.

    tokens: ``[N]`` uint8 (vocab <= 256), uint16 (vocab <= 65536) or int32; the stream.
    doc_ends: int64 ``[D]``; ``tokens[doc_ends[i] - 1]`` is document i's EOS, and
        document i occupies ``tokens[doc_ends[i-1]:doc_ends[i]]`` (EOS included).
    Checked when made (or loaded): ids in ``[0, vocab_size)``, ends increasing, and EOS exactly at
    the ends — packing relies on it (a row's document changes exactly after an EOS).
    """

    tokens: np.ndarray
    doc_ends: np.ndarray
    eos_id: int
    vocab_size: int

    def __post_init__(self):
        if self.tokens.ndim != 1 or self.doc_ends.ndim != 1:
            raise ValueError(f"tokens/doc_ends: expected 1-D arrays, got {self.tokens.shape} / {self.doc_ends.shape}")
        if len(self.doc_ends) and int(self.doc_ends[-1]) != len(self.tokens):
            raise ValueError(f"doc_ends: last end {int(self.doc_ends[-1])} != len(tokens) {len(self.tokens)}")
        if not np.issubdtype(self.tokens.dtype, np.integer) or not np.issubdtype(self.doc_ends.dtype, np.integer):
            raise ValueError(f"tokens/doc_ends: expected integer arrays, got {self.tokens.dtype} / "
                             f"{self.doc_ends.dtype}")
        if not 0 <= self.eos_id < self.vocab_size:
            raise ValueError(f"eos_id: must be in [0, vocab_size={self.vocab_size}), got {self.eos_id}")
        if len(self.tokens) and (int(self.tokens.min()) < 0 or int(self.tokens.max()) >= self.vocab_size):
            raise ValueError(f"tokens: ids must be in [0, vocab_size={self.vocab_size}), got "
                             f"[{int(self.tokens.min())}, {int(self.tokens.max())}]")
        if len(self.doc_ends) and (int(self.doc_ends[0]) < 1 or np.any(np.diff(self.doc_ends) < 1)):
            raise ValueError("doc_ends: must be strictly increasing and >= 1 (every document ends with its EOS)")
        ends_eos = self.tokens[self.doc_ends - 1] == self.eos_id if len(self.doc_ends) else np.ones(0, bool)
        if not ends_eos.all() or np.count_nonzero(self.tokens == self.eos_id) != len(self.doc_ends):
            where = ("document ends without EOS" if not ends_eos.all() else "an EOS inside a document")
            raise ValueError(f"tokens: EOS (id {self.eos_id}) must be exactly at doc_ends; found {where}")

    @property
    def num_documents(self) -> int:
        return len(self.doc_ends)

    def document(self, i: int) -> np.ndarray:
        """Document ``i``'s tokens without its EOS."""
        start = int(self.doc_ends[i - 1]) if i > 0 else 0
        return self.tokens[start : int(self.doc_ends[i]) - 1]

    def save(self, path: Union[str, os.PathLike]) -> None:
        """Save as ``.npz`` (a cache for slow tokenizers)."""
        np.savez(path, tokens=self.tokens, doc_ends=self.doc_ends, eos_id=self.eos_id, vocab_size=self.vocab_size)

    @classmethod
    def load(cls, path: Union[str, os.PathLike]) -> "TokenizedCorpus":
        with np.load(path) as z:
            return cls(z["tokens"], z["doc_ends"], int(z["eos_id"]), int(z["vocab_size"]))

    @classmethod
    def from_documents(cls, documents: Iterable[Sequence[int]], *, eos_id: int, vocab_size: int) -> "TokenizedCorpus":
        """Build from already-tokenized documents (empty ones are skipped). An ``eos_id`` inside a document
        (a NUL byte in text, for the byte tokenizer) is dropped: in the stream, EOS marks document ends only."""
        if not 0 <= eos_id < vocab_size:
            raise ValueError(f"eos_id: must be in [0, vocab_size={vocab_size}), got {eos_id}")
        dtype = np.uint8 if vocab_size <= 1 << 8 else np.uint16 if vocab_size <= 1 << 16 else np.int32
        pieces, ends, total = [], [], 0
        eos = np.array([eos_id], dtype)
        for doc in documents:
            arr = np.asarray(doc)
            if arr.size == 0:
                continue
            if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
                raise ValueError(f"documents: each document must be a 1-D integer sequence, got {arr.dtype} {arr.shape}")
            if arr.min() < 0 or arr.max() >= vocab_size:
                raise ValueError(f"documents: token ids must be in [0, {vocab_size})")
            arr = arr[arr != eos_id]
            if arr.size == 0:
                continue
            pieces += [arr.astype(dtype), eos]
            total += arr.size + 1
            ends.append(total)
        tokens = np.concatenate(pieces) if pieces else np.zeros((0,), dtype)
        return cls(tokens, np.asarray(ends, np.int64), int(eos_id), int(vocab_size))


def tokenize_corpus(corpus: Sequence[str], tokenizer="byte", *, max_documents: Optional[int] = None) -> TokenizedCorpus:
    """Tokenize every document of ``corpus`` (in order) into one EOS-separated stream.

    ``tokenizer`` is a name for ``get_tokenizer`` or a tokenizer object. Byte
    tokenization is vectorized; GPT-2 BPE runs in Python (a few MB/s; cache the
    result with ``TokenizedCorpus.save``).
    """
    if isinstance(corpus, (str, bytes)):
        raise ValueError("corpus: expected a sequence of documents (str), got one "
                         f"{type(corpus).__name__}; wrap a single document in a list")
    tok = get_tokenizer(tokenizer) if isinstance(tokenizer, str) else tokenizer
    if max_documents is not None and (not isinstance(max_documents, int) or max_documents <= 0):
        raise ValueError(f"max_documents: must be a positive int or None, got {max_documents!r}")
    n = len(corpus) if max_documents is None else min(len(corpus), max_documents)
    fast = getattr(tok, "encode_bytes", None)

    def docs():
        for i in range(n):
            text = corpus[i]
            yield np.frombuffer(fast(text), np.uint8) if fast else tok.encode(text)

    return TokenizedCorpus.from_documents(docs(), eos_id=tok.eos_id, vocab_size=tok.vocab_size)


def load_corpus(data: Optional[Union[str, os.PathLike]] = None, split: str = "train", val_fraction: float = 0.02):
    """Resolve a ``--data`` argument to a corpus.

    None or "stdlib": the standard library; a directory: ``directory_corpus``;
    a file ending in ``.array_record`` (or a comma-separated list of them): an
    ``ArrayRecordCorpus`` of the split's records.
    """
    _check_split(split)
    if data is None or str(data) == "stdlib":
        return stdlib_corpus(split, val_fraction)
    s = os.fspath(data)
    if os.path.isdir(s):
        return directory_corpus(s, split, val_fraction)
    parts = [p for p in s.split(",") if p]
    if parts and all(p.endswith(".array_record") for p in parts):
        return ArrayRecordCorpus(parts, split, val_fraction)
    raise ValueError(f"data: {s!r} is neither 'stdlib', a directory, nor .array_record file(s)")
