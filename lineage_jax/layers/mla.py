"""Multi-head Latent Attention (MLA): DeepSeek-V2/V3, Kimi Linear, Kimi K3.

Per token ``x [D]`` (``H`` heads, ``n`` = ``qk_nope_head_dim``, ``r`` = ``qk_rope_head_dim``,
``C`` = ``kv_lora_rank``)::

    q           = x W_q                         or  RMSNorm(x W_dq) W_uq      [H, n + r]
    q_nope, q_r = q[..., :n], rope(q[..., n:])                                [H, n], [H, r]
    c           = RMSNorm(x W_dkv)               (the cached latent)          [C]
    k_r         = rope(x W_kr)                   (ONE key shared by heads)    [r]
    k_nope, v   = c W_uk, c W_uv                                              [H, n], [H, v]
    s_ti        = (q_nope_t · k_nope_i + q_r_t · k_r_i) · (n + r) ** -0.5
    o_t         = softmax_{i <= t}(s_t) v        (float32)                    [H, v]
    y_t         = (o_t ⊙ σ(x_t W_g)) W_o         (gate only with ``output_gate``, Gated MLA of K3)

The cache keeps only ``c`` and ``k_r``: ``C + r`` values per token
(:func:`mla_cache_values_per_token`), however many heads there are.

Two ways to evaluate the same scores:

* ``__call__`` / ``prefill`` expand the latents to per-head keys and values
  (``k_nope = c W_uk``, ``v = c W_uv``) and run ordinary attention — cheap when
  many queries share the keys.
* ``decode`` absorbs the up-projections into the query and the output:
  ``q_nope · k_nope_i = (q_nope W_ukᵀ) · c_i``, so scores are
  ``q_lat · c_iᵀ + q_r · k_r_iᵀ`` with ``q_lat = q_nope W_ukᵀ [H, C]``, and
  ``Σ_i p_i v_i = (Σ_i p_i c_i) W_uv``. The cache is never expanded per head.

Precision: every product runs at the matmul precision in force (``ModelConfig.matmul_precision``,
:mod:`lineage_jax.numerics`: TF32 for float32 on GPUs by default). ``__call__`` runs the fused
attention of :func:`~lineage_jax.memory.softmax_attention` in the activations' dtype
(``attention_impl``: cuDNN / Pallas / blockwise XLA; scores and softmax in float32); ``prefill``
and ``decode`` compute scores, softmax and the absorbed products in float32. The paths agree to
float32 rounding (~1e-6 relative) for float32 activations at ``"highest"`` (or on a CPU), to
~1e-3 under TF32.

Positions: with ``use_rope=True`` (DeepSeek) ``q_r`` and ``k_r`` are rotated at
their absolute positions by :func:`apply_rope` (half-split convention, see there);
keys are cached already rotated. With ``use_rope=False`` (NoPE: Kimi Linear, K3)
nothing is rotated, but the ``r`` shared key dimensions still exist.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
from flax import nnx

from lineage_jax.layers.common import Dense, RMSNorm, YaRN, apply_rope, normal, param  # apply_rope: re-exported
from lineage_jax.memory import _validate as V
from lineage_jax.memory.segments import document_index
from lineage_jax.memory.fused import IMPLS as ATTENTION_IMPLS
from lineage_jax.memory.softmax import cache_read, resolve_read, softmax_attention

Array = jax.Array


def _einsum(spec: str, *operands: Array) -> Array:
    """Attention-internal einsum, at the matmul precision in force (lineage_jax.numerics)."""
    return jnp.einsum(spec, *operands)


def mla_cache_values_per_token(kv_lora_rank: int, qk_rope_head_dim: int) -> int:
    """Values an MLA cache stores per token and layer: the latent plus the shared rope key."""
    for name, val in (("kv_lora_rank", kv_lora_rank), ("qk_rope_head_dim", qk_rope_head_dim)):
        if isinstance(val, bool) or not isinstance(val, int) or val <= 0:
            raise ValueError(f"mla_cache_values_per_token: `{name}` must be a positive int, got {val!r}")
    return kv_lora_rank + qk_rope_head_dim


def _expanded_attention(q_nope: Array, q_rope: Array, k_nope: Array, k_rope: Array, v: Array,
                        mask: Array, scale: float) -> Array:
    """Softmax attention with per-head keys split into a per-head and a shared part.

    Args:
      q_nope: ``[B, T, H, n]``; q_rope: ``[B, T, H, r]``.
      k_nope: ``[B, S, H, n]``; k_rope: ``[B, S, r]`` (shared by the heads); v: ``[B, S, H, v]``.
      mask: ``[B, T, S]`` bool, True where query ``t`` may see key ``s`` (every query sees >= 1 key).
    Returns:
      ``o [B, T, H, v]`` in float32.
    """
    f32 = jnp.float32
    s = (_einsum("bthn,bshn->bhts", q_nope.astype(f32), k_nope.astype(f32))
         + _einsum("bthr,bsr->bhts", q_rope.astype(f32), k_rope.astype(f32))) * scale
    p = jax.nn.softmax(jnp.where(mask[:, None], s, -jnp.inf), axis=-1)
    return _einsum("bhts,bshv->bthv", p, v.astype(f32))


class MLACache(NamedTuple):
    """The memory of one MLA layer: ``kv_lora_rank + qk_rope_head_dim`` values per token.

    latent: ``[B, L, C]`` normalized latents ``c``; k_rope: ``[B, L, r]`` shared rope keys
    (already rotated when the layer uses RoPE); length: ``[B]`` int32 filled slots per row
    (the position of the next token). ``L`` is the capacity.
    """

    latent: Array
    k_rope: Array
    length: Array

    @property
    def capacity(self) -> int:
        return self.latent.shape[1]


class MLA(nnx.Module):
    """Multi-head Latent Attention token mixer (causal). See the module docstring."""

    @staticmethod
    def check(d_model: int, *, num_heads: int, q_lora_rank: Optional[int] = None,
              kv_lora_rank: int, qk_nope_head_dim: int, qk_rope_head_dim: int, v_head_dim: int,
              use_rope: bool = False, rope_theta: float = 10000.0, output_gate: bool = False,
              decode_read: str = "auto", attention_impl: str = "auto",
              yarn: Optional[YaRN] = None, softmax_scale: Optional[float] = None) -> None:
        """Raise ``ValueError`` naming the first bad argument of ``MLA(...)`` (the same arguments,
        without ``rngs``); ``ModelConfig`` runs it on its MLA part."""
        resolve_read("MLA", decode_read, "decode_read")  # checked here, resolved when traced
        if attention_impl not in ATTENTION_IMPLS:
            raise ValueError(f"MLA: `attention_impl` must be one of {ATTENTION_IMPLS}, got {attention_impl!r}")
        dims = {"d_model": d_model, "num_heads": num_heads, "kv_lora_rank": kv_lora_rank,
                "qk_nope_head_dim": qk_nope_head_dim, "qk_rope_head_dim": qk_rope_head_dim,
                "v_head_dim": v_head_dim}
        if q_lora_rank is not None:
            dims["q_lora_rank"] = q_lora_rank
        for name, val in dims.items():
            if isinstance(val, bool) or not isinstance(val, int) or val <= 0:
                raise ValueError(f"MLA: `{name}` must be a positive int, got {val!r}")
        for name, val in (("use_rope", use_rope), ("output_gate", output_gate)):
            V.require_bool("MLA", name, val)
        if use_rope:
            if qk_rope_head_dim % 2:
                raise ValueError(f"MLA: `qk_rope_head_dim` must be even with use_rope=True, got {qk_rope_head_dim}")
            if not rope_theta > 0:
                raise ValueError(f"MLA: `rope_theta` must be positive, got {rope_theta!r}")

        if yarn is not None and not use_rope:
            raise ValueError("MLA: `yarn` scales RoPE; it needs use_rope=True")
        if softmax_scale is not None and not softmax_scale > 0:
            raise ValueError(f"MLA: `softmax_scale` must be positive or None, got {softmax_scale!r}")

    def __init__(self, d_model: int, *, num_heads: int, q_lora_rank: Optional[int] = None,
                 kv_lora_rank: int, qk_nope_head_dim: int, qk_rope_head_dim: int, v_head_dim: int,
                 use_rope: bool = False, rope_theta: float = 10000.0, output_gate: bool = False,
                 rngs: nnx.Rngs, decode_read: str = "auto", attention_impl: str = "auto",
                 yarn: Optional[YaRN] = None, softmax_scale: Optional[float] = None):
        self.check(d_model, num_heads=num_heads, q_lora_rank=q_lora_rank, kv_lora_rank=kv_lora_rank,
                   qk_nope_head_dim=qk_nope_head_dim, qk_rope_head_dim=qk_rope_head_dim, v_head_dim=v_head_dim,
                   use_rope=use_rope, rope_theta=rope_theta, output_gate=output_gate, decode_read=decode_read,
                   attention_impl=attention_impl, yarn=yarn, softmax_scale=softmax_scale)
        H, n, r, dv = num_heads, qk_nope_head_dim, qk_rope_head_dim, v_head_dim
        self.d_model, self.num_heads = d_model, H
        self.kv_lora_rank, self.nope_dim, self.rope_dim, self.v_dim = kv_lora_rank, n, r, dv
        self.use_rope, self.rope_theta, self.yarn = bool(use_rope), float(rope_theta), yarn
        # Scores are multiplied by this (default (n + r) ** -0.5; DeepSeek-V3's YaRN multiplies it by mscale²).
        self.scale = float(n + r) ** -0.5 if softmax_scale is None else float(softmax_scale)
        self.decode_read = decode_read  # how decode reads the latent cache: memory.cache_read's `read`
        self.attention_impl = attention_impl  # the fused attention of __call__: memory.softmax_attention's `impl`

        if q_lora_rank is None:
            self.wq = Dense(d_model, (H, n + r), axes=("embed", "heads", "head_dim"), rngs=rngs)
            self.wq_down = self.q_norm = self.wq_up = None
        else:
            self.wq = None
            self.wq_down = Dense(d_model, q_lora_rank, axes=("embed", "q_lora"), rngs=rngs)
            self.q_norm = RMSNorm(q_lora_rank, rngs=rngs)
            self.wq_up = Dense(q_lora_rank, (H, n + r), axes=("q_lora", "heads", "head_dim"), rngs=rngs)
        self.wkv_down = Dense(d_model, kv_lora_rank, axes=("embed", "kv_lora"), rngs=rngs)
        self.kv_norm = RMSNorm(kv_lora_rank, rngs=rngs)
        self.wk_rope = Dense(d_model, r, axes=("embed", "rope"), rngs=rngs)
        self.wk_up = Dense(kv_lora_rank, (H, n), axes=("kv_lora", "heads", "head_dim"), rngs=rngs)
        self.wv_up = Dense(kv_lora_rank, (H, dv), axes=("kv_lora", "heads", "head_dim"), rngs=rngs)
        self.w_gate = (Dense(d_model, (H, dv), axes=("embed", "heads", "head_dim"), rngs=rngs)
                       if output_gate else None)
        self.w_out = param(rngs, normal((H * dv) ** -0.5), (H, dv, d_model), ("heads", "head_dim", "embed"))

    # ------------------------------------------------------------------ pieces
    def _queries(self, x: Array, positions: Array) -> tuple[Array, Array]:
        """``x [..., D]``, positions ``[...]`` -> ``(q_nope [..., H, n], q_rope [..., H, r])``."""
        q = self.wq(x) if self.wq is not None else self.wq_up(self.q_norm(self.wq_down(x)))
        q_nope, q_rope = q[..., :self.nope_dim], q[..., self.nope_dim:]
        if self.use_rope:
            q_rope = apply_rope(q_rope, positions[..., None], theta=self.rope_theta, yarn=self.yarn)
        return q_nope, q_rope

    def _latents(self, x: Array, positions: Array) -> tuple[Array, Array]:
        """``x [..., D]``, positions ``[...]`` -> ``(c [..., C], k_rope [..., r])``, what the cache holds."""
        c = self.kv_norm(self.wkv_down(x))
        k_rope = self.wk_rope(x)
        if self.use_rope:
            k_rope = apply_rope(k_rope, positions, theta=self.rope_theta, yarn=self.yarn)
        return c, k_rope

    def _output(self, o: Array, x: Array) -> Array:
        """``o [..., H, v]`` (float32), ``x [..., D]`` -> ``y [..., D]`` in ``x.dtype``."""
        o = o.astype(x.dtype)
        if self.w_gate is not None:
            o = o * jax.nn.sigmoid(self.w_gate(x))
        return jnp.einsum("...hv,hvd->...d", o, self.w_out[...].astype(x.dtype))

    def _check_x(self, fn: str, name: str, x: Array, rank: int, layout: str) -> None:
        V.require_rank(fn, name, x, rank, layout)
        if V.shape_of(x)[-1] != self.d_model:
            raise ValueError(f"{fn}: `{name}` must have width D={self.d_model} ({layout}), got shape {V.shape_of(x)}")

    def _check_cache(self, fn: str, cache: MLACache, batch: int) -> None:
        if not isinstance(cache, MLACache):
            raise ValueError(f"{fn}: `cache` must be an MLACache (see MLA.init_cache), got {type(cache).__name__}")
        L = cache.capacity
        V.require_shape(fn, "cache.latent", cache.latent, (batch, L, self.kv_lora_rank), "[B,L,kv_lora_rank]")
        V.require_shape(fn, "cache.k_rope", cache.k_rope, (batch, L, self.rope_dim), "[B,L,qk_rope_head_dim]")
        V.require_float(fn, "cache.latent", cache.latent)
        V.require_float(fn, "cache.k_rope", cache.k_rope)
        V.check_cache_length(fn, cache.length, batch)

    # ------------------------------------------------------------------ public
    def __call__(self, x: Array, *, segment_ids: Optional[Array] = None) -> Array:
        """Causal MLA over a whole sequence (expanded keys/values, positions ``0..T-1``).

        Args:
          x: ``[B, T, D]``.
          segment_ids: ``[B, T]`` ints; a token attends only within its contiguous segment.
        Returns:
          ``y [B, T, D]``.
        """
        fn = "MLA.__call__"
        self._check_x(fn, "x", x, 3, "[B,T,D]")
        B, T, _ = V.shape_of(x)
        V.check_segment_ids(fn, segment_ids, B, T)
        positions = jnp.broadcast_to(jnp.arange(T), (B, T))
        q_nope, q_rope = self._queries(x, positions)
        c, k_rope = self._latents(x, positions)
        # Expanded per-head keys [nope | shared rope] (n + r wide) over v-wide values: one fused
        # attention with unequal q/k and v widths.
        H = self.num_heads
        q = jnp.concatenate([q_nope, q_rope], axis=-1)
        k = jnp.concatenate([self.wk_up(c), jnp.broadcast_to(k_rope[:, :, None, :].astype(c.dtype),
                                                             (B, T, H, self.rope_dim))], axis=-1)
        o = softmax_attention(q, k, self.wv_up(c), scale=self.scale, causal=True, segment_ids=segment_ids,
                              impl=self.attention_impl)
        return self._output(o, x)

    def init_cache(self, batch: int, max_len: int, dtype=jnp.float32) -> MLACache:
        """An empty cache with room for ``max_len`` tokens per row."""
        batch = V.require_positive_int("MLA.init_cache", "batch", batch)
        max_len = V.require_positive_int("MLA.init_cache", "max_len", max_len)
        dtype = V.require_float_dtype("MLA.init_cache", "dtype", dtype)
        return MLACache(latent=jnp.zeros((batch, max_len, self.kv_lora_rank), dtype),
                        k_rope=jnp.zeros((batch, max_len, self.rope_dim), dtype),
                        length=jnp.zeros((batch,), jnp.int32))

    def prefill(self, x: Array, cache: MLACache, *,
                segment_ids: Optional[Array] = None) -> tuple[Array, MLACache]:
        """Process ``T`` prompt tokens at positions ``cache.length + (0..T-1)`` and cache them.

        The tokens attend to every cached token and causally to each other, with the
        per-head keys/values expanded from the whole cache (capacity ``L``).

        Args:
          x: ``[B, T, D]``.
          cache: an :class:`MLACache` with ``length + T <= L`` in every row.
          segment_ids: ``[B, T]`` ints; the new tokens attend only within their contiguous
            segment, and the cached tokens count as part of the chunk's first segment.
            (Decode reads every cached token, so pack several documents only when the
            last one is the one to continue.)
        Returns:
          ``(y [B, T, D], cache)`` with each row's length advanced by ``T``.
        """
        fn = "MLA.prefill"
        self._check_x(fn, "x", x, 3, "[B,T,D]")
        B, T, _ = V.shape_of(x)
        self._check_cache(fn, cache, B)
        V.check_segment_ids(fn, segment_ids, B, T)
        L = cache.capacity
        if V.is_concrete(cache.length) and V.max_filled(cache.length) + T > L:
            raise ValueError(f"{fn}: `cache` has room for {L} tokens; {V.max_filled(cache.length)} are filled "
                             f"and {T} more do not fit — allocate a larger max_len")
        positions = cache.length[:, None] + jnp.arange(T)                        # [B, T]
        rows = jnp.arange(B)[:, None]
        q_nope, q_rope = self._queries(x, positions)
        c, k_rope = self._latents(x, positions)
        latent = cache.latent.at[rows, positions].set(c.astype(cache.latent.dtype))
        k_rope_all = cache.k_rope.at[rows, positions].set(k_rope.astype(cache.k_rope.dtype))

        mask = jnp.arange(L)[None, None, :] <= positions[:, :, None]            # [B, T, L]
        if segment_ids is not None:
            doc = document_index(segment_ids)
            key_doc = jnp.zeros((B, L), jnp.int32).at[rows, positions].set(doc)  # cached tokens: doc 0
            mask = mask & (key_doc[:, None, :] == doc[:, :, None])
        c_all = latent.astype(x.dtype)
        o = _expanded_attention(q_nope, q_rope, self.wk_up(c_all), k_rope_all, self.wv_up(c_all), mask, self.scale)
        return self._output(o, x), MLACache(latent, k_rope_all, cache.length + T)

    def decode(self, x_t: Array, cache: MLACache) -> tuple[Array, MLACache]:
        """One token at position ``cache.length``, with absorbed up-projections.

        ``q_lat = q_nope · W_uk`` ``[B, H, C]``; scores ``q_lat · cᵀ + q_rope · k_ropeᵀ`` over
        the cached latents ``[B, L, C]``; ``ō = p · c`` ``[B, H, C]``; ``o = ō · W_uv`` ``[B, H, v]``.

        Args:
          x_t: ``[B, D]``.
          cache: an :class:`MLACache` with at least one free slot per row.
        Returns:
          ``(y_t [B, D], cache)`` with each row's length advanced by one.
        """
        fn = "MLA.decode"
        self._check_x(fn, "x_t", x_t, 2, "[B,D]")
        B = V.shape_of(x_t)[0]
        self._check_cache(fn, cache, B)
        L = cache.capacity
        if V.is_concrete(cache.length) and V.max_filled(cache.length) >= L:
            raise ValueError(f"{fn}: `cache` is full (capacity {L}); allocate a larger max_len")
        pos = cache.length                                                       # [B]
        rows = jnp.arange(B)
        q_nope, q_rope = self._queries(x_t, pos)
        c, k_rope = self._latents(x_t, pos)
        latent = cache.latent.at[rows, pos].set(c.astype(cache.latent.dtype))
        k_rope_all = cache.k_rope.at[rows, pos].set(k_rope.astype(cache.k_rope.dtype))

        # The cache is read in its stored dtype (a float32 copy of a bf16 latent cache would be
        # the step's largest buffer: one cause of the H200 decode workspace of 1.5x the cache
        # at 1M tokens, which cut the batch that fits by ~3x);
        # the query side and the probabilities are rounded to it, products accumulate in
        # float32 (the policy of ``memory.softmax``'s ``_attend``).
        f32 = jnp.float32
        q_lat = _einsum("bhn,chn->bhc", q_nope.astype(f32), self.wk_up.kernel[...].astype(f32))
        s = (cache_read("bhc,blc->bhl", q_lat, latent, read=self.decode_read)
             + cache_read("bhr,blr->bhl", q_rope, k_rope_all, read=self.decode_read)) * self.scale
        visible = jnp.arange(L)[None, None, :] <= pos[:, None, None]            # [B, 1, L]
        p = jax.nn.softmax(jnp.where(visible, s, -jnp.inf), axis=-1)
        o_lat = cache_read("bhl,blc->bhc", p, latent, read=self.decode_read)
        o = _einsum("bhc,chv->bhv", o_lat, self.wv_up.kernel[...].astype(f32))
        return self._output(o, x_t), MLACache(latent, k_rope_all, pos + 1)
