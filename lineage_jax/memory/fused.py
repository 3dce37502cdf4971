"""Fused (flash) softmax attention for training and prefill: one function, four implementations.

:func:`attention` computes ``o = softmax(q kᵀ · scale + mask) v`` for ``q [B, T, H, K]``,
``k [B, S, Hkv, K]``, ``v [B, S, Hkv, V]`` (grouped-query when ``Hkv < H``; ``V`` may differ
from ``K``, as in MLA's 192-wide scores over 128-wide values) with a causal mask and packed
documents (``doc_q [B, T]``, ``doc_k [B, S]``: a query sees a key only when both carry the same
document index). None of the implementations keeps ``[B, H, T, S]`` scores for the backward
pass:

* ``"xla"`` — blockwise online softmax in plain JAX (:func:`blockwise_attention`): the keys are
  visited in blocks of ``block_k``; the forward keeps the output and the per-row log-sum-exp,
  the backward recomputes each block's probabilities from them (FlashAttention-2's recurrence,
  Dao 2023, arXiv:2307.08691). Runs everywhere; the CPU default and the fallback.
* ``"cudnn"`` — cuDNN's fused flash attention (NVIDIA GPUs, bf16/fp16 inputs; unequal ``K``/``V``
  widths need Hopper and cuDNN >= 9.10). Packed documents become an additive mask.
* ``"pallas"`` — JAX's Pallas flash-attention kernels: the Triton kernel of
  ``jax.experimental.pallas.ops.gpu.attention`` on GPUs (interpret mode on the CPU), the Mosaic
  kernel of ``jax.experimental.pallas.ops.tpu.flash_attention`` on TPUs. Grouped heads are
  repeated and ``V`` is padded to ``K`` for these kernels.
* ``"auto"`` — ``"cudnn"`` on a GPU when it supports the call, ``"pallas"`` on a TPU, else ``"xla"``.

The dtype policy matches :func:`lineage_jax.memory.softmax._attend`: scores and the softmax in
float32 (float64 for float64 inputs); the probabilities are rounded to ``v``'s dtype before the
value product; products run at the matmul precision in force (:mod:`lineage_jax.numerics`:
float32 on CPU or under ``"highest"``, TF32 for float32 on GPUs by default).
"""

from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from lineage_jax.numerics import at_precision, precision_in_force

Array = jax.Array

IMPLS = ("auto", "xla", "cudnn", "pallas")
RESIDUALS = "attention_residuals"  # checkpoint_name of the blockwise form's output and log-sum-exp
DEFAULT_BLOCK_K = 512


# ---------------------------------------------------------------------------- the XLA form
def _precision(*arrays):
    """The products' precision: the policy in force (``None``; see lineage_jax.numerics)."""
    del arrays
    return None


def _visible(q_pos, k_pos, doc_q, doc_k, k_valid, causal):
    """``[B, 1, 1, T, bk]`` bool: which keys of a block each query sees."""
    vis = k_valid[None, None, None, None, :]
    if causal:
        vis = vis & (k_pos[None, None, None, None, :] <= q_pos[None, None, None, :, None])
    if doc_q is not None:
        vis = vis & (doc_q[:, None, None, :, None] == doc_k[:, None, None, None, :])
    return vis


