"""Softmax multi-head attention with a KV cache (GPT-2's mixer; GQA when ``num_kv_heads < num_heads``).

Positions are the model's business by default (GPT-2 adds learned position embeddings
to the residual stream) and the layer is position-free. With ``rope_theta`` set it
rotates every query and key at its absolute position (:func:`~lineage_jax.layers.common.apply_rope`,
half-split, the whole head), Llama-style; keys are cached already rotated, so decode
rotates only the new token. Positions are ``0..T-1`` for a whole sequence and continue
from the cache's length in prefill / decode; RoPE is relative, so packed documents
(``segment_ids``) need no position reset.
"""

from __future__ import annotations

import math
import numbers
from typing import Optional

import jax
import jax.numpy as jnp
from flax import nnx

from lineage_jax import memory
from lineage_jax.layers.common import Dense, YaRN, apply_rope, normal, param
from lineage_jax.memory import _validate as V
from lineage_jax.memory.softmax import check_kv_cache

Array = jax.Array


def _check_x(name: str, x: Array, rank: int, d_model: int) -> None:
    if x.ndim != rank or x.shape[-1] != d_model:
        want = "[B,T,D]" if rank == 3 else "[B,D]"
        raise ValueError(f"{name}: `x` must have shape {want} with D={d_model}, got {tuple(x.shape)}")


