"""The state passes of the chunked delta rule on the Pallas **Mosaic GPU** lowering.

:func:`state_fwd` (below) and :func:`state_bwd` (the reverse pass, same tiles and loads:
see its section).

This is the sequential kernel of :func:`kernels.delta.api._state_fwd` (GPU flavour: the Triton
``state_fwd_loop``) written for ``jax.experimental.pallas.mosaic_gpu`` (Hopper: TMA copies,
``wgmma``). Per ``(b, h)``, over chunks ``n`` of ``C`` tokens, with the state ``S [K, V]`` in
float32 starting at ``h0[b, h]``::

    h[b, n, h] = S                    (the state before chunk n, in ``state_dtype``)
    Ũ_n = U_n − W_n S                 (``[C, V]``, stored in the inputs' dtype)
    S   = d_n ⊙ S + k_outₙᵀ Ũ_n        (``d_n [K, 1]``: per-key decay, broadcast over V)

and the final ``S`` (float32). Same arguments, shapes and results as ``api._state_fwd``:
``W, k_out [B, T, H, K]``, ``U [B, T, H, V]``, ``d_end [B, N, H, K, 1]`` f32, ``h0 [B, H, K, V]``
f32 → ``(h [B, N, H, K, V], Ũ [B, T, H, V], S_final [B, H, K, V] f32)``.

Layout and tiles
----------------
One program (one warpgroup) per ``(b, h, value block)`` of ``bv`` (64 or 128) value columns;
it loops over the chunks with the state ``S [K, bv]`` in registers (the wgmma accumulator
layout). The state stays *untransposed* so that ``h`` and ``Ũ`` are stored in their natural
layouts with plain TMA copies, and every wgmma operand is an untransposed SMEM tile:

* ``Ũ = U − W S``: ``wgmma(acc [Mp, bv], W_n [Mp, K], S [K, bv])`` — M is the chunk's rows,
  padded to ``Mp = max(C, 64)`` (Hopper's wgmma has 64-row tiles; for ``C < 64`` the rows
  past ``C`` are never stored nor read), contraction ``K``;
* ``S ← d ⊙ S + k_outᵀ Ũ``: ``wgmma(acc [K, bv], k_outᵀ_n [K, C], Ũ[:C] [C, bv])`` — M is
  ``K``, contraction ``C``. ``k_out`` is transposed once outside the kernel (an XLA transpose
  to ``[B, H, K, T]``), so that ``k_outᵀ_n`` is a plain ``[K, C]`` TMA box.

No operand uses a transposed SMEM view (``ref.T``): the Mosaic GPU interpreter of jax 0.10
cannot model one, and keeping the tested code identical to the compiled code matters more
than the extra transpose of ``k_out`` (``T·K`` elements per head, against the ``N·K·V``
states the pass writes).

Operands reach the tensor cores in bfloat16 (f16 for f16 inputs) with float32 accumulation.
For float32 inputs, every product is taken as three bf16 products of hi/lo splits
(``a·b ≈ a_hi·b_hi + a_hi·b_lo + a_lo·b_hi``, about 2⁻¹⁶ relative per product): Hopper's
float32 wgmma is tf32 (10-bit mantissa) and it only reads K-major operands, which the two
contractions here cannot both have without transposed views. ``W`` and ``k_out`` are split
outside the kernel; ``S`` and ``Ũ`` are split in registers before they are written to SMEM.

Loads and pipelining
--------------------
The chunk inputs (``W_n``, ``k_outᵀ_n``, ``U_n``, ``d_n``) go through a ring of ``stages``
SMEM slots filled by TMA (one barrier per slot and operand): the loads of chunk ``n + stages``
are issued as soon as chunk ``n``'s matmuls have read its slot, so they run under the next
chunks' work. ``h`` and ``Ũ`` are written from SMEM staging buffers by asynchronous TMA
stores (double-buffered where SMEM allows: :func:`_plan`), waited on only before a staging
buffer is reused.

Constraints (``ValueError`` naming the argument otherwise): ``K`` and ``V`` multiples of 64,
``K <= 256``; ``chunk`` 16, 32 or a multiple of 64 (at most 256), dividing ``T``; ``block_v``
64 or 128, dividing ``V``. ``interpret=True`` (or an ``InterpretGPUParams``) runs the kernel
in the Mosaic GPU interpreter on the CPU. The tests check it there against a plain ``jnp``
loop and beside the Triton state pass of :mod:`kernels.delta.api`, and check that both passes
lower for CUDA (``tests/kernels/test_mosaic_gpu_state.py``).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

F32 = jnp.float32
BF16 = jnp.bfloat16
WG_ROWS = 64  # rows of one wgmma tile (Hopper)
SMEM_BUDGET = 200 * 1024  # bytes of scratch we plan for (227 KiB per block, less alignment slack)


# ---------------------------------------------------------------------------
# jax version differences
# ---------------------------------------------------------------------------
def _interpret_params_cls():
    """``InterpretGPUParams``: public in ``plgpu`` from jax 0.11, private module in 0.10."""
    cls = getattr(plgpu, "InterpretGPUParams", None)
    if cls is None:
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams as cls
    return cls


def interpret_params(**kw):
    """An instance of the Mosaic GPU interpreter's parameters (``interpret=`` of ``plgpu.kernel``)."""
    return _interpret_params_cls()(**kw)


