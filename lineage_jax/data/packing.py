"""Pack an EOS-separated token stream into fixed-length training rows.

Row ``i`` is the window ``x = stream[i*T : i*T + T + 1]`` (consecutive rows share
one token, so every stream position after the first is a target exactly once;
the tail that does not fill a row is dropped). From it:

    tokens       int32   [T]   x[:-1]
    targets      int32   [T]   x[1:]
    segment_ids  int32   [T]   1, 1, ..., 2, 2, ...: which document tokens[t] belongs to,
                               renumbered from 1 inside the row (0 is never used)
    mask         float32 [T]   0.0 where the target is the first token of the next
                               document (tokens[t] is an EOS), else 1.0

A document's EOS belongs to that document (it is its last token), so
``segment_ids[t+1] != segment_ids[t]`` exactly where ``tokens[t]`` is an EOS
(as long as no document contains the EOS id itself), and predicting the EOS
is trained ("this document ends here") while predicting across it is not.
Memory layers reset their state where the id changes (docs/design.md).

Everything is a pure function of the stream and ``seq_len``: deterministic.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from lineage_jax.data.text import TokenizedCorpus

__all__ = ["PackedSource", "pack_documents", "FIELDS"]

FIELDS = ("tokens", "targets", "segment_ids", "mask")


def _check_seq_len(seq_len) -> int:
    if not isinstance(seq_len, (int, np.integer)) or isinstance(seq_len, bool) or seq_len <= 0:
        raise ValueError(f"seq_len: must be a positive int, got {seq_len!r}")
    return int(seq_len)


class PackedSource:
    """Grain-compatible random-access source of packed rows (see module doc).

    ``len(src)`` rows; ``src[i]`` is a dict of four ``[seq_len]`` arrays.
    """

    def __init__(self, corpus: TokenizedCorpus, seq_len: int):
        self.seq_len = _check_seq_len(seq_len)
        if not isinstance(corpus, TokenizedCorpus):
            raise ValueError(f"corpus: expected a TokenizedCorpus, got {type(corpus).__name__}")
        self.corpus = corpus
        self.vocab_size = corpus.vocab_size
        self._num_rows = max(0, (len(corpus.tokens) - 1) // self.seq_len)
        if self._num_rows == 0:
            raise ValueError(
                f"seq_len: {seq_len} leaves no full row; the corpus has only {len(corpus.tokens)} tokens (need seq_len + 1)"
            )

    def __len__(self) -> int:
        return self._num_rows

    def __getitem__(self, index: int) -> dict:
        index = int(index)
        if not 0 <= index < self._num_rows:
            raise IndexError(f"row {index} out of range [0, {self._num_rows})")
        T = self.seq_len
        start = index * T
        x = self.corpus.tokens[start : start + T + 1].astype(np.int32)
        doc = np.searchsorted(self.corpus.doc_ends, np.arange(start, start + T + 1), side="right")
        return {
            "tokens": x[:-1],
            "targets": x[1:],
            "segment_ids": (doc[:-1] - doc[0] + 1).astype(np.int32),
            "mask": (doc[1:] == doc[:-1]).astype(np.float32),
        }

    def __repr__(self) -> str:
        return f"PackedSource(rows={self._num_rows}, seq_len={self.seq_len}, documents={self.corpus.num_documents})"


def pack_documents(documents: Sequence[Sequence[int]], *, seq_len: int, eos_id: int, vocab_size: int) -> dict:
    """Pack tokenized ``documents`` (each followed by ``eos_id``) into all rows at once.

    Returns the four fields stacked: ``[num_rows, seq_len]`` each (int32, mask float32).
    """
    corpus = TokenizedCorpus.from_documents(documents, eos_id=eos_id, vocab_size=vocab_size)
    src = PackedSource(corpus, seq_len)
    rows = [src[i] for i in range(len(src))]
    return {k: np.stack([r[k] for r in rows]) for k in FIELDS}