def _blocks(k, v, doc_k, block):
    """Keys, values (``[B, S, Hkv, D]`` -> ``[nb, B, Hkv, bk, D]``), key docs and positions in blocks."""
    B, S, Hk, _ = k.shape
    nb = -(-S // block)
    pad = nb * block - S
    def split(a):
        a = jnp.pad(a, ((0, 0), (0, pad), (0, 0), (0, 0)))
        return jnp.moveaxis(a.reshape(B, nb, block, Hk, a.shape[-1]), (1, 3), (0, 2))
    kb, vb = split(k), split(v)
    pos = jnp.arange(nb * block).reshape(nb, block)
    docb = None if doc_k is None else jnp.moveaxis(jnp.pad(doc_k, ((0, 0), (0, pad))).reshape(B, nb, block), 1, 0)
    return kb, vb, docb, pos, pos < S


def _fwd_pass(q, k, v, doc_q, doc_k, causal, scale, block):
    """Returns ``o [B, T, H, V]`` (input dtype) and ``lse [B, Hkv, G, T]`` (float32 or wider)."""
    B, T, H, K = q.shape
    Hk, Vd = k.shape[2], v.shape[-1]
    G = H // Hk
    acc = jnp.result_type(jnp.float32, q, k, v)
    prec = _precision(k, v)
    qg = jnp.moveaxis((q.astype(acc) * scale).reshape(B, T, Hk, G, K), 1, 3).astype(k.dtype)  # [B, Hk, G, T, K]
    kb, vb, docb, posb, validb = _blocks(k, v, doc_k, block)
    q_pos = jnp.arange(T)

    def body(carry, xs):
        m, l, o = carry
        kj, vj, dj, pj, okj = xs
        s = jnp.einsum("bhgtk,bhsk->bhgts", qg, kj, precision=prec, preferred_element_type=acc)
        vis = _visible(q_pos, pj, doc_q, dj, okj, causal)
        s = jnp.where(vis, s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        p = jnp.where(vis, jnp.exp(s - m_safe[..., None]), 0.0)
        corr = jnp.exp(jnp.where(jnp.isfinite(m), m, m_safe) - m_safe)
        l = l * corr + jnp.sum(p, axis=-1)
        o = o * corr[..., None] + jnp.einsum("bhgts,bhsv->bhgtv", p.astype(v.dtype), vj, precision=prec,
                                             preferred_element_type=acc)
        return (m_new, l, o), None

    init = (jnp.full((B, Hk, G, T), -jnp.inf, acc), jnp.zeros((B, Hk, G, T), acc), jnp.zeros((B, Hk, G, T, Vd), acc))
    (m, l, o), _ = lax.scan(body, init, (kb, vb, docb, posb, validb))
    seen = l > 0  # rows with no visible key read zero, not NaN
    o = jnp.where(seen[..., None], o / jnp.where(seen, l, 1.0)[..., None], 0.0)
    lse = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), jnp.inf)
    out = jnp.moveaxis(o, 3, 1).reshape(B, T, H, Vd).astype(jnp.result_type(q, k, v))
    return out, lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8))
def _blockwise(q, k, v, doc_q, doc_k, causal, scale, block, prec):
    return _fwd_pass(q, k, v, doc_q, doc_k, causal, scale, block)[0]


def _blockwise_fwd(q, k, v, doc_q, doc_k, causal, scale, block, prec):
    o, lse = _fwd_pass(q, k, v, doc_q, doc_k, causal, scale, block)
    # Named so that a remat policy can keep them (``save_only_these_names(RESIDUALS)``).
    return o, (q, k, v, doc_q, doc_k, checkpoint_name(o, RESIDUALS), checkpoint_name(lse, RESIDUALS))


def _blockwise_bwd(causal, scale, block, prec, res, do):
    with at_precision(prec):  # the forward's precision (this rule is traced where grad transposes)
        return _blockwise_bwd_at(causal, scale, block, res, do)


def _blockwise_bwd_at(causal, scale, block, res, do):
    q, k, v, doc_q, doc_k, o, lse = res
    B, T, H, K = q.shape
    S, Hk = k.shape[1], k.shape[2]
    G = H // Hk
    acc = jnp.result_type(jnp.float32, q, k, v)
    prec = _precision(k, v)
    to_g = lambda a: jnp.moveaxis(a.reshape(B, T, Hk, G, a.shape[-1]), 1, 3)  # [B, T, H, D] -> [B, Hk, G, T, D]
    qg = (to_g(q.astype(acc)) * scale).astype(k.dtype)
    dog = to_g(do.astype(acc))
    delta = jnp.sum(dog * to_g(o.astype(acc)), axis=-1)                        # [B, Hk, G, T]
    dog_v = dog.astype(v.dtype)
    kb, vb, docb, posb, validb = _blocks(k, v, doc_k, block)
    q_pos = jnp.arange(T)

    def body(dq, xs):
        kj, vj, dj, pj, okj = xs
        s = jnp.einsum("bhgtk,bhsk->bhgts", qg, kj, precision=prec, preferred_element_type=acc)
        vis = _visible(q_pos, pj, doc_q, dj, okj, causal)
        p = jnp.where(vis, jnp.exp(s - lse[..., None]), 0.0)
        dv = jnp.einsum("bhgts,bhgtv->bhsv", p.astype(v.dtype), dog_v, precision=prec, preferred_element_type=acc)
        dp = jnp.einsum("bhgtv,bhsv->bhgts", dog_v, vj, precision=prec, preferred_element_type=acc)
        ds = (p * (dp - delta[..., None])).astype(k.dtype)
        dq = dq + jnp.einsum("bhgts,bhsk->bhgtk", ds, kj, precision=prec, preferred_element_type=acc)
        dk = jnp.einsum("bhgts,bhgtk->bhsk", ds, qg, precision=prec, preferred_element_type=acc)
        return dq, (dk, dv)

    dq, (dkb, dvb) = lax.scan(body, jnp.zeros((B, Hk, G, T, K), acc), (kb, vb, docb, posb, validb))
    dq = (jnp.moveaxis(dq, 3, 1).reshape(B, T, H, K) * scale).astype(q.dtype)
    unblock = lambda a: jnp.moveaxis(a, (0, 2), (1, 3)).reshape(B, -1, Hk, a.shape[-1])[:, :S]
    zero = lambda d: None if d is None else np.zeros(d.shape, jax.dtypes.float0)
    return dq, unblock(dkb).astype(k.dtype), unblock(dvb).astype(v.dtype), zero(doc_q), zero(doc_k)


