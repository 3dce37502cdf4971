"""Pallas short causal convolution: the kernel path of
:func:`~lineage_jax.layers.memory_mixer.causal_conv` (no prefix: training and a fresh prefill).

``y[b, t, c] = Σ_i w[i, c] · x[b, t − i, c]`` over ``i < W`` taps, float32 accumulation, a tap
contributing only where ``t − i ≥ 0`` and (with ``doc``) ``doc[b, t − i] == doc[b, t]``, so a
packed document never reads its neighbour. The output has ``x``'s dtype.

Why a kernel: XLA builds the forward from ``W`` shifted slices of a padded copy and
differentiates it into pads, bf16 adds, a recomputation and two-pass reductions. In the 12-layer
KDA + MLA hybrid at batch 1 × 32768 (6144 channels, bf16; one H200) those were the six largest
XLA fusions of a training step, ≈ 3.5 ms per KDA layer. Here each program reads its
``[block_t, block_c]`` tile once per tap (a tap's shifted rows are mostly the same rows: cache
hits) and writes it once: at that shape the forward takes 0.54 ms (XLA's 0.62) and forward +
backward 0.80 ms (XLA's 1.34; without document masks) — still about three times the time its memory traffic needs.

Kernels (written for the Pallas **Triton** lowering; the Pallas interpreter runs them on the CPU):

* ``causal_conv_fwd``: grid ``(B, ⌈T / block_t⌉, ⌈C / block_c⌉)``; ``W`` masked loads of
  ``x`` at rows ``t − i``, one store of ``y``.
* ``causal_conv_bwd``: the same grid; ``dx[t] = Σ_i w[i] · dy[t + i]`` (the masks of the
  forward, read from the other side) and each program's partial ``dw[i] = Σ_t dy[t] · x[t − i]``
  over its rows, summed over the row blocks outside the kernel (float32).

The inputs are whole-array refs read at shifted row windows; compiled, a window that starts
before row 0 or ends after row ``T`` is only read where its mask allows (Triton's masked
loads). The interpreter clamps such windows instead, so in interpret mode the wrapper pads
the row axis by ``W − 1`` on both sides and the kernels add that offset (``base``) to every
row index — the same masks decide what is read.

Reverse mode is a ``jax.custom_vjp``; ``doc`` gets no gradient. Compiled, the kernels address
memory with 32-bit element offsets: ``x`` must hold fewer than ``2**31`` elements (:func:`fits`;
:func:`~lineage_jax.layers.memory_mixer.causal_conv` runs XLA's form beyond it).
"""

from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from lineage_jax.layers.grouped_pallas import _whole

try:  # present in jax 0.10 and 0.11
    from jax.experimental.pallas import triton as pltriton
except Exception:  # pragma: no cover
    pltriton = None

Array = jax.Array
F32 = jnp.float32

# Tile of one program: rows x channels (powers of two: Triton's block shapes), 4 warps. At the
# mixers' channel counts (multiples of 128) every channel block is full. On one H200 at
# (1, 32768, 6144) bf16, rows 32-128 x channels 64-256 x 4 or 8 warps all ran the forward in
# 0.45-0.6 ms (one setting, 128 x 256 at 4 warps, spilled: 8.8 ms); this one is among the fastest
# forward + backward.
BLOCK_T = 64
BLOCK_C = 128
NUM_WARPS = 4


def available() -> bool:
    """Whether the kernels run here: compiled on GPUs, interpreted on the CPU (Triton lowering)."""
    return pltriton is not None and jax.default_backend() in ("gpu", "cpu")


def fits(x: Array) -> bool:
    """Whether ``x [B, T, C]`` is within the compiled kernels' 32-bit element offsets."""
    return x.size < 2**31


def _interpret() -> bool:
    return jax.default_backend() == "cpu"


def _block_c(C: int) -> int:
    return min(BLOCK_C, 1 << (C - 1).bit_length())


def _params(interpret: bool):
    if interpret or pltriton is None:
        return None
    return pltriton.CompilerParams(num_warps=NUM_WARPS, num_stages=1)


def _load(ref, idx, mask, other):
    return pltriton.load(ref.at[idx], mask=mask, other=other)


