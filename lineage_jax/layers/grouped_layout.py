"""The padded row layout of the grouped matmuls' ``"tiled"`` and ``"pallas"`` paths
(:mod:`lineage_jax.layers.grouped`, :mod:`lineage_jax.layers.grouped_pallas`), and what both share:
every group of rows padded to whole tiles, rows gathered into that layout before the products
and back out of it after."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

Array = jax.Array

# checkpoint_name of the experts' grouped-matmul outputs (grouped_glu_mlp): the "dots" remat
# policy of lineage_jax.models.decoder keeps them, so the backward pass reruns no expert matmul.
RESIDUALS = "grouped_matmul_outputs"


def _out_dtype(x, w, group_sizes):
    """The dtype ``jax.lax.ragged_dot`` gives for these inputs (abstract evaluation only)."""
    spec = lambda a: jax.ShapeDtypeStruct(jnp.shape(a), jnp.result_type(a))
    return jax.eval_shape(lax.ragged_dot, spec(x), spec(w), spec(group_sizes)).dtype


class _Layout(NamedTuple):
    """Where the rows go in the tiled and Pallas paths (all int32, built from ``group_sizes``).

    ``src [n_blocks, block*tile]``: the row of ``x`` in each padded slot (``M``: an empty
    slot, reads zero); ``tile_group [n_blocks, block]``: each tile's group;
    ``pos [M]``: each row's padded slot (``n_blocks*block*tile``: past ``sum(group_sizes)``,
    reads zero).
    """

    src: Array
    tile_group: Array
    pos: Array


def _layout(group_sizes: Array, m: int, g: int, tile: int, block: int, n_blocks: int) -> _Layout:
    # sizes past M hold no row: clamped to M, their sums cannot overflow int32 (sizes near 2**31 did)
    gs = jnp.minimum(group_sizes, m).astype(jnp.int32)
    ends = jnp.cumsum(gs)
    starts = ends - gs
    padded = (gs + tile - 1) // tile * tile                    # each group rounded up to whole tiles
    pends = jnp.cumsum(padded)
    pstarts = pends - padded
    rows = n_blocks * block * tile

    # Padded slot q belongs to group qg at offset `off`: a real row iff off < its size and
    # the row exists (row index < M; sum(group_sizes) may exceed M, as in ragged_dot).
    q = jnp.arange(rows, dtype=jnp.int32)
    qg = jnp.minimum(jnp.searchsorted(pends, q, side="right"), g - 1)
    off = q - pstarts[qg]
    src = starts[qg] + off
    src = jnp.where((off < gs[qg]) & (src < m), src, m)

    # Tiles past the last group get group g-1; their slots are all empty.
    first = jnp.arange(n_blocks * block, dtype=jnp.int32) * tile
    tile_group = jnp.minimum(jnp.searchsorted(pends, first, side="right"), g - 1)

    r = jnp.arange(m, dtype=jnp.int32)
    rg = jnp.searchsorted(ends, r, side="right")                # == g for rows past sum(group_sizes)
    rgc = jnp.minimum(rg, g - 1)
    pos = jnp.where(rg < g, pstarts[rgc] + r - starts[rgc], rows)
    return _Layout(src.reshape(n_blocks, block * tile), tile_group.reshape(n_blocks, block), pos)


def _rows(a: Array, idx: Array) -> Array:
    """``a[idx]`` along axis 0, zero where ``idx`` is out of range."""
    return jnp.take(a, idx, axis=0, mode="fill", fill_value=0)
