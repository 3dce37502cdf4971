"""Softmax attention and its KV cache: the memory that keeps everything.

``o_t = softmax(q_t K_{1:t}ᵀ · scale) V_{1:t}``. Layout ``[B, T, H, D]``; keys and
values may have fewer heads than queries (grouped-query attention: ``H`` must be a
multiple of ``Hkv``). Scores and the softmax are computed in float32 (or wider).

The cache is a pytree (:class:`KVCache`) of preallocated ``[B, L, Hkv, D]`` slots
plus a per-row fill length; :func:`softmax_attention_step` appends one token and
reads every filled slot, so prefill followed by decode equals the full sequence.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from lineage_jax.memory import _validate as V
from lineage_jax.memory import fused
from lineage_jax.memory.segments import document_index

Array = jax.Array


class KVCache(NamedTuple):
    """Growing memory of one attention layer.

    k: ``[B, L, Hkv, K]`` keys; v: ``[B, L, Hkv, V]`` values (``L`` = capacity);
    length: ``[B]`` int32, the number of filled slots per row.
    """

    k: Array
    v: Array
    length: Array

    @property
    def capacity(self) -> int:
        return self.k.shape[1]


def init_kv_cache(batch: int, max_len: int, num_kv_heads: int, head_dim: int, *,
                  v_head_dim: Optional[int] = None, dtype=jnp.float32) -> KVCache:
    """An empty cache with room for ``max_len`` tokens."""
    fn = "init_kv_cache"
    batch, max_len = V.require_positive_int(fn, "batch", batch), V.require_positive_int(fn, "max_len", max_len)
    num_kv_heads = V.require_positive_int(fn, "num_kv_heads", num_kv_heads)
    head_dim = V.require_positive_int(fn, "head_dim", head_dim)
    v_head_dim = head_dim if v_head_dim is None else V.require_positive_int(fn, "v_head_dim", v_head_dim)
    dtype = V.require_float_dtype(fn, "dtype", dtype)
    return KVCache(
        k=jnp.zeros((batch, max_len, num_kv_heads, head_dim), dtype),
        v=jnp.zeros((batch, max_len, num_kv_heads, v_head_dim), dtype),
        length=jnp.zeros((batch,), jnp.int32),
    )


def kv_cache_from_prefill(k: Array, v: Array, max_len: int) -> KVCache:
    """A cache holding a prefilled prompt's keys/values ``[B, T, Hkv, D]``, capacity ``max_len``."""
    fn = "kv_cache_from_prefill"
    V.require_rank(fn, "k", k, 4, "[B,T,Hkv,K]")
    V.require_rank(fn, "v", v, 4, "[B,T,Hkv,V]")
    B, T, Hk, _ = V.shape_of(k)
    if V.shape_of(v)[:3] != (B, T, Hk):
        raise ValueError(f"{fn}: `v` must match `k` in [B,T,Hkv] = {(B, T, Hk)}, got {V.shape_of(v)}")
    V.require_float(fn, "k", k)
    V.require_float(fn, "v", v)
    if not V.is_int(max_len) or max_len < T:
        raise ValueError(f"{fn}: `max_len` must be an int >= the prompt length {T}, got {max_len!r}")
    max_len = int(max_len)
    pad = [(0, 0), (0, max_len - T), (0, 0), (0, 0)]
    return KVCache(jnp.pad(k, pad), jnp.pad(v, pad), jnp.full((B,), T, jnp.int32))