def _store(ref, idx, val, mask):
    pltriton.store(ref.at[idx], val, mask=mask)


def _tile(T, C, bt, bc):
    """Row and channel indices of this program's tile, and their in-range masks."""
    n, j = pl.program_id(1), pl.program_id(2)
    t = n * bt + jnp.arange(bt)
    c = j * bc + jnp.arange(bc)
    return n * bt, j * bc, t, c, t < T, c < C


def causal_conv_fwd(*refs, W, T, C, bt, bc, base, has_doc):
    x_ref, w_ref, *rest = refs
    doc_ref, y_ref = rest if has_doc else (None, *rest)
    b = pl.program_id(0)
    t0, c0, t, c, tm, cm = _tile(T, C, bt, bc)
    if has_doc:
        d0 = _load(doc_ref, (b, pl.ds(t0 + base, bt)), tm, -1)
    acc = jnp.zeros((bt, bc), F32)
    for i in range(W):
        rows_ok = tm & (t - i >= 0)
        if has_doc:
            di = _load(doc_ref, (b, pl.ds(t0 - i + base, bt)), rows_ok, -2)
            rows_ok = rows_ok & (di == d0)
        m = rows_ok[:, None] & cm[None, :]
        xi = _load(x_ref, (b, pl.ds(t0 - i + base, bt), pl.ds(c0, bc)), m, 0.0).astype(F32)
        wi = _load(w_ref, (jnp.int32(i), pl.ds(c0, bc)), cm, 0.0).astype(F32)
        acc += xi * wi[None, :]
    _store(y_ref, (b, pl.ds(t0 + base, bt), pl.ds(c0, bc)), acc.astype(y_ref.dtype), tm[:, None] & cm[None, :])


def causal_conv_bwd(*refs, W, T, C, bt, bc, base, has_doc):
    x_ref, dy_ref, w_ref, *rest = refs
    doc_ref, dx_ref, dw_ref = rest if has_doc else (None, *rest)
    b = pl.program_id(0)
    t0, c0, t, c, tm, cm = _tile(T, C, bt, bc)
    n = pl.program_id(1)
    if has_doc:
        d0 = _load(doc_ref, (b, pl.ds(t0 + base, bt)), tm, -1)
    full = tm[:, None] & cm[None, :]
    dy0 = _load(dy_ref, (b, pl.ds(t0 + base, bt), pl.ds(c0, bc)), full, 0.0).astype(F32)
    dx = jnp.zeros((bt, bc), F32)
    for i in range(W):
        wi = _load(w_ref, (jnp.int32(i), pl.ds(c0, bc)), cm, 0.0).astype(F32)
        # dx[t] += w[i] · dy[t + i] where row t + i exists and is in t's document
        ahead = tm & (t + i < T)
        back = tm & (t - i >= 0)
        if has_doc:
            da = _load(doc_ref, (b, pl.ds(t0 + i + base, bt)), ahead, -2)
            ahead = ahead & (da == d0)
            db = _load(doc_ref, (b, pl.ds(t0 - i + base, bt)), back, -2)
            back = back & (db == d0)
        dyi = _load(dy_ref, (b, pl.ds(t0 + i + base, bt), pl.ds(c0, bc)), ahead[:, None] & cm[None, :], 0.0)
        dx += dyi.astype(F32) * wi[None, :]
        # dw[i] += Σ_t dy[t] · x[t − i] over this program's rows
        xi = _load(x_ref, (b, pl.ds(t0 - i + base, bt), pl.ds(c0, bc)), back[:, None] & cm[None, :], 0.0)
        _store(dw_ref, (b, n, jnp.int32(i), pl.ds(c0, bc)), jnp.sum(dy0 * xi.astype(F32), axis=0), cm)
    _store(dx_ref, (b, pl.ds(t0 + base, bt), pl.ds(c0, bc)), dx.astype(dx_ref.dtype), full)


def _pad_rows(a: Array, pad: int) -> Array:
    widths = [(0, 0)] * a.ndim
    widths[1] = (pad, pad)
    return jnp.pad(a, widths) if pad else a


