"""Softmax multi-head attention with a KV cache (GPT-2's mixer; GQA when ``num_kv_heads < num_heads``).

Positions are the model's business (GPT-2 adds learned position embeddings to
the residual stream), so this layer is position-free.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
from flax import nnx

from lineage_jax import memory
from lineage_jax.layers.common import Dense, normal, param

Array = jax.Array


def _check_x(name: str, x: Array, rank: int, d_model: int) -> None:
    if x.ndim != rank or x.shape[-1] != d_model:
        want = "[B,T,D]" if rank == 3 else "[B,D]"
        raise ValueError(f"{name}: `x` must have shape {want} with D={d_model}, got {tuple(x.shape)}")


class Attention(nnx.Module):
    """Causal softmax attention: ``o = softmax(q kᵀ / √d) v`` per head, then ``W_o``."""

    def __init__(self, d_model: int, *, num_heads: int, head_dim: int, num_kv_heads: Optional[int] = None,
                 use_bias: bool = False, rngs: nnx.Rngs, out_std: Optional[float] = None, std: Optional[float] = None):
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        for name, val in (("num_heads", num_heads), ("head_dim", head_dim), ("num_kv_heads", num_kv_heads)):
            if val <= 0:
                raise ValueError(f"Attention: `{name}` must be positive, got {val}")
        if num_heads % num_kv_heads:
            raise ValueError(f"Attention: `num_heads` ({num_heads}) must be a multiple of `num_kv_heads` ({num_kv_heads})")
        self.d_model, self.num_heads, self.head_dim, self.num_kv_heads = d_model, num_heads, head_dim, num_kv_heads
        self.q = Dense(d_model, (num_heads, head_dim), axes=("embed", "heads", "head_dim"), use_bias=use_bias, rngs=rngs, std=std)
        self.k = Dense(d_model, (num_kv_heads, head_dim), axes=("embed", "kv_heads", "head_dim"), use_bias=use_bias, rngs=rngs, std=std)
        self.v = Dense(d_model, (num_kv_heads, head_dim), axes=("embed", "kv_heads", "head_dim"), use_bias=use_bias, rngs=rngs, std=std)
        out_std = (num_heads * head_dim) ** -0.5 if out_std is None else out_std
        self.o = param(rngs, normal(out_std), (num_heads, head_dim, d_model), ("heads", "head_dim", "embed"))
        self.o_bias = param(rngs, jax.nn.initializers.zeros, (d_model,), ("embed",)) if use_bias else None

    def _out(self, o: Array) -> Array:
        y = jnp.einsum("...hv,hvd->...d", o, self.o[...].astype(o.dtype))
        return y if self.o_bias is None else y + self.o_bias[...].astype(y.dtype)

    def __call__(self, x: Array, *, segment_ids: Optional[Array] = None) -> Array:
        _check_x("Attention", x, 3, self.d_model)
        o = memory.softmax_attention(self.q(x), self.k(x), self.v(x), causal=True, segment_ids=segment_ids)
        return self._out(o)

    def init_cache(self, batch: int, max_len: int, dtype=jnp.float32) -> memory.KVCache:
        return memory.init_kv_cache(batch, max_len, self.num_kv_heads, self.head_dim, dtype=dtype)

    def prefill(self, x: Array, cache: memory.KVCache, *, segment_ids: Optional[Array] = None):
        """Process ``T`` tokens after whatever ``cache`` holds; returns ``(y, cache)``."""
        _check_x("Attention.prefill", x, 3, self.d_model)
        o, cache = memory.softmax_attention_extend(self.q(x), self.k(x), self.v(x), cache, segment_ids=segment_ids)
        return self._out(o), cache

    def decode(self, x_t: Array, cache: memory.KVCache):
        _check_x("Attention.decode", x_t, 2, self.d_model)
        o, cache = memory.softmax_attention_step(self.q(x_t), self.k(x_t), self.v(x_t), cache)
        return self._out(o), cache