def _layout(x, layout, p):
    """``plgpu.layout_cast`` (a layout hint for the loads and the decay broadcast). Skipped when
    interpreting: layouts mean nothing to the interpreter, and jax 0.10's has no rule for the
    primitive (0.11's passes it through)."""
    return x if p.interpret else plgpu.layout_cast(x, layout)


def _interpret_arg(interpret):
    if interpret is True:
        return interpret_params()
    if interpret is False or interpret is None:
        return None
    return interpret  # an InterpretGPUParams instance


# ---------------------------------------------------------------------------
# static plan
# ---------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _Plan:
    B: int
    H: int
    N: int
    C: int
    K: int
    V: int
    bv: int
    parts: int          # 1: 16-bit operands as they are; 2: float32 as bf16 hi + lo
    mm_dtype: Any       # wgmma operand dtype
    store_dtype: Any    # dtype of U and Ũ
    state_dtype: Any    # dtype of h
    stages: int         # input ring slots
    out_bufs: int       # staging buffers per output (h, Ũ)
    interpret: bool     # run in the Mosaic GPU interpreter

    @property
    def Mp(self):
        return max(self.C, WG_ROWS)

    @property
    def nv(self):
        return self.V // self.bv

    @property
    def pairs(self):
        """(A part, B part) products: one, or hi·hi + hi·lo + lo·hi."""
        return ((0, 0),) if self.parts == 1 else ((0, 0), (0, 1), (1, 0))

    @property
    def n_ops(self):
        return 2 * self.parts + 2  # W parts, k_outᵀ parts, U, d


def _smem_bytes(C, K, bv, parts, mm_dtype, store_dtype, state_dtype, stages, out_bufs):
    Mp = max(C, WG_ROWS)
    mb, sb, hb = (jnp.dtype(t).itemsize for t in (mm_dtype, store_dtype, state_dtype))
    ring = stages * (parts * (Mp * K + K * C) * mb + Mp * bv * sb + K * 4)
    mm_copies = parts * (K * bv + Mp * bv) * mb
    staging = out_bufs * (K * bv * hb + Mp * bv * sb) + K * bv * 4
    return ring + mm_copies + staging


def _plan(W, U, kout, dend, h0, chunk, state_dtype, block_v, stages, interpret):
    if W.ndim != 4:
        raise ValueError(f"`W` must be [B, T, H, K], got shape {W.shape}")
    B, T, H, K = W.shape
    if U.ndim != 4 or U.shape[:3] != (B, T, H):
        raise ValueError(f"`U` must be [B, T, H, V] with (B, T, H) = {(B, T, H)}, got shape {U.shape}")
    V = U.shape[3]
    if kout.shape != W.shape:
        raise ValueError(f"`kout` must have W's shape {W.shape}, got {kout.shape}")
    N = _check_chunk(chunk, T)
    _check_widths(K, V, "U", block_v)
    if dend.shape != (B, N, H, K, 1):
        raise ValueError(f"`dend` must be [B, N, H, K, 1] = {(B, N, H, K, 1)}, got {dend.shape}")
    if h0.shape != (B, H, K, V):
        raise ValueError(f"`h0` must be [B, H, K, V] = {(B, H, K, V)}, got {h0.shape}")
    dt = jnp.dtype(W.dtype)
    if jnp.dtype(U.dtype) != dt or jnp.dtype(kout.dtype) != dt:
        raise ValueError(f"`W`, `U` and `kout` must share one dtype, got {W.dtype}, {U.dtype}, {kout.dtype}")
    return _fit(_smem_bytes, B, H, N, chunk, K, V, block_v, dt, state_dtype, stages, interpret)