class Attention(nnx.Module):
    """Causal softmax attention: ``o = softmax(q kᵀ / √d) v`` per head, then ``W_o``; with
    ``rope_theta``, ``q`` and ``k`` are rotated at their positions first (see the module doc)."""

    @staticmethod
    def check(d_model: int, *, num_heads: int, head_dim: int, num_kv_heads: Optional[int] = None,
              use_bias: bool = False, out_std: Optional[float] = None, std: Optional[float] = None,
              rope_theta: Optional[float] = None, decode_read: str = "auto", attention_impl: str = "auto",
              yarn: Optional[YaRN] = None) -> None:
        """Raise ``ValueError`` naming the first bad argument of ``Attention(...)`` (the same arguments,
        without ``rngs``); ``ModelConfig`` runs it on its softmax-attention part."""
        memory.resolve_read("Attention", decode_read, "decode_read")  # checked here, resolved when traced
        if attention_impl not in memory.ATTENTION_IMPLS:
            raise ValueError(f"Attention: `attention_impl` must be one of {memory.ATTENTION_IMPLS}, got {attention_impl!r}")
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        for name, val in (("d_model", d_model), ("num_heads", num_heads), ("head_dim", head_dim),
                          ("num_kv_heads", num_kv_heads)):
            V.require_positive_int("Attention", name, val)
        V.require_bool("Attention", "use_bias", use_bias)
        if num_heads % num_kv_heads:
            raise ValueError(f"Attention: `num_kv_heads` ({num_kv_heads}) must divide `num_heads` ({num_heads})")
        if rope_theta is not None:
            if head_dim % 2:
                raise ValueError(f"Attention: `head_dim` must be even with rope_theta set, got {head_dim}")
            if (isinstance(rope_theta, bool) or not isinstance(rope_theta, numbers.Real)
                    or not math.isfinite(rope_theta) or not rope_theta > 0):
                raise ValueError(f"Attention: `rope_theta` must be a positive finite number or None, got {rope_theta!r}")
        if yarn is not None and rope_theta is None:
            raise ValueError("Attention: `yarn` scales RoPE; set `rope_theta` too")

    def __init__(self, d_model: int, *, num_heads: int, head_dim: int, num_kv_heads: Optional[int] = None,
                 use_bias: bool = False, rngs: nnx.Rngs, out_std: Optional[float] = None, std: Optional[float] = None,
                 rope_theta: Optional[float] = None, decode_read: str = "auto", attention_impl: str = "auto",
                 yarn: Optional[YaRN] = None):
        self.check(d_model, num_heads=num_heads, head_dim=head_dim, num_kv_heads=num_kv_heads, use_bias=use_bias,
                   out_std=out_std, std=std, rope_theta=rope_theta, decode_read=decode_read,
                   attention_impl=attention_impl, yarn=yarn)
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        self.d_model, self.num_heads, self.head_dim, self.num_kv_heads = d_model, num_heads, head_dim, num_kv_heads
        self.rope_theta = None if rope_theta is None else float(rope_theta)
        self.yarn = yarn  # YaRN scaling of the rotary frequencies (None: plain RoPE)
        self.decode_read = decode_read  # how decode reads the cache: memory.softmax_attention_step's `read`
        self.attention_impl = attention_impl  # the fused attention of __call__: memory.softmax_attention's `impl`
        self.q = Dense(d_model, (num_heads, head_dim), axes=("embed", "heads", "head_dim"), use_bias=use_bias, rngs=rngs, std=std)
        self.k = Dense(d_model, (num_kv_heads, head_dim), axes=("embed", "kv_heads", "head_dim"), use_bias=use_bias, rngs=rngs, std=std)
        self.v = Dense(d_model, (num_kv_heads, head_dim), axes=("embed", "kv_heads", "head_dim"), use_bias=use_bias, rngs=rngs, std=std)
        out_std = (num_heads * head_dim) ** -0.5 if out_std is None else out_std
        self.o = param(rngs, normal(out_std), (num_heads, head_dim, d_model), ("heads", "head_dim", "embed"))
        self.o_bias = param(rngs, jax.nn.initializers.zeros, (d_model,), ("embed",)) if use_bias else None

    def _out(self, o: Array) -> Array:
        y = jnp.einsum("...hv,hvd->...d", o, self.o[...].astype(o.dtype))
        return y if self.o_bias is None else y + self.o_bias[...].astype(y.dtype)

    def _qk(self, x: Array, positions: Array) -> tuple[Array, Array]:
        """Queries and keys of ``x [..., D]`` at ``positions [...]`` (rotated when the layer uses RoPE)."""
        q, k = self.q(x), self.k(x)
        if self.rope_theta is not None:
            q = apply_rope(q, positions[..., None], theta=self.rope_theta, yarn=self.yarn)
            k = apply_rope(k, positions[..., None], theta=self.rope_theta, yarn=self.yarn)
        return q, k

    def __call__(self, x: Array, *, segment_ids: Optional[Array] = None) -> Array:
        _check_x("Attention", x, 3, self.d_model)
        q, k = self._qk(x, jnp.arange(x.shape[1])[None, :])
        o = memory.softmax_attention(q, k, self.v(x), causal=True, segment_ids=segment_ids, impl=self.attention_impl)
        return self._out(o)

    def init_cache(self, batch: int, max_len: int, dtype=jnp.float32) -> memory.KVCache:
        return memory.init_kv_cache(batch, max_len, self.num_kv_heads, self.head_dim, dtype=dtype)

    def prefill(self, x: Array, cache: memory.KVCache, *, segment_ids: Optional[Array] = None):
        """Process ``T`` tokens after whatever ``cache`` holds; returns ``(y, cache)``."""
        _check_x("Attention.prefill", x, 3, self.d_model)
        check_kv_cache("Attention.prefill", cache, x.shape[0], self.head_dim)
        q, k = self._qk(x, cache.length[:, None] + jnp.arange(x.shape[1])[None, :])
        o, cache = memory.softmax_attention_extend(q, k, self.v(x), cache, segment_ids=segment_ids)
        return self._out(o), cache

    def decode(self, x_t: Array, cache: memory.KVCache):
        _check_x("Attention.decode", x_t, 2, self.d_model)
        check_kv_cache("Attention.decode", cache, x_t.shape[0], self.head_dim)
        q, k = self._qk(x_t, cache.length)
        o, cache = memory.softmax_attention_step(q, k, self.v(x_t), cache, read=self.decode_read)
        return self._out(o), cache