def _launch(kernel, rows, w, doc, outs, *, interpret):
    """Run ``kernel`` over ``rows`` (``[B, T, C]`` arrays read at shifted rows), ``w`` and ``doc``;
    ``outs``: ``(shape, dtype)`` of each output, the ``[B, T, C]`` ones written by row."""
    B, T, C = rows[0].shape
    bt, bc = BLOCK_T, _block_c(C)
    base = w.shape[0] - 1 if interpret else 0  # the interpreter's row offset (module docstring)
    inputs = [_pad_rows(a, base) for a in rows] + [w] + ([] if doc is None else [_pad_rows(doc, base)])
    out_shape = [jax.ShapeDtypeStruct((B, T + 2 * base, C) if shape == (B, T, C) else shape, dtype)
                 for shape, dtype in outs]
    res = pl.pallas_call(
        functools.partial(kernel, W=w.shape[0], T=T, C=C, bt=bt, bc=bc, base=base, has_doc=doc is not None),
        grid=(B, pl.cdiv(T, bt), pl.cdiv(C, bc)),
        in_specs=[_whole(a.shape) for a in inputs],
        out_specs=[_whole(s.shape) for s in out_shape],
        out_shape=out_shape,
        compiler_params=_params(interpret),
        interpret=interpret,
    )(*inputs)
    return [r[:, base:base + T] if shape == (B, T, C) else r for r, (shape, _) in zip(res, outs)]


def _fwd(x, w, doc):
    (y,) = _launch(causal_conv_fwd, [x], w, doc, [(x.shape, x.dtype)], interpret=_interpret())
    return y


@jax.custom_vjp
def _conv(x, w, doc):
    return _fwd(x, w, doc)


def _conv_fwd(x, w, doc):
    return _fwd(x, w, doc), (x, w, doc)


def _conv_bwd(res, dy):
    x, w, doc = res
    B, T, C = x.shape
    dx, dw = _launch(causal_conv_bwd, [x, dy.astype(x.dtype)], w, doc,
                     [(x.shape, x.dtype), ((B, pl.cdiv(T, BLOCK_T), w.shape[0], C), F32)], interpret=_interpret())
    ddoc = None if doc is None else jnp.zeros(doc.shape, jax.dtypes.float0)
    return dx, jnp.sum(dw, axis=(0, 1)).astype(w.dtype), ddoc


_conv.defvjp(_conv_fwd, _conv_bwd)


def causal_conv(x: Array, w: Array, doc: Optional[Array] = None) -> Array:
    """``y [B, T, C]`` (``x``'s dtype) of the depthwise causal convolution of ``x [B, T, C]`` with
    ``w [W, C]`` (``w[0]`` weighs the current token), starting from zeros; with ``doc [B, T]``
    (int32 document index) no tap crosses a document boundary."""
    if x.ndim != 3 or w.ndim != 2 or w.shape[1] != x.shape[2]:
        raise ValueError(f"conv_pallas.causal_conv: `x` [B, T, C] and `w` [W, C] must share C, got "
                         f"{tuple(x.shape)} and {tuple(w.shape)}")
    if not fits(x) and not _interpret():
        raise ValueError(f"conv_pallas.causal_conv: `x` {tuple(x.shape)} holds 2**31 elements or more "
                         f"(the kernels' offsets are 32-bit); split the batch, or use memory_mixer.causal_conv")
    if w.shape[0] < 1:
        raise ValueError(f"conv_pallas.causal_conv: `w` must hold at least one tap (W >= 1), got {tuple(w.shape)}")
    if doc is not None and doc.shape != x.shape[:2]:
        raise ValueError(f"conv_pallas.causal_conv: `doc` must have shape {tuple(x.shape[:2])}, got {tuple(doc.shape)}")
    if doc is not None and (not jnp.issubdtype(doc.dtype, jnp.integer) or doc.dtype == jnp.bool_):
        raise ValueError(f"conv_pallas.causal_conv: `doc` must hold integer document ids, got {doc.dtype}")
    if x.size == 0:  # no rows (B = 0, T = 0 or C = 0): nothing to convolve, no kernel to launch
        return jnp.zeros(x.shape, x.dtype)
    return _conv(x, w, None if doc is None else doc.astype(jnp.int32))