def _check_chunk(chunk, T) -> int:
    """Validate ``chunk`` against the token axis ``T``; returns the number of chunks."""
    if not isinstance(chunk, int) or chunk < 16 or not (chunk in (16, 32) or chunk % 64 == 0) or chunk > 256:
        raise ValueError(f"`chunk` must be 16, 32 or a multiple of 64 up to 256, got {chunk!r}")
    if T % chunk:
        raise ValueError(f"`chunk` ({chunk}) must divide the token axis of W (T = {T})")
    return T // chunk


def _check_widths(K, V, v_name, block_v):
    """Key and value widths the wgmma tiles take, and the value block (``v_name``: V's argument)."""
    if K % 64 or K > 256:
        raise ValueError(f"`W`: the key dim K must be a multiple of 64 and at most 256, got {K}")
    if V % 64:
        raise ValueError(f"`{v_name}`: the value dim V must be a multiple of 64, got {V}")
    if block_v not in (64, 128) or V % block_v:
        raise ValueError(f"`block_v` must be 64 or 128 and divide V = {V}, got {block_v!r}")


def _fit(smem_bytes, B, H, N, chunk, K, V, block_v, dt, state_dtype, stages, interpret) -> "_Plan":
    """The :class:`_Plan` of one pass: operand parts for the inputs' dtype, and the most input-ring
    ``stages`` (up to 3) and output buffers (2, else 1) whose ``smem_bytes`` fit ``SMEM_BUDGET``."""
    if dt in (jnp.dtype(BF16), jnp.dtype(jnp.float16)):
        parts, mm_dtype = 1, dt
    elif dt == jnp.dtype(F32):
        parts, mm_dtype = 2, jnp.dtype(BF16)
    else:
        raise ValueError(f"`W`: dtype must be bfloat16, float16 or float32, got {dt}")
    state_dtype = dt if state_dtype is None else jnp.dtype(state_dtype)
    if stages is not None and (not isinstance(stages, int) or stages < 1):
        raise ValueError(f"`stages` must be a positive int or None, got {stages!r}")
    want = [stages] if stages is not None else [min(3, N), 2, 1]
    size = functools.partial(smem_bytes, chunk, K, block_v, parts, mm_dtype, dt, state_dtype)
    for st in dict.fromkeys(max(1, min(s, N)) for s in want):
        for ob in (2, 1):
            if size(st, ob) <= SMEM_BUDGET:
                return _Plan(B, H, N, chunk, K, V, block_v, parts, mm_dtype, dt, state_dtype, st, ob,
                             interpret)
    raise ValueError(f"the tiles of `chunk`={chunk}, K={K}, `block_v`={block_v} ({dt}) need "
                     f"{size(1, 1)} bytes of SMEM, more than {SMEM_BUDGET}: use a smaller chunk, or 16-bit inputs")


