"""Packed documents: ``segment_ids [B, T]`` -> where each document starts, and its index.

A *segment* is a maximal run of equal ids in a row (ids need not be sorted or
unique across the row: ``[7, 7, 3, 3, 7]`` holds three documents). Every memory
and layer reads packed batches through these two functions, so "what is a
document boundary" is defined once.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array


def segment_starts(segment_ids: Array) -> Array:
    """``[B, T]`` ids -> ``[B, T]`` bool, True where the id differs from the previous token
    (False at position 0: the first document starts from the incoming state/cache)."""
    seg = jnp.asarray(segment_ids)
    change = seg[:, 1:] != seg[:, :-1]
    return jnp.concatenate([jnp.zeros((seg.shape[0], 1), bool), change], axis=1)


def document_index(segment_ids: Array) -> Array:
    """``[B, T]`` ids -> ``[B, T]`` int32: the index of each token's document in its row, from 0."""
    return jnp.cumsum(segment_starts(segment_ids).astype(jnp.int32), axis=1)