def check_kv_cache(fn: str, cache: KVCache, batch: int, key_dim: int) -> None:
    """``cache`` is a :class:`KVCache` for ``batch`` rows of ``key_dim``-wide keys: ``k [B, L, Hkv, K]``,
    ``v [B, L, Hkv, V]`` and ``length [B]`` integers (none negative, when concrete)."""
    if not isinstance(cache, KVCache):
        raise ValueError(f"{fn}: `cache` must be a KVCache (see init_kv_cache / kv_cache_from_prefill), "
                         f"got {type(cache).__name__}")
    V.require_rank(fn, "cache.k", cache.k, 4, "[B,L,Hkv,K]")
    _, L, Hk, _ = V.shape_of(cache.k)
    V.require_shape(fn, "cache.k", cache.k, (batch, L, Hk, key_dim), "[B,L,Hkv,K] (B, K as in q)")
    V.require_rank(fn, "cache.v", cache.v, 4, "[B,L,Hkv,V]")
    if V.shape_of(cache.v)[:3] != (batch, L, Hk):
        raise ValueError(f"{fn}: `cache.v` must have shape [B,L,Hkv,V] with B,L,Hkv = {(batch, L, Hk)} as in "
                         f"cache.k, got {V.shape_of(cache.v)}")
    for name, a in (("cache.k", cache.k), ("cache.v", cache.v)):
        if not jnp.issubdtype(a.dtype, jnp.floating):
            raise ValueError(f"{fn}: `{name}` must be a floating-point array, got dtype {a.dtype}")
    V.check_cache_length(fn, cache.length, batch)


def _check_attention(fn: str, q: Array, k: Array, v: Array, causal: bool, segment_ids: Optional[Array]) -> int:
    """Validate a whole-sequence attention call; returns ``K`` (the key width)."""
    V.require_rank(fn, "q", q, 4, "[B,T,H,K]")
    V.require_rank(fn, "k", k, 4, "[B,S,Hkv,K]")
    V.require_rank(fn, "v", v, 4, "[B,S,Hkv,V]")
    B, T, H, K = V.shape_of(q)
    _, S, Hk, _ = V.shape_of(k)
    if T == 0 or S == 0:
        raise ValueError(f"{fn}: `{'q' if T == 0 else 'k'}` has {'T' if T == 0 else 'S'} = 0 tokens; need at least one")
    V.require_shape(fn, "k", k, (B, S, Hk, K), "[B,S,Hkv,K] (B, K as in q)")
    if V.shape_of(v)[:3] != (B, S, Hk):
        raise ValueError(f"{fn}: `v` must have shape [B,S,Hkv,V] with B,S,Hkv = {(B, S, Hk)}, got {V.shape_of(v)}")
    for name, a in (("q", q), ("k", k), ("v", v)):
        V.require_float(fn, name, a)
    _check_heads(fn, H, Hk)
    concrete_bool = isinstance(causal, (bool, np.bool_)) or (
        np.shape(causal) == () and getattr(causal, "dtype", None) == np.bool_
        and not isinstance(causal, jax.core.Tracer))
    if not concrete_bool:
        raise ValueError(f"{fn}: `causal` must be a bool, got {causal!r}")
    if causal and S != T:
        raise ValueError(f"{fn}: causal attention needs as many keys as queries; `k` has S={S}, `q` has T={T}")
    if segment_ids is not None and S != T:
        raise ValueError(f"{fn}: `segment_ids` needs S == T, got S={S}, T={T}")
    V.check_segment_ids(fn, segment_ids, B, T)
    return K


def _check_heads(fn: str, H: int, Hk: int) -> int:
    if Hk <= 0 or H % Hk:
        raise ValueError(f"{fn}: query heads H={H} must be a multiple of key/value heads Hkv={Hk}")
    return H // Hk