def _swizzled(dtype, cols):
    """Tiling + swizzle of a 2-D SMEM tile whose minor dim has ``cols`` elements: what wgmma
    operands need, and what lets register loads/stores in the wgmma layout avoid bank conflicts."""
    sw = min(128, cols * jnp.dtype(dtype).itemsize)
    return (plgpu.TilingTransform((8, sw // jnp.dtype(dtype).itemsize)), plgpu.SwizzleTransform(sw))


def _split(x, p: _Plan):
    """``x`` (f32) as ``p.parts`` operands in ``p.mm_dtype``: itself, or bf16 hi and lo. In a kernel
    body (Mosaic GPU keeps every rounding)."""
    hi = x.astype(p.mm_dtype)
    if p.parts == 1:
        return (hi,)
    return hi, (x - hi.astype(F32)).astype(p.mm_dtype)


def _split_xla(x):
    """``x`` (f32) as bf16 hi and lo outside the kernels. XLA may drop an f32 → bf16 → f32 round trip
    (excess precision, on by default on GPUs), which would make ``x − hi`` zero; so ``hi`` is ``x``
    with its low 16 bits cleared (exact in bf16, and ``x − hi`` exact in f32) — a bit mask XLA keeps."""
    hi = lax.bitcast_convert_type(lax.bitcast_convert_type(x, jnp.uint32) & jnp.uint32(0xFFFF0000), F32)
    return hi.astype(BF16), (x - hi).astype(BF16)


def _matmul(p: _Plan, shape, *operands):
    """``Σ A @ B`` over ``operands`` (pairs of per-part SMEM refs ``[A parts], [B parts]``) in one
    wgmma accumulator (zero-initialised); returns it as a float32 array in the wgmma layout."""
    def run(acc):
        for a_refs, b_refs in operands:
            for ia, ib in p.pairs:
                plgpu.wgmma(acc, a_refs[ia], b_refs[ib])
        return acc[...]
    return pl.run_scoped(run, plgpu.ACC(shape, F32))


def _stage(store, dtype, mm, value, mm_value, p: _Plan):
    """``value`` (f32) into the output staging buffer ``store`` as ``dtype``, and ``mm_value``'s
    :func:`_split` parts into the wgmma operand buffers ``mm`` (committed by the caller)."""
    store[...] = value.astype(dtype)
    for i, part in enumerate(_split(mm_value, p)):
        mm.at[i][...] = part


def _store_final(f_st, S, dst):
    """After the chunk loop: once the staged stores have read their buffers, the final state ``S``
    through ``f_st`` to ``dst``, and every store waited for (the kernel's last act)."""
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    f_st[...] = S
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(f_st, dst)
    plgpu.wait_smem_to_gmem(0)


# ---------------------------------------------------------------------------
# forward kernel
# ---------------------------------------------------------------------------
def _kernel(p: _Plan, *refs):
    P = p.parts
    w_g, ko_g = refs[:P], refs[P:2 * P]
    u_g, d_g, h0_g, h_g, ut_g, fin_g = refs[2 * P:2 * P + 6]
    w_s, ko_s, u_s, d_s, s_mm, ut_mm, h_st, ut_st, f_st, bars = refs[2 * P + 6:]
    C, Mp, bv, N = p.C, p.Mp, p.bv, p.N
    b, h, j = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("j")
    vcols = pl.ds(j * bv, bv)
    nops = p.n_ops

    def issue_loads(n, slot):
        """TMA the inputs of chunk ``n`` (traced or static) into ring slot ``slot``."""
        rows = pl.ds(n * C, C)
        for i in range(P):
            plgpu.copy_gmem_to_smem(w_g[i].at[b, rows, h], w_s.at[slot, i, pl.ds(0, C)], bars.at[slot * nops + i])
            plgpu.copy_gmem_to_smem(ko_g[i].at[b, h, :, rows], ko_s.at[slot, i], bars.at[slot * nops + P + i])
        plgpu.copy_gmem_to_smem(u_g.at[b, rows, h, vcols], u_s.at[slot, pl.ds(0, C)], bars.at[slot * nops + 2 * P])
        plgpu.copy_gmem_to_smem(d_g.at[b, n, h], d_s.at[slot], bars.at[slot * nops + 2 * P + 1])

    def wait_loads(slot):
        for op in range(nops):
            plgpu.barrier_wait(bars.at[slot * nops + op])

    # the initial state: h0 through the final-state staging buffer
    plgpu.copy_gmem_to_smem(h0_g.at[b, h, :, vcols], f_st, bars.at[p.stages * nops])
    for n in range(p.stages):  # fill the ring (stages <= N)
        issue_loads(n, n)
    plgpu.barrier_wait(bars.at[p.stages * nops])
    S0 = _layout(f_st[...], plgpu.Layout.WGMMA, p)

    def body(n, S):
        slot = lax.rem(n, p.stages)
        ob = lax.rem(n, p.out_bufs)
        # staging buffer `ob` was last stored from two groups (h, Ũ) per chunk ago
        plgpu.wait_smem_to_gmem(2 * (p.out_bufs - 1), wait_read_only=True)
        _stage(h_st.at[ob], p.state_dtype, s_mm, S, S, p)
        wait_loads(slot)
        U = _layout(u_s.at[slot][...], plgpu.Layout.WGMMA, p).astype(F32)
        d = _layout(d_s.at[slot][...], plgpu.Layout.WGMMA.reduce(1), p)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(h_st.at[ob], h_g.at[b, n, h, :, vcols])

        # Ũ = U − W S   (rows C..Mp of the tile are padding)
        ut = U - _matmul(p, (Mp, bv), ([w_s.at[slot, i] for i in range(P)], [s_mm.at[i] for i in range(P)]))
        _stage(ut_st.at[ob], p.store_dtype, ut_mm, ut, ut, p)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(ut_st.at[ob, pl.ds(0, C)], ut_g.at[b, pl.ds(n * C, C), h, vcols])

        # S ← d ⊙ S + k_outᵀ Ũ
        kU = _matmul(p, (p.K, bv), ([ko_s.at[slot, i] for i in range(P)], [ut_mm.at[i, pl.ds(0, C)] for i in range(P)]))
        S = lax.broadcast_in_dim(d, S.shape, [0]) * S + kU

        # the slot is consumed (its wgmmas completed above; U and d were read before a commit_smem)
        @pl.when(n + p.stages < N)
        def _():
            issue_loads(n + p.stages, slot)
        return S

    S = lax.fori_loop(0, N, body, S0)
    _store_final(f_st, S, fin_g.at[b, h, :, vcols])


def state_fwd(W, U, kout, dend, h0, *, chunk, state_dtype=None, interpret=False, block_v=64, stages=None):
    """``(h [B, N, H, K, V], Ũ [B, T, H, V], S_final [B, H, K, V] f32)``: the forward state pass.

    ``W, kout [B, T, H, K]``, ``U [B, T, H, V]`` (one dtype: bf16, f16 or f32), ``dend
    [B, N, H, K, 1]`` f32, ``h0 [B, H, K, V]`` f32, ``T = N·chunk``. ``state_dtype``: dtype of
    ``h`` (default: the inputs'). ``interpret``: run in the Mosaic GPU interpreter (``True``
    or an ``InterpretGPUParams``). ``block_v``: value columns per program (64 or 128);
    ``stages``: input ring slots (default: the most, up to 3, that fit in SMEM)."""
    p = _plan(W, U, kout, dend, h0, chunk, state_dtype, block_v, stages, _interpret_arg(interpret) is not None)
    B, H, N, C, K, V, bv, P = p.B, p.H, p.N, p.C, p.K, p.V, p.bv, p.parts
    W32 = W.astype(F32) if P == 2 else None
    ko32 = kout.astype(F32) if P == 2 else None
    w_parts = _split_xla(W32) if P == 2 else (W,)
    koT = jnp.transpose(ko32 if P == 2 else kout, (0, 2, 3, 1))  # [B, H, K, T]
    ko_parts = _split_xla(koT) if P == 2 else (koT,)
    d = dend.reshape(B, N, H, K).astype(F32)
    mm = p.mm_dtype
    scratch = [
        plgpu.SMEM((p.stages, P, p.Mp, K), mm, transforms=_swizzled(mm, K)),   # W_n
        plgpu.SMEM((p.stages, P, K, C), mm, transforms=_swizzled(mm, C)),      # k_outᵀ_n
        plgpu.SMEM((p.stages, p.Mp, bv), p.store_dtype, transforms=_swizzled(p.store_dtype, bv)),   # U_n
        plgpu.SMEM((p.stages, K), F32),                                                # d_n
        plgpu.SMEM((P, K, bv), mm, transforms=_swizzled(mm, bv)),              # S operand
        plgpu.SMEM((P, p.Mp, bv), mm, transforms=_swizzled(mm, C)),            # Ũ operand
        plgpu.SMEM((p.out_bufs, K, bv), p.state_dtype, transforms=_swizzled(p.state_dtype, bv)),  # h staging
        plgpu.SMEM((p.out_bufs, p.Mp, bv), p.store_dtype, transforms=_swizzled(p.store_dtype, bv)),  # Ũ staging
        plgpu.SMEM((K, bv), F32, transforms=_swizzled(F32, bv)),                               # h0 / final S
        plgpu.Barrier(num_barriers=p.stages * p.n_ops + 1),
    ]
    out_type = [jax.ShapeDtypeStruct((B, N, H, K, V), p.state_dtype),
                jax.ShapeDtypeStruct((B, N * C, H, V), p.store_dtype),
                jax.ShapeDtypeStruct((B, H, K, V), F32)]
    f = plgpu.kernel(functools.partial(_kernel, p), out_type=out_type, scratch_types=scratch,
                     grid=(B, H, p.nv), grid_names=("b", "h", "j"), interpret=_interpret_arg(interpret))
    h, ut, fin = f(*w_parts, *ko_parts, U, d, h0.astype(F32))
    return h, ut, fin


# ---------------------------------------------------------------------------
# backward state pass
# ---------------------------------------------------------------------------
# Reverse over chunks, with the cotangent ``dS [K, bv]`` of the state after chunk n (starting at
# the final state's cotangent): ``dh[n] = dS``, ``dŨ_n = M_nᵀ dO_n + k_out_n dS``,
# ``dS ← q_inₙᵀ dO_n + d_n ⊙ dS − W_nᵀ dŨ_n`` (``kernels.state_bwd_step``). Same tiles as the
# forward: ``dŨ`` is an ``[Mp, bv]`` accumulator (A operands ``M_nᵀ [Mp, C]`` and ``k_out_n
# [Mp, K]``), ``dS`` a ``[K, bv]`` one (A operands ``q_inₙᵀ, W_nᵀ [K, C]``); ``M``, ``q_in`` and
# ``W`` are transposed outside the kernel, ``−dŨ`` is what goes to SMEM, so both products of the
# ``dS`` update accumulate in one wgmma accumulator.
def _bwd_smem_bytes(C, K, bv, parts, mm_dtype, store_dtype, state_dtype, stages, out_bufs):
    Mp = max(C, WG_ROWS)
    mb, sb, hb = (jnp.dtype(t).itemsize for t in (mm_dtype, store_dtype, state_dtype))
    ring = stages * (parts * (Mp * C + Mp * K + 2 * K * C + C * bv) * mb + K * 4)
    mm_copies = parts * (K * bv + Mp * bv) * mb
    staging = out_bufs * (K * bv * hb + Mp * bv * sb) + K * bv * 4
    return ring + mm_copies + staging


def _plan_bwd(M, do, kout, qin, W, dend, dsT, chunk, state_dtype, block_v, stages, interpret):
    if W.ndim != 4:
        raise ValueError(f"`W` must be [B, T, H, K], got shape {W.shape}")
    B, T, H, K = W.shape
    for name, a in (("kout", kout), ("qin", qin)):
        if a.shape != W.shape:
            raise ValueError(f"`{name}` must have W's shape {W.shape}, got {a.shape}")
    if do.ndim != 4 or do.shape[:3] != (B, T, H):
        raise ValueError(f"`do` must be [B, T, H, V] with (B, T, H) = {(B, T, H)}, got shape {do.shape}")
    V = do.shape[3]
    N = _check_chunk(chunk, T)
    if M.shape != (B, T, H, chunk):
        raise ValueError(f"`M` must be [B, T, H, chunk] = {(B, T, H, chunk)}, got {M.shape}")
    _check_widths(K, V, "do", block_v)
    if dend.shape != (B, N, H, K, 1):
        raise ValueError(f"`dend` must be [B, N, H, K, 1] = {(B, N, H, K, 1)}, got {dend.shape}")
    if dsT.shape != (B, H, K, V):
        raise ValueError(f"`dsT` must be [B, H, K, V] = {(B, H, K, V)}, got {dsT.shape}")
    dt = jnp.dtype(W.dtype)
    if any(jnp.dtype(a.dtype) != dt for a in (M, do, kout, qin)):
        raise ValueError(f"`M`, `do`, `kout`, `qin` and `W` must share one dtype, got "
                         f"{[str(a.dtype) for a in (M, do, kout, qin, W)]}")
    return _fit(_bwd_smem_bytes, B, H, N, chunk, K, V, block_v, dt, state_dtype, stages, interpret)


def _bwd_kernel(p: _Plan, *refs):
    P = p.parts
    mT_g, ko_g, qiT_g, wT_g, do_g = (refs[i * P:(i + 1) * P] for i in range(5))
    d_g, dsT_g, dh_g, dut_g, dh0_g = refs[5 * P:5 * P + 5]
    mT_s, ko_s, qiT_s, wT_s, do_s, d_s, s_mm, ut_mm, h_st, ut_st, f_st, bars = refs[5 * P + 5:]
    C, Mp, bv, N = p.C, p.Mp, p.bv, p.N
    b, h, j = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("j")
    vcols = pl.ds(j * bv, bv)
    nops = 5 * P + 1

    def issue_loads(n, slot):
        rows = pl.ds(n * C, C)
        bar = lambda op: bars.at[slot * nops + op]  # noqa: E731
        for i in range(P):
            plgpu.copy_gmem_to_smem(mT_g[i].at[b, rows, h], mT_s.at[slot, i, pl.ds(0, C)], bar(i))
            plgpu.copy_gmem_to_smem(ko_g[i].at[b, rows, h], ko_s.at[slot, i, pl.ds(0, C)], bar(P + i))
            plgpu.copy_gmem_to_smem(qiT_g[i].at[b, h, :, rows], qiT_s.at[slot, i], bar(2 * P + i))
            plgpu.copy_gmem_to_smem(wT_g[i].at[b, h, :, rows], wT_s.at[slot, i], bar(3 * P + i))
            plgpu.copy_gmem_to_smem(do_g[i].at[b, rows, h, vcols], do_s.at[slot, i], bar(4 * P + i))
        plgpu.copy_gmem_to_smem(d_g.at[b, n, h], d_s.at[slot], bar(5 * P))

    plgpu.copy_gmem_to_smem(dsT_g.at[b, h, :, vcols], f_st, bars.at[p.stages * nops])
    for i in range(p.stages):
        issue_loads(N - 1 - i, i)
    plgpu.barrier_wait(bars.at[p.stages * nops])
    dS0 = _layout(f_st[...], plgpu.Layout.WGMMA, p)

    def body(i, dS):
        n = N - 1 - i
        slot = lax.rem(i, p.stages)
        ob = lax.rem(i, p.out_bufs)
        plgpu.wait_smem_to_gmem(2 * (p.out_bufs - 1), wait_read_only=True)
        _stage(h_st.at[ob], p.state_dtype, s_mm, dS, dS, p)
        for op in range(nops):
            plgpu.barrier_wait(bars.at[slot * nops + op])
        d = _layout(d_s.at[slot][...], plgpu.Layout.WGMMA.reduce(1), p)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(h_st.at[ob], dh_g.at[b, n, h, :, vcols])

        parts = range(P)
        # dŨ = Mᵀ dO + k_out dS   (rows C..Mp are padding)
        dut = _matmul(p, (Mp, bv), ([mT_s.at[slot, k] for k in parts], [do_s.at[slot, k] for k in parts]),
                      ([ko_s.at[slot, k] for k in parts], [s_mm.at[k] for k in parts]))
        _stage(ut_st.at[ob], p.store_dtype, ut_mm, dut, -dut, p)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(ut_st.at[ob, pl.ds(0, C)], dut_g.at[b, pl.ds(n * C, C), h, vcols])

        # dS ← q_inᵀ dO + d ⊙ dS − Wᵀ dŨ
        upd = _matmul(p, (p.K, bv), ([qiT_s.at[slot, k] for k in parts], [do_s.at[slot, k] for k in parts]),
                      ([wT_s.at[slot, k] for k in parts], [ut_mm.at[k, pl.ds(0, C)] for k in parts]))
        dS = lax.broadcast_in_dim(d, dS.shape, [0]) * dS + upd

        @pl.when(i + p.stages < N)
        def _():
            issue_loads(n - p.stages, slot)
        return dS

    dS = lax.fori_loop(0, N, body, dS0)
    _store_final(f_st, dS, dh0_g.at[b, h, :, vcols])


def state_bwd(M, do, kout, qin, W, dend, dsT, *, chunk, state_dtype=None, interpret=False, block_v=64,
              stages=None):
    """``(dh [B, N, H, K, V], dŨ [B, T, H, V], dh0 [B, H, K, V] f32)``: the backward state pass
    (``api._state_bwd``'s arguments and results). ``M [B, T, H, chunk]``, ``do [B, T, H, V]``,
    ``kout, qin, W [B, T, H, K]`` (one dtype), ``dend [B, N, H, K, 1]`` f32, ``dsT [B, H, K, V]``
    f32 (the final state's cotangent); ``dh[n]`` is the cotangent of the state after chunk ``n``.
    Other arguments as :func:`state_fwd`."""
    p = _plan_bwd(M, do, kout, qin, W, dend, dsT, chunk, state_dtype, block_v, stages,
                  _interpret_arg(interpret) is not None)
    B, H, N, C, K, V, bv, P = p.B, p.H, p.N, p.C, p.K, p.V, p.bv, p.parts
    T = N * C
    # per chunk, M_nᵀ: [B, T, H, C] with row s of chunk n holding column s of M_n
    mT = jnp.transpose(M.reshape(B, N, C, H, C), (0, 1, 4, 3, 2)).reshape(B, T, H, C)
    tr = lambda x: jnp.transpose(x, (0, 2, 3, 1))  # noqa: E731  [B, T, H, K] -> [B, H, K, T]
    ops = [mT, kout, tr(qin), tr(W), do]
    if P == 2:
        ops = [_split_xla(x.astype(F32)) for x in ops]
    else:
        ops = [(x,) for x in ops]
    d = dend.reshape(B, N, H, K).astype(F32)
    mm, st = p.mm_dtype, p.stages
    scratch = [
        plgpu.SMEM((st, P, p.Mp, C), mm, transforms=_swizzled(mm, C)),           # M_nᵀ
        plgpu.SMEM((st, P, p.Mp, K), mm, transforms=_swizzled(mm, K)),           # k_out_n
        plgpu.SMEM((st, P, K, C), mm, transforms=_swizzled(mm, C)),              # q_inₙᵀ
        plgpu.SMEM((st, P, K, C), mm, transforms=_swizzled(mm, C)),              # W_nᵀ
        plgpu.SMEM((st, P, C, bv), mm, transforms=_swizzled(mm, C)),             # dO_n
        plgpu.SMEM((st, K), F32),                                                # d_n
        plgpu.SMEM((P, K, bv), mm, transforms=_swizzled(mm, bv)),                # dS operand
        plgpu.SMEM((P, p.Mp, bv), mm, transforms=_swizzled(mm, C)),              # −dŨ operand
        plgpu.SMEM((p.out_bufs, K, bv), p.state_dtype, transforms=_swizzled(p.state_dtype, bv)),  # dh staging
        plgpu.SMEM((p.out_bufs, p.Mp, bv), p.store_dtype, transforms=_swizzled(p.store_dtype, bv)),  # dŨ staging
        plgpu.SMEM((K, bv), F32, transforms=_swizzled(F32, bv)),                 # dsT / dh0
        plgpu.Barrier(num_barriers=st * (5 * P + 1) + 1),
    ]
    out_type = [jax.ShapeDtypeStruct((B, N, H, K, V), p.state_dtype),
                jax.ShapeDtypeStruct((B, T, H, V), p.store_dtype),
                jax.ShapeDtypeStruct((B, H, K, V), F32)]
    f = plgpu.kernel(functools.partial(_bwd_kernel, p), out_type=out_type, scratch_types=scratch,
                     grid=(B, H, p.nv), grid_names=("b", "h", "j"), interpret=_interpret_arg(interpret))
    return f(*[x for parts in ops for x in parts], d, dsT.astype(F32))