_blockwise.defvjp(_blockwise_fwd, _blockwise_bwd)


def blockwise_attention(q: Array, k: Array, v: Array, *, scale: float, causal: bool = True,
                        doc_q: Optional[Array] = None, doc_k: Optional[Array] = None,
                        block_k: int = DEFAULT_BLOCK_K) -> Array:
    """Softmax attention by blocks of ``block_k`` keys, never holding ``[B, H, T, S]`` scores.

    ``q [B, T, H, K]``, ``k [B, S, Hkv, K]``, ``v [B, S, Hkv, V]``; ``doc_q [B, T]`` / ``doc_k [B, S]``
    integer document indices (both or neither). Differentiable in ``q, k, v`` by a custom VJP
    that recomputes each block's probabilities from the saved log-sum-exp. Memory: one
    ``[B, H, T, block_k]`` float32 block at a time. Arguments are not validated here (see
    :func:`lineage_jax.memory.softmax_attention`).
    """
    block = int(min(block_k, k.shape[1]))
    return _blockwise(q, k, v, doc_q, doc_k, bool(causal), float(scale), block, precision_in_force())


# ---------------------------------------------------------------------------- cuDNN
def _cudnn_unsupported(q, k, v) -> Optional[str]:
    """Why cuDNN's flash attention cannot run this call here (``None`` when it can)."""
    if jax.default_backend() != "gpu":
        return f"cuDNN attention needs an NVIDIA GPU; the default backend is {jax.default_backend()!r}"
    dt = jnp.result_type(q, k, v)
    if dt not in (jnp.bfloat16, jnp.float16):
        return f"cuDNN attention takes bfloat16 / float16 inputs, got {dt}"
    K, Vd = q.shape[-1], v.shape[-1]
    if K % 8 or K > 256 or Vd % 8 or Vd > 256:
        return f"cuDNN attention needs head widths that are multiples of 8 and <= 256, got q/k {K}, v {Vd}"
    return None


CUDNN_SEQ_MULTIPLE = 64  # cuDNN's flash attention (training) takes sequence lengths in multiples of 64


def _cudnn(q, k, v, doc_q, doc_k, causal, scale):
    from jax._src.cudnn.fused_attention_stablehlo import MaskType, dot_product_attention as cudnn_dpa

    dt = jnp.result_type(q, k, v)
    q, k, v = q.astype(dt), k.astype(dt), v.astype(dt)
    Tq, Tk = q.shape[1], k.shape[1]
    pq, pk = -Tq % CUDNN_SEQ_MULTIPLE, -Tk % CUDNN_SEQ_MULTIPLE
    if pq or pk:
        # Pad to the multiple; padded keys form their own document (-1), which no real query
        # sees (causal alone hides them only when they come after every query and T_q == T_k).
        pad = lambda a, n: jnp.pad(a, [(0, 0), (0, n)] + [(0, 0)] * (a.ndim - 2))
        if doc_q is not None or not causal or Tq != Tk:
            doc_q = jnp.zeros(q.shape[:2], jnp.int32) if doc_q is None else doc_q.astype(jnp.int32)
            doc_k = jnp.zeros(k.shape[:2], jnp.int32) if doc_k is None else doc_k.astype(jnp.int32)
            doc_q = jnp.pad(doc_q, [(0, 0), (0, pq)], constant_values=-1)
            doc_k = jnp.pad(doc_k, [(0, 0), (0, pk)], constant_values=-1)
        return _cudnn(pad(q, pq), pad(k, pk), pad(v, pk), doc_q, doc_k, causal, scale)[:, :Tq]
    mask = None
    if doc_q is not None:
        mask = (doc_q[:, :, None] == doc_k[:, None, :])[:, None]               # [B, 1, T, S]
    mask_type = MaskType.CAUSAL if causal else MaskType.NO_MASK
    return cudnn_dpa(q, k, v, None, mask, scale=float(scale), mask_type=mask_type, qkv_layout="BTNH")


