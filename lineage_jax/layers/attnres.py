"""Block Attention Residuals (Kimi K3): attention over depth instead of an equal-weight sum.

A plain residual stream is ``h_l = h_1 + Σ_{i<l} f_i(h_i)`` — an additive memory
over depth, with linear attention's disease (nothing can be evicted, late writes
must shout). AttnRes reads it selectively: each sublayer owns one learned
pseudo-query ``w`` (zero at init) and its input is

    h = Σ_s softmax_s(w · RMSNorm(src_s)) · src_s          (per token, over sources s)

Sources are the embedding, the *sealed* blocks (each the sum of its sublayers'
outputs over ``block`` layers) and the current block's partial sum. With a zero
query every source weighs the same: the input is the mean of the sources.

The state is a fixed-size buffer (``max_sources`` slots plus a count, and each slot's
``1/RMS`` cached when it is sealed) so a ``lax.scan`` over layers can carry it.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

Array = jax.Array


class AttnResState(NamedTuple):
    sources: Array  # [N, B, T, D]: slot 0 the embedding, then sealed blocks
    inv_rms: Array  # [N, B, T] float32: 1 / RMS of each source, computed once when it is sealed
    count: Array  # int32 scalar: filled slots
    partial: Array  # [B, T, D]: sum of the current block's sublayer outputs
    has_partial: Array  # bool scalar: the current block has at least one output


def init(embedding: Array, max_sources: int) -> AttnResState:
    """Start the stream from the token embedding ``[B, T, D]``."""
    sources = jnp.zeros((max_sources, *embedding.shape), embedding.dtype).at[0].set(embedding)
    inv_rms = jnp.zeros((max_sources, *embedding.shape[:-1]), jnp.float32).at[0].set(_inv_rms(embedding))
    return AttnResState(sources, inv_rms, jnp.asarray(1, jnp.int32), jnp.zeros_like(embedding), jnp.asarray(False))


def _inv_rms(x: Array, eps: float = 1e-6) -> Array:
    x32 = x.astype(jnp.float32)
    return jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1) + eps)


def read(state: AttnResState, query: Array) -> Array:
    """The sublayer input: softmax over depth of ``query · RMSNorm(source)``, per token.

    ``query · RMSNorm(s) = (query · s) / RMS(s)``: the sealed sources' RMS is cached in the
    state, so a read is two passes over the buffer (logits, weighted sum) and one over the
    partial sum — no normalised or concatenated copy of the sources."""
    f32 = jnp.float32
    q = query.astype(f32)
    n = state.sources.shape[0]
    src_logits = jnp.einsum("d,nbtd->nbt", q, state.sources.astype(f32)) * state.inv_rms
    part_logit = jnp.einsum("d,btd->bt", q, state.partial.astype(f32)) * _inv_rms(state.partial)
    logits = jnp.concatenate([src_logits, part_logit[None]], axis=0)  # [N+1, B, T]: small
    valid = jnp.concatenate([jnp.arange(n) < state.count, state.has_partial[None]])  # [N+1]
    logits = jnp.where(valid[:, None, None], logits, -jnp.inf)
    w = jax.nn.softmax(logits, axis=0)
    w = jnp.where(valid[:, None, None], w, 0.0)
    h = jnp.einsum("nbt,nbtd->btd", w[:n], state.sources, preferred_element_type=f32)
    h = h + w[n][..., None] * state.partial.astype(f32)
    return h.astype(state.partial.dtype)


def write(state: AttnResState, out: Array) -> AttnResState:
    """Add a sublayer's output to the current block."""
    return state._replace(partial=state.partial + out.astype(state.partial.dtype), has_partial=jnp.asarray(True))


def seal(state: AttnResState, when: Array | bool = True) -> AttnResState:
    """Close the current block (if ``when`` and it has an output): its sum becomes a new source.

    Only the slot at ``count`` is written (a select of one ``[B, T, D]`` slice, not of the buffer)."""
    do = jnp.logical_and(jnp.asarray(when), state.has_partial)
    # The decoder seals at most max_sources - 1 blocks; past that the last slot would be overwritten.
    i = jnp.minimum(state.count, state.sources.shape[0] - 1)
    slot = jnp.where(do, state.partial, jax.lax.dynamic_index_in_dim(state.sources, i, keepdims=False))
    scale = jnp.where(do, _inv_rms(state.partial), jax.lax.dynamic_index_in_dim(state.inv_rms, i, keepdims=False))
    return AttnResState(
        sources=jax.lax.dynamic_update_index_in_dim(state.sources, slot, i, axis=0),
        inv_rms=jax.lax.dynamic_update_index_in_dim(state.inv_rms, scale, i, axis=0),
        count=state.count + do.astype(state.count.dtype),
        partial=jnp.where(do, jnp.zeros_like(state.partial), state.partial),
        has_partial=jnp.logical_and(state.has_partial, jnp.logical_not(do)),
    )


def max_sources(num_layers: int, block: int) -> int:
    """Embedding + one slot per block that can be sealed."""
    return 1 + -(-num_layers // block)
