"""Block Attention Residuals (Kimi K3): attention over depth instead of an equal-weight sum.

A plain residual stream is ``h_l = h_1 + Σ_{i<l} f_i(h_i)`` — an additive memory
over depth, with linear attention's disease (nothing can be evicted, late writes
must shout). AttnRes reads it selectively: each sublayer owns one learned
pseudo-query ``w`` (zero at init) and its input is

    h = Σ_s softmax_s(w · RMSNorm(src_s)) · src_s          (per token, over sources s)

Sources are the embedding, the *sealed* blocks (each the sum of its sublayers'
outputs over ``block`` layers) and the current block's partial sum. With a zero
query every source weighs the same: the input is the mean of the sources.

The state is a fixed-size buffer (``max_sources`` slots plus a count) so a
``lax.scan`` over layers can carry it.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

Array = jax.Array


class AttnResState(NamedTuple):
    sources: Array  # [N, B, T, D]: slot 0 the embedding, then sealed blocks
    count: Array  # int32 scalar: filled slots
    partial: Array  # [B, T, D]: sum of the current block's sublayer outputs
    has_partial: Array  # bool scalar: the current block has at least one output


def init(embedding: Array, max_sources: int) -> AttnResState:
    """Start the stream from the token embedding ``[B, T, D]``."""
    sources = jnp.zeros((max_sources, *embedding.shape), embedding.dtype).at[0].set(embedding)
    return AttnResState(sources, jnp.asarray(1, jnp.int32), jnp.zeros_like(embedding), jnp.asarray(False))


def _rms(x: Array, eps: float = 1e-6) -> Array:
    x32 = x.astype(jnp.float32)
    return x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)


def read(state: AttnResState, query: Array) -> Array:
    """The sublayer input: softmax over depth of ``query · RMSNorm(source)``, per token."""
    srcs = jnp.concatenate([state.sources, state.partial[None]], axis=0)  # [N+1, B, T, D]
    n = state.sources.shape[0]
    valid = jnp.concatenate([jnp.arange(n) < state.count, state.has_partial[None]])  # [N+1]
    logits = jnp.einsum("d,nbtd->nbt", query.astype(jnp.float32), _rms(srcs))
    logits = jnp.where(valid[:, None, None], logits, -jnp.inf)
    w = jax.nn.softmax(logits, axis=0)
    w = jnp.where(valid[:, None, None], w, 0.0)
    return jnp.einsum("nbt,nbtd->btd", w, srcs.astype(jnp.float32)).astype(state.partial.dtype)


def write(state: AttnResState, out: Array) -> AttnResState:
    """Add a sublayer's output to the current block."""
    return state._replace(partial=state.partial + out.astype(state.partial.dtype), has_partial=jnp.asarray(True))


def seal(state: AttnResState, when: Array | bool = True) -> AttnResState:
    """Close the current block (if ``when``): its sum becomes a new source."""
    sealed = AttnResState(
        sources=jax.lax.dynamic_update_index_in_dim(state.sources, state.partial, state.count, axis=0),
        count=state.count + 1,
        partial=jnp.zeros_like(state.partial),
        has_partial=jnp.asarray(False),
    )
    do = jnp.logical_and(jnp.asarray(when), state.has_partial)
    return jax.tree.map(lambda a, b: jnp.where(do, a, b), sealed, state)


def max_sources(num_layers: int, block: int) -> int:
    """Embedding + one slot per block that can be sealed."""
    return 1 + -(-num_layers // block)