# ---------------------------------------------------------------------------- Pallas
def _pallas_unsupported(q, k, v) -> Optional[str]:
    backend = jax.default_backend()
    if backend not in ("gpu", "cpu", "tpu"):
        return f"no Pallas attention kernel for backend {backend!r}"
    if backend == "gpu":
        try:
            from jax.experimental.pallas.ops.gpu import attention  # noqa: F401
        except Exception as e:  # pragma: no cover - depends on the jax build
            return f"jax.experimental.pallas.ops.gpu.attention is unavailable ({e})"
    return None


def _pallas(q, k, v, doc_q, doc_k, causal, scale):
    B, T, H, K = q.shape
    Hk, Vd = k.shape[2], v.shape[-1]
    dt = jnp.result_type(q, k, v)
    if Hk != H:  # the kernels take one key/value head per query head
        k, v = jnp.repeat(k, H // Hk, axis=2), jnp.repeat(v, H // Hk, axis=2)
    if Vd < K:  # ... and values as wide as keys
        v = jnp.pad(v, ((0, 0), (0, 0), (0, 0), (0, K - Vd)))
    elif Vd > K:
        q = jnp.pad(q, ((0, 0), (0, 0), (0, 0), (0, Vd - K)))
        k = jnp.pad(k, ((0, 0), (0, 0), (0, 0), (0, Vd - K)))
    q, k, v = q.astype(dt), k.astype(dt), v.astype(dt)

    def kernel(q, k, v, doc_q, doc_k):
        if jax.default_backend() == "tpu":
            return _pallas_tpu(q, k, v, doc_q, doc_k, causal, scale)
        return _pallas_gpu(q, k, v, doc_q, doc_k, causal, scale, interpret=jax.default_backend() == "cpu")

    # A kernel is a custom call XLA cannot partition (Mosaic refuses one under a multi-device layout): each
    # device runs it on its own sequences and heads (the key heads are repeated to H above).
    from lineage_jax.parallel.rules import per_device

    seq = ("batch", None, "heads", None)
    o = per_device(kernel, (q, k, v, doc_q, doc_k), (seq, seq, seq, ("batch", None), ("batch", None)), seq,
                   what="flash attention kernel")
    return o[..., :Vd]


def _pallas_gpu(q, k, v, doc_q, doc_k, causal, scale, *, interpret):
    from jax.experimental.pallas.ops.gpu.attention import mha

    B, T, H, D = q.shape
    S = k.shape[1]
    if T != S:
        raise ValueError(f"softmax_attention: impl='pallas' on GPUs needs as many keys as queries, got T={T}, S={S}")
    block = 128
    Tp = -(-T // block) * block
    seg = None if doc_q is None else doc_q.astype(jnp.int32)
    if Tp != T:  # padded keys get a document of their own: no real query sees them
        pad = ((0, 0), (0, Tp - T), (0, 0), (0, 0))
        q, k, v = jnp.pad(q, pad), jnp.pad(k, pad), jnp.pad(v, pad)
        seg = jnp.zeros((B, T), jnp.int32) if seg is None else seg
        seg = jnp.pad(seg, ((0, 0), (0, Tp - T)), constant_values=-1)
    kw = {}
    if D > 128:  # 256-wide (padded) heads: 128-row blocks asked for 320 KB of shared memory on an H200
        from jax.experimental.pallas.ops.gpu.attention import BlockSizes
        kw["block_sizes"] = BlockSizes(block_q=64, block_k=64, block_q_dkv=32, block_kv_dkv=32, block_q_dq=32,
                                       block_kv_dq=32)
    o = mha(q, k, v, seg, sm_scale=float(scale), causal=bool(causal), interpret=interpret, **kw)
    return o[:, :T]


TPU_FLASH_BLOCK = 128  # jax.experimental.pallas.ops.tpu.flash_attention's default blocks (and lane width)


def _pallas_tpu(q, k, v, doc_q, doc_k, causal, scale):
    """JAX's Mosaic flash attention, on the shapes it takes: heads wider than 128 zero-padded to a
    multiple of 128 (MLA's 192: q·k unchanged), sequences padded to whole 128-token blocks (padded keys
    in a document of their own, which no real query sees)."""
    from jax.experimental.pallas.ops.tpu.flash_attention import SegmentIds, flash_attention

    B, T, H, D = q.shape
    S = k.shape[1]
    Dp = D if D <= TPU_FLASH_BLOCK else -(-D // TPU_FLASH_BLOCK) * TPU_FLASH_BLOCK
    Tp, Sp = (max(TPU_FLASH_BLOCK, -(-n // TPU_FLASH_BLOCK) * TPU_FLASH_BLOCK) for n in (T, S))
    if Dp != D:
        q, k, v = (jnp.pad(a, ((0, 0), (0, 0), (0, 0), (0, Dp - D))) for a in (q, k, v))
    if (Tp, Sp) != (T, S):
        q = jnp.pad(q, ((0, 0), (0, Tp - T), (0, 0), (0, 0)))
        k, v = (jnp.pad(a, ((0, 0), (0, Sp - S), (0, 0), (0, 0))) for a in (k, v))
        doc_q = jnp.zeros((B, T), jnp.int32) if doc_q is None else doc_q.astype(jnp.int32)
        doc_k = jnp.zeros((B, S), jnp.int32) if doc_k is None else doc_k.astype(jnp.int32)
        doc_q = jnp.pad(doc_q, ((0, 0), (0, Tp - T)), constant_values=-1)
        doc_k = jnp.pad(doc_k, ((0, 0), (0, Sp - S)), constant_values=-2)
    seg = None if doc_q is None else SegmentIds(q=doc_q.astype(jnp.int32), kv=doc_k.astype(jnp.int32))
    t = lambda a: jnp.swapaxes(a, 1, 2)
    o = flash_attention(t(q), t(k), t(v), segment_ids=seg, causal=bool(causal), sm_scale=float(scale))
    return t(o)[:, :T, :, :D]


# ---------------------------------------------------------------------------- dispatch
def resolve_impl(fn: str, impl: str, q: Array, k: Array, v: Array, arg: str = "impl") -> str:
    """The implementation :func:`attention` runs for ``impl`` on this backend (``"auto"`` picks).

    Raises ``ValueError`` naming ``arg`` for an unknown name, or when the named implementation
    cannot run this call on this backend (the message says why)."""
    if impl not in IMPLS:
        raise ValueError(f"{fn}: `{arg}` must be one of {IMPLS}, got {impl!r}")
    if impl == "auto":
        backend = jax.default_backend()
        if backend == "gpu" and _cudnn_unsupported(q, k, v) is None:
            return "cudnn"
        if backend == "tpu":
            return "pallas"
        return "xla"
    why = {"cudnn": _cudnn_unsupported, "pallas": _pallas_unsupported, "xla": lambda *a: None}[impl](q, k, v)
    if why is not None:
        raise ValueError(f"{fn}: `{arg}`={impl!r} is unavailable here: {why}; use 'auto' or 'xla'")
    return impl


def attention(q: Array, k: Array, v: Array, *, scale: float, causal: bool, doc_q: Optional[Array],
              doc_k: Optional[Array], impl: str, fn: str = "attention") -> Array:
    """Dispatch to the implementation ``impl`` resolves to (shapes already checked by the caller)."""
    impl = resolve_impl(fn, impl, q, k, v)
    if impl == "cudnn":
        return _cudnn(q, k, v, doc_q, doc_k, causal, scale)
    if impl == "pallas":
        return _pallas(q, k, v, doc_q, doc_k, causal, scale)
    return blockwise_attention(q, k, v, scale=scale, causal=causal, doc_q=doc_q, doc_k=doc_k)
