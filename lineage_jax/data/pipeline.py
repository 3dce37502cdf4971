"""Grain input pipeline: shuffled, per-host sharded, checkpointable batches.

Built on grain's dataset API (``grain.MapDataset`` -> ``IterDataset``), stable
since grain 0.2.x::

    source[i]                       random access: packed rows or a synthetic task
      .shuffle(seed)                a fresh permutation per epoch (seed + epoch)
      [shard_index:n:shard_count]   this host's disjoint slice of every epoch
      .repeat(num_epochs)           None = forever
      .batch(batch_size)            drop_remainder: every batch is full
      .to_iter_dataset()            threads prefetch, order unchanged

Each epoch every host sees ``len(source) // shard_count`` rows (the remainder
rows of a shuffled epoch are skipped so all hosts take the same number of
steps); the slices of all hosts are disjoint and together are the unsharded
epoch. Batches run across epoch boundaries (a batch may mix the end of one
epoch with the start of the next). ``batch_size`` is per host.

Batches are dicts of NumPy arrays::

    tokens       int32   [B, T]
    targets      int32   [B, T]
    segment_ids  int32   [B, T]
    mask         float32 [B, T]

Resuming: ``it.get_state()`` is a small JSON-serializable dict (grain's
``next_index`` plus a fingerprint of the pipeline's arguments);
``it.set_state(state)`` on an iterator built with the same arguments continues
with exactly the batches that would have come next, and raises ``ValueError``
if the arguments differ. The iterator is a ``grain.DatasetIterator``, so
``grain.checkpoint.CheckpointHandler`` (Orbax: ``grain.checkpoint.CheckpointSave``
/ ``CheckpointRestore``) saves and restores it per process.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Optional

import grain
import numpy as np

from lineage_jax.data.packing import FIELDS, PackedSource
from lineage_jax.data.text import TokenizedCorpus

__all__ = ["make_dataset", "make_batches", "BatchIterator"]

_STATE_KEY = "lineage_jax_pipeline"


def _positive_int(name: str, value) -> int:
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name}: must be a positive int, got {value!r}")
    return int(value)


def _resolve_source(source, seq_len: int):
    if isinstance(source, TokenizedCorpus):
        return PackedSource(source, seq_len)
    if not (hasattr(source, "__len__") and hasattr(source, "__getitem__")):
        raise ValueError(
            f"source: expected a TokenizedCorpus or a random-access source (len + getitem), got {type(source).__name__}"
        )
    src_len = getattr(source, "seq_len", None)
    if src_len is not None and src_len != seq_len:
        raise ValueError(f"seq_len: {seq_len} does not match the source's seq_len {src_len}")
    if len(source) == 0:
        raise ValueError("source: is empty")
    first = source[0]
    if not isinstance(first, dict) or set(FIELDS) - set(first):
        raise ValueError(f"source: examples must be dicts with fields {FIELDS}")
    if first["tokens"].shape != (seq_len,):
        raise ValueError(f"seq_len: {seq_len} does not match the source's example shape {first['tokens'].shape}")
    return source


def make_dataset(
    source,
    *,
    seq_len: int,
    batch_size: int,
    seed: int,
    shard_index: int = 0,
    shard_count: int = 1,
    num_epochs: Optional[int] = None,
    shuffle: bool = True,
) -> grain.MapDataset:
    """The batched ``grain.MapDataset`` (random access by step) behind ``make_batches``.

    ``source``: a ``TokenizedCorpus`` (packed here into ``seq_len`` rows) or any
    random-access source whose items are dicts of ``[seq_len]`` arrays
    (``PackedSource``, the tasks of ``synthetic.py``). ``len(result)`` is the
    number of batches (``sys.maxsize // batch_size`` when ``num_epochs`` is None).
    """
    return _build(source, seq_len, batch_size, seed, shard_index, shard_count, num_epochs, shuffle)[0]


def _build(source, seq_len, batch_size, seed, shard_index, shard_count, num_epochs, shuffle):
    seq_len = _positive_int("seq_len", seq_len)
    batch_size = _positive_int("batch_size", batch_size)
    shard_count = _positive_int("shard_count", shard_count)
    if not isinstance(shard_index, (int, np.integer)) or isinstance(shard_index, bool) or not 0 <= shard_index < shard_count:
        raise ValueError(f"shard_index: must be an int in [0, shard_count={shard_count}), got {shard_index!r}")
    if not isinstance(seed, (int, np.integer)) or isinstance(seed, bool) or not 0 <= seed < 2**32:
        raise ValueError(f"seed: must be an int in [0, 2**32), got {seed!r}")
    if num_epochs is not None:
        num_epochs = _positive_int("num_epochs", num_epochs)
    source = _resolve_source(source, seq_len)

    rows_per_shard = len(source) // shard_count
    if rows_per_shard == 0:
        raise ValueError(f"shard_count: {shard_count} exceeds the number of rows ({len(source)})")
    if num_epochs is not None and rows_per_shard * num_epochs < batch_size:
        raise ValueError(
            f"batch_size: {batch_size} exceeds the {rows_per_shard * num_epochs} rows this shard sees in {num_epochs} epoch(s)"
        )
    ds = grain.MapDataset.source(source)
    if shuffle:
        ds = ds.shuffle(seed=int(seed))
    ds = ds[int(shard_index) : rows_per_shard * shard_count : shard_count]
    ds = ds.repeat(num_epochs)
    return ds.batch(batch_size, drop_remainder=True), source


def _source_identity(source) -> str:
    """What a resumed iterator must read again: a packed corpus by its size and a digest of its document ends
    and its first and last MiB of tokens; any other source by its type."""
    if isinstance(source, PackedSource):
        c = source.corpus
        digest = hashlib.sha256(c.doc_ends.tobytes())
        digest.update(c.tokens[: 1 << 20].tobytes())
        digest.update(c.tokens[-(1 << 20):].tobytes())
        return f"corpus of {c.num_documents} documents, {len(c.tokens)} tokens, sha256 {digest.hexdigest()[:16]}"
    return f"{type(source).__module__}.{type(source).__qualname__}"


class BatchIterator(grain.DatasetIterator):
    """A grain iterator whose state records (and checks) the pipeline's arguments."""

    def __init__(self, parent: grain.DatasetIterator, fingerprint: dict):
        super().__init__(parent)
        self.fingerprint = dict(fingerprint)

    def __next__(self) -> dict:
        return next(self._parent)

    def get_state(self) -> dict[str, Any]:
        state = dict(self._parent.get_state())
        state[_STATE_KEY] = json.dumps(self.fingerprint, sort_keys=True)
        return state

    def set_state(self, state: dict[str, Any]) -> None:
        if not isinstance(state, dict) or _STATE_KEY not in state:
            raise ValueError(f"state: not a state from BatchIterator.get_state (missing {_STATE_KEY!r})")
        saved = json.loads(state[_STATE_KEY])
        if "source" not in saved:  # a state saved before the source was recorded: its arguments alone
            saved = dict(saved, source=self.fingerprint.get("source"))
        if saved != self.fingerprint:
            diff = {k: (saved.get(k), self.fingerprint.get(k)) for k in set(saved) | set(self.fingerprint)
                    if saved.get(k) != self.fingerprint.get(k)}
            raise ValueError(f"state: saved by a pipeline with different arguments (saved, now): {diff}")
        self._parent.set_state({k: v for k, v in state.items() if k != _STATE_KEY})

    def __str__(self) -> str:
        return f"BatchIterator({self.fingerprint})"


def make_batches(
    source,
    *,
    seq_len: int,
    batch_size: int,
    seed: int,
    shard_index: int = 0,
    shard_count: int = 1,
    num_epochs: Optional[int] = None,
    shuffle: bool = True,
    num_threads: int = 2,
    prefetch_buffer_size: int = 64,
) -> BatchIterator:
    """An iterator of batches (see module doc) with ``get_state()`` / ``set_state()``.

    ``num_threads`` / ``prefetch_buffer_size`` (elements, not batches) tune grain's
    read-ahead; they do not change the data. Stops after ``num_epochs`` epochs
    (a final partial batch is dropped); runs forever when ``num_epochs`` is None.
    """
    ds, resolved = _build(source, seq_len, batch_size, seed, shard_index, shard_count, num_epochs, shuffle)
    if not isinstance(num_threads, int) or num_threads < 0:
        raise ValueError(f"num_threads: must be an int >= 0, got {num_threads!r}")
    if not isinstance(prefetch_buffer_size, int) or prefetch_buffer_size < 0:
        raise ValueError(f"prefetch_buffer_size: must be an int >= 0, got {prefetch_buffer_size!r}")
    read = grain.ReadOptions(num_threads=num_threads, prefetch_buffer_size=prefetch_buffer_size)
    fingerprint = dict(
        source=_source_identity(resolved),
        rows=len(resolved),
        seq_len=seq_len,
        batch_size=batch_size,
        seed=int(seed),
        shard_index=int(shard_index),
        shard_count=int(shard_count),
        num_epochs=num_epochs,
        shuffle=bool(shuffle),
    )
    return BatchIterator(iter(ds.to_iter_dataset(read)), fingerprint)