def _attend(q: Array, k: Array, v: Array, mask: Array, scale: float) -> Array:
    """q ``[B, Tq, H, K]``, k/v ``[B, Tk, Hkv, D]``, mask broadcastable to ``[B, H, Tq, Tk]``.

    Keys and values are read in their stored dtype (a bf16 KV cache is never copied to
    float32: at long contexts that copy would be the largest buffer of a decode step);
    products accumulate in float32 (float64 for float64 inputs) and the softmax runs
    there. The query (and the probabilities) are rounded to the keys' (values') dtype.
    """
    B, Tq, H, K = q.shape
    Hk = k.shape[2]
    acc = jnp.result_type(jnp.float32, q, k, v)
    precision = None  # the matmul precision in force (lineage_jax.numerics)
    qg = (q.astype(acc).reshape(B, Tq, Hk, H // Hk, K) * scale).astype(k.dtype)
    s = jnp.einsum("bqhgk,bshk->bhgqs", qg, k, precision=precision, preferred_element_type=acc)
    s = s.reshape(B, H, Tq, -1)
    s = jnp.where(mask, s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    p = jnp.where(mask, p, 0.0)  # rows with no visible key (never for causal) read zero, not NaN
    p = p.reshape(B, Hk, H // Hk, Tq, -1).astype(v.dtype)
    o = jnp.einsum("bhgqs,bshv->bqhgv", p, v, precision=precision, preferred_element_type=acc)
    return o.reshape(B, Tq, H, -1).astype(jnp.result_type(q, k, v))


def softmax_attention(q: Array, k: Array, v: Array, *, scale: Optional[float] = None,
                      causal: bool = True, segment_ids: Optional[Array] = None, impl: str = "auto") -> Array:
    """Softmax attention over a whole sequence, fused: no ``[B, H, T, S]`` scores are kept.

    Args:
      q: ``[B, T, H, K]``; k: ``[B, S, Hkv, K]``; v: ``[B, S, Hkv, V]`` (``S = T`` when causal;
        ``H`` a multiple of ``Hkv``; ``V`` may differ from ``K``).
      scale: multiplies ``q`` (default ``K ** -0.5``).
      causal: token ``t`` sees keys ``<= t``.
      segment_ids: ``[B, T]``; a token sees only keys of its own contiguous segment.
      impl: ``"xla"`` (blockwise online softmax in plain JAX, any backend), ``"cudnn"`` (cuDNN
        flash attention: NVIDIA GPUs, bf16/fp16), ``"pallas"`` (JAX's Pallas flash kernels: Triton
        on GPUs, interpret mode on the CPU, Mosaic on TPUs) or ``"auto"`` (cuDNN on a GPU when it
        supports the call, Pallas on a TPU, else XLA). See :mod:`lineage_jax.memory.fused`.
    Returns:
      ``o [B, T, H, V]``.
    """
    fn = "softmax_attention"
    K = _check_attention(fn, q, k, v, causal, segment_ids)
    scale = V.resolve_scale(fn, scale, K)
    doc = None if segment_ids is None else document_index(segment_ids)
    return fused.attention(q, k, v, scale=scale, causal=bool(causal), doc_q=doc, doc_k=doc, impl=impl, fn=fn)


def reference_attention(q: Array, k: Array, v: Array, *, scale: Optional[float] = None, causal: bool = True,
                        segment_ids: Optional[Array] = None) -> Array:
    """The unfused form of :func:`softmax_attention`: the whole ``[B, H, T, S]`` score matrix at once.

    For tests and small problems; same arguments and dtype policy, no ``impl``."""
    fn = "reference_attention"
    K = _check_attention(fn, q, k, v, causal, segment_ids)
    B, T, H, _ = V.shape_of(q)
    S = V.shape_of(k)[1]
    scale = V.resolve_scale(fn, scale, K)
    mask = jnp.ones((1, 1, T, S), dtype=bool)
    if causal:
        mask = mask & jnp.tril(jnp.ones((T, S), dtype=bool))
    if segment_ids is not None:
        doc = document_index(segment_ids)
        mask = mask & (doc[:, None, :, None] == doc[:, None, None, :])
    return _attend(q, k, v, mask, scale)


def softmax_attention_extend(q: Array, k: Array, v: Array, cache: KVCache, *, scale: Optional[float] = None,
                             segment_ids: Optional[Array] = None) -> tuple[Array, KVCache]:
    """Append ``T`` tokens to ``cache`` and attend causally over everything filled.

    Row ``b``'s new tokens take positions ``cache.length[b] + t``. Prefill is this
    call on an empty cache; :func:`softmax_attention_step` is ``T = 1``.

    Args:
      q: ``[B, T, H, K]``; k: ``[B, T, Hkv, K]``; v: ``[B, T, Hkv, V]``.
      segment_ids: optional ``[B, T]`` for the new tokens; the cached tokens count as
        the first new segment's document (the prompt continues what is cached).
    Returns:
      ``(o [B, T, H, V], cache)``.
    """
    fn = "softmax_attention_extend"
    V.require_rank(fn, "q", q, 4, "[B,T,H,K]")
    B, T, H, K = V.shape_of(q)
    if T == 0:
        raise ValueError(f"{fn}: `q` has T = 0 tokens; need at least one")
    V.require_float(fn, "q", q)
    check_kv_cache(fn, cache, B, K)
    _, L, Hk, _ = V.shape_of(cache.k)
    V.require_shape(fn, "k", k, (B, T, Hk, K), "[B,T,Hkv,K] (as the cache)")
    V.require_shape(fn, "v", v, (B, T, Hk, cache.v.shape[-1]), "[B,T,Hkv,V] (as the cache)")
    V.require_float(fn, "k", k)
    V.require_float(fn, "v", v)
    _check_heads(fn, H, Hk)
    V.check_segment_ids(fn, segment_ids, B, T)
    if V.is_concrete(cache.length) and V.max_filled(cache.length) + T > L:
        raise ValueError(f"{fn}: `cache` is full: {V.max_filled(cache.length)} + {T} tokens exceed capacity {L}; "
                         "allocate a larger max_len")
    scale = V.resolve_scale(fn, scale, K)
    write = jax.vmap(lambda buf, new, start: lax.dynamic_update_slice_in_dim(buf, new, start, axis=0))
    k_all = write(cache.k, k.astype(cache.k.dtype), cache.length)
    v_all = write(cache.v, v.astype(cache.v.dtype), cache.length)
    q_pos = cache.length[:, None] + jnp.arange(T)[None, :]  # [B, T]
    key_pos = jnp.arange(L)
    mask = key_pos[None, None, :] <= q_pos[:, :, None]  # [B, T, L]
    if segment_ids is not None:
        doc_new = document_index(segment_ids)
        # Document of every slot: cached slots are doc 0, new slot j holds token j − length.
        idx = jnp.clip(key_pos[None, :] - cache.length[:, None], 0, T - 1)
        doc_key = jnp.where(key_pos[None, :] < cache.length[:, None], 0, jnp.take_along_axis(doc_new, idx, axis=1))
        mask = mask & (doc_new[:, :, None] == doc_key[:, None, :])
    o = _attend(q, k_all, v_all, mask[:, None], scale)
    return o, KVCache(k_all, v_all, cache.length + T)


READS = ("auto", "dot", "reduce")


def resolve_read(fn: str, read: str, arg: str = "read", *, reuse: int = 1) -> str:
    """``"dot"`` or ``"reduce"``: how a decode step reads its cache (``"auto"`` picks).

    ``"dot"`` reads with ``dot_general`` (einsum); ``"reduce"`` with multiply-and-reduce
    fusions. ``reuse`` is how many query rows meet each cached element (``H / Hkv`` for
    softmax attention; all ``H`` heads for MLA's shared latent). Measured on the H200
    (2026-11-30, ``python -m experiments.kv_read``, one layer, 1M tokens, bf16):

    * MHA (16 heads x 128, reuse 1): dot 19.2 ms (447 GB/s; XLA:GPU copied K and V into
      the layout its batched product wants, a temporary as large as the cache, every
      step), reduce 2.36 ms (3634 GB/s, no copy);
    * MLA's latent read (512 + 64 channels, 16 heads, reuse 16): dot 0.94 ms (1292 GB/s),
      reduce 9.1 ms — a product with reuse is a matmul, and the dot keeps it one.

    On the 2-core CPU the reduce read was 7-10x slower than the dot (probe at 64K tokens). So ``"auto"`` means
    ``"reduce"`` on a GPU when ``reuse == 1`` and ``"dot"`` otherwise (grouped-query reuse
    2-8 and TPUs are not measured yet: they keep the dot). The backend is
    ``jax.default_backend()`` when the step is traced: a step jitted for another platform
    (``jax.default_device``, a CPU ``jit`` on a GPU host) should pass ``read`` explicitly.
    """
    if read not in READS:
        raise ValueError(f"{fn}: `{arg}` must be one of {READS}, got {read!r}")
    if isinstance(reuse, bool) or not isinstance(reuse, int) or reuse < 1:
        raise ValueError(f"{fn}: `reuse` must be a positive int, got {reuse!r}")
    if read == "auto":
        return "reduce" if jax.default_backend() == "gpu" and reuse == 1 else "dot"
    return read


def cache_read(spec: str, x: Array, cached: Array, *, read: str = "auto") -> Array:
    """``einsum(spec, x, cached)`` for a decode step's read of a cache, in one of two forms.

    ``spec`` is a two-operand einsum over single letters (``"bhc,blc->bhl"``); ``cached`` is
    read in its stored dtype: ``x`` is rounded to it and products accumulate in float32
    (float64 for a float64 cache; unlike :func:`_attend`, a float64 ``x`` does not widen the
    accumulation of a float32 cache), the dtype policy of :func:`_attend`. ``read="dot"`` is
    the einsum; ``"reduce"`` broadcasts ``x`` into the cache's own axis order (its letters
    missing from the cache go just before the cache's minor axis), multiplies and sums —
    a fusion that streams the cache once in its layout, with no transposed copy.
    ``"auto"``: see :func:`resolve_read`, with ``reuse`` the size of ``x``'s axes that the
    cache lacks.
    """
    parts = spec.replace(" ", "").split("->")
    ops = parts[0].split(",") if len(parts) == 2 else []
    if (len(ops) != 2 or not all(t.isalpha() and len(set(t)) == len(t) for t in ops + [parts[1]])
            or not set(parts[1]) <= set(ops[0] + ops[1])):
        raise ValueError(f"cache_read: `spec` must be 'x,cache->out' over single letters, each once per "
                         f"operand, out drawn from the inputs; got {spec!r}")
    (xs, cs), out = ops, parts[1]
    if not jnp.issubdtype(jnp.result_type(cached), jnp.inexact):
        raise ValueError(f"cache_read: `cached` must be a floating cache (x is rounded to its dtype), "
                         f"got {jnp.result_type(cached)}")
    for name, letters, arr in (("x", xs, x), ("cached", cs, cached)):
        if len(letters) != jnp.ndim(arr):
            raise ValueError(f"cache_read: `{name}` has shape {V.shape_of(arr)}, but `spec` {spec!r} gives it "
                             f"{len(letters)} axes")
    for a in set(xs) & set(cs):
        if x.shape[xs.index(a)] != cached.shape[cs.index(a)]:
            raise ValueError(f"cache_read: axis {a!r} of `spec` {spec!r} has size {x.shape[xs.index(a)]} in `x` "
                             f"but {cached.shape[cs.index(a)]} in `cached`")
    extra = [a for a in xs if a not in cs]
    reuse = 1
    for a in extra:
        reuse *= x.shape[xs.index(a)]
    read = resolve_read("cache_read", read, reuse=reuse)
    acc = jnp.result_type(jnp.float32, cached)
    x = x.astype(cached.dtype)
    if read == "dot":
        precision = None  # the matmul precision in force (lineage_jax.numerics)
        return jnp.einsum(f"{xs},{cs}->{out}", x, cached, precision=precision, preferred_element_type=acc)
    order = list(cs[:-1]) + extra + [cs[-1]]  # the cache's axes in place, x's own before its minor axis
    def lift(arr, letters):
        arr = jnp.transpose(arr.astype(acc), [letters.index(a) for a in order if a in letters])
        return lax.expand_dims(arr, [i for i, a in enumerate(order) if a not in letters])
    prod = lift(x, xs) * lift(cached, cs)
    kept = [a for a in order if a in out]
    summed = jnp.sum(prod, axis=tuple(i for i, a in enumerate(order) if a not in out))
    return jnp.transpose(summed, [kept.index(a) for a in out])


def _attend_one(q: Array, k: Array, v: Array, visible: Array, scale: float, read: str) -> Array:
    """One query per row: q ``[B, H, K]``, k/v ``[B, L, Hkv, D]``, visible ``[B, L]``; the
    dtype policy of :func:`_attend`, the cache read by :func:`cache_read`."""
    B, H, K = q.shape
    Hk = k.shape[2]
    acc = jnp.result_type(jnp.float32, q, k, v)
    qg = q.astype(acc).reshape(B, Hk, H // Hk, K) * scale
    s = cache_read("bhgk,blhk->bhgl", qg, k, read=read)                       # [B, Hkv, G, L]
    mask = visible[:, None, None, :]
    p = jax.nn.softmax(jnp.where(mask, s, -jnp.inf), axis=-1)
    p = jnp.where(mask, p, 0.0)
    o = cache_read("bhgl,blhv->bhgv", p, v, read=read)                       # [B, Hkv, G, V]
    return o.reshape(B, H, -1).astype(jnp.result_type(q, k, v))


def softmax_attention_step(q_t: Array, k_t: Array, v_t: Array, cache: KVCache, *,
                           scale: Optional[float] = None, read: str = "auto") -> tuple[Array, KVCache]:
    """Decode one token: append ``(k_t, v_t)`` to ``cache``, read every filled slot.

    Args:
      q_t: ``[B, H, K]``; k_t: ``[B, Hkv, K]``; v_t: ``[B, Hkv, V]``.
      read: ``"dot"`` (the einsum of :func:`softmax_attention_extend`), ``"reduce"``
        (multiply-and-reduce, no transposed copy of the cache) or ``"auto"`` (see
        :func:`resolve_read`). Both compute the same thing up to summation order.
    Returns:
      ``(o_t [B, H, V], cache)`` with each row's length advanced by one.
    """
    fn = "softmax_attention_step"
    V.require_rank(fn, "q_t", q_t, 3, "[B,H,K]")
    B, H, K = V.shape_of(q_t)
    V.require_float(fn, "q_t", q_t)
    check_kv_cache(fn, cache, B, K)
    _, L, Hk, _ = V.shape_of(cache.k)
    V.require_shape(fn, "k_t", k_t, (B, Hk, K), "[B,Hkv,K] (as the cache)")
    V.require_shape(fn, "v_t", v_t, (B, Hk, cache.v.shape[-1]), "[B,Hkv,V] (as the cache)")
    V.require_float(fn, "k_t", k_t)
    V.require_float(fn, "v_t", v_t)
    read = resolve_read(fn, read, reuse=_check_heads(fn, H, Hk))
    if read == "dot":
        o, cache = softmax_attention_extend(q_t[:, None], k_t[:, None], v_t[:, None], cache, scale=scale)
        return o[:, 0], cache
    if V.is_concrete(cache.length) and V.max_filled(cache.length) + 1 > L:
        raise ValueError(f"{fn}: `cache` is full: {V.max_filled(cache.length)} + 1 tokens exceed capacity {L}; "
                         "allocate a larger max_len")
    scale = V.resolve_scale(fn, scale, K)
    rows = jnp.arange(B)
    # mode="clip": a full cache under jit overwrites its last slot, as the dot path's
    # dynamic_update_slice does (the concrete check above refuses it outside jit).
    k_all = cache.k.at[rows, cache.length].set(k_t.astype(cache.k.dtype), mode="clip")
    v_all = cache.v.at[rows, cache.length].set(v_t.astype(cache.v.dtype), mode="clip")
    visible = jnp.arange(L)[None, :] <= cache.length[:, None]
    return _attend_one(q_t, k_all, v_all, visible, scale, read), KVCache(k_all, v_all, cache.length + 1)
