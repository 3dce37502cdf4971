"""Kernel bodies of the chunked delta rule (forward and backward).

Five kernels; ``(par)`` ones run one program per ``(b, h, chunk)``, ``(seq)`` ones
carry the state across chunks:

=====================  =====  ==================================================
``intra_fwd``          par    gates, scores ``M``/``KK``, solve → ``W, U, M, q_in, k_out, d_end, KK``
``state_fwd_*``        seq    ``S_n`` per chunk, ``Ũ = U − W S``, ``S ← d ⊙ S + k_outᵀ Ũ``
``output``             par    ``O = q_in S_n + M Ũ`` (only with ``fuse_output=False``: by default
                              ``state_fwd_*`` takes it, from the state it holds)
``state_bwd_*``        seq    reverse: ``dŨ = Mᵀ dO + k_out dS``, ``dS ← q_inᵀ dO + d ⊙ dS − Wᵀ dŨ``
``intra_bwd``          par    ``dq, dk, dv, dβ, dg`` from ``S_n, dS_{n+1}, Ũ, dŨ`` and ``KK``
=====================  =====  ==================================================

On GPUs ``intra_bwd`` runs as two kernels, :func:`intra_bwd_solve_whole` (``dv, dβ``; the back-solve on
whole-chunk operands for every rule) then ``intra_bwd_scores`` (``dq, dk, dg``), to keep Triton's register
use down (see there). Without per-channel gates the other two intra-chunk kernels also come in a
whole-chunk form (``intra="whole"``: :func:`intra_fwd_whole`, :func:`intra_bwd_scores_whole`; one matmul
per product instead of 16-row tile pairs; the GPU default for 16-bit inputs; with per-channel gates the
forward kernel alone, the chunk anchored at its middle row), and the forward in a form
that builds a chunk from its two whole halves (``intra="halves"``, :func:`intra_fwd_halves`; the default at
C = 64). With exact
per-channel gates ``intra_fwd`` runs as two passes on GPUs (``anchored_fwd="fixup"``: the bounded-gate
kernel everywhere, then :func:`intra_fwd_fixup` on the chunks it flags).

``KK`` (f32 ``[C, C]`` per chunk, the backward's residual) is strictly lower; the upper triangles of
its diagonal tiles carry the transposed inverses ``T_IIᵀ`` of the UT solve's diagonal tiles, so the
backward's back-solve does not invert them again (the whole-chunk forms store the whole ``(I + A)⁻ᵀ``
above the diagonal; after the tile kernels the GPU's back-solve merges it from the tiles:
:func:`intra_bwd_solve_whole`). Without per-channel gates (DeltaNet, GDN)
``q_in = q ⊙ E_in`` and ``k_out = k ⊙ E_out`` scale whole rows: ``intra_fwd`` writes the ``[C, 1]``
factors in their place and the state passes apply them to their ``[C, bv]`` operands (:func:`row_factors`).

The sequential kernels come in two flavours with one shared step function:
``*_loop`` (GPU: one program per ``(b, h, v-block)`` loops over chunks with a
``fori_loop`` over refs that hold the whole sequence) and ``*_grid`` (TPU: the
chunk axis is the last, "arbitrary" grid axis and the state lives in a VMEM
scratch buffer). ``state_fwd_loop(pairs=True)`` (the ``state_pairs`` launch knob) takes two chunks a
step (:func:`_pair_step`).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from .tiles import (
    F32, SUB, Cfg, Chunk, Lazy, _mul, anchored, apply_decay, col_to_row, dot, exp, get_col, get_diag, get_row,
    inverse_prec, iota, load_rows, mm, prefix_sum, row_to_col, scores, sm, solve_backward, solve_forward, split_bf16,
    store_rows, tri_dot, unit_lower_inverse_t, ut_matrix, ut_system,
)

# per-channel gates, intra="whole": the largest |P_i − P_m| of a chunk anchored at its middle row. e^{±80} stays
# inside float32's e^{±87}; at the span's end an operand entry |x| < e^{-7.3} ≈ 6.7e-4 scaled by e^{-80} turns
# subnormal (flushed on tensor cores), dropping a term below 6.7e-4·|the other factor|, far under bf16 rounding.
WHOLE_SPAN = 80.0

# state_dot="tensor": the row blocks of Σ S ⊙ dS on tensor cores (_state_dot). GDN's bf16 scores kernel at
# K = V = 128 compiles to 2592 SASS instructions per thread and 72 B of spill stores, against 3016 and 20 B
# with the elementwise products (2400 without the state dot at all); 16-row blocks spilled 28 KB, 128-row
# ones 124 B (ptxas, sm_90a, triton 3.6). On an H200 it is still 1.2-2.0% slower in fwd+bwd, and 128-row
# blocks slower again: the sum costs its second read of both states, not its arithmetic (docs/kernels.md).
STATE_DOT_ROWS = 64


def _split_in(cfg: Cfg, refs, names):
    """Pop the optional g / doc refs according to ``cfg``."""
    out = {}
    it = iter(refs)
    for name in names:
        if name == "g" and not cfg.gated:
            out[name] = None
            continue
        if name == "doc" and not cfg.docs:
            out[name] = None
            continue
        out[name] = next(it)
    return out, list(it)


def _tiles(ref, nb, scale=None):
    t = [load_rows(ref, I * SUB, SUB) for I in range(nb)]
    return t if scale is None else [x * scale for x in t]


# ---------------------------------------------------------------------------
# intra_fwd
# ---------------------------------------------------------------------------
def intra_fwd(cfg: Cfg, *refs, residuals: bool = True, flag: bool = False):
    """``residuals=False`` (a forward no backward reads): no ``KK`` output; ``q_in``, ``k_out`` as
    :func:`row_factors` says (none in the "scale" mode). ``flag`` (bounded per-channel gates: the first
    pass of ``anchored_fwd="fixup"``, :func:`intra_fwd_fixup`): one more output, a ``[C, 1]`` column that
    is 1 where a diagonal tile of the chunk fails :meth:`~kernels.delta.tiles.Chunk.span_safe` (this
    pass's outputs for the chunk are then not to be used), else 0."""
    r, outs = _split_in(cfg, refs, ("q", "k", "v", "g", "beta", "doc"))
    if flag:
        *outs, flag_ref = outs
    w_ref, u_ref, m_ref, *outs = outs
    qin_ref, kout_ref = (None, None) if row_factors(cfg) == "scale" else (outs.pop(0), outs.pop(0))
    dend_ref, *kk = outs
    nb = cfg.nb
    ch = Chunk(cfg, r["g"], r["doc"])
    q = _tiles(r["q"], nb, cfg.scale)
    k = _tiles(r["k"], nb)
    v = _tiles(r["v"], nb)
    beta = _tiles(r["beta"], nb)  # [16, 1]
    M, KK, _ = scores(cfg, ch, q, k, r["k"])
    A, tT = ut_system(cfg, ch, KK, beta)
    U = solve_forward(cfg, A, tT, [beta[I] * v[I] for I in range(nb)])
    W = solve_forward(cfg, A, tT, [_mul(beta[I] * k[I], ch.Ein[I]) for I in range(nb)])
    for I in range(nb):
        store_rows(u_ref, I * SUB, U[I])
        store_rows(w_ref, I * SUB, W[I])
        if row_factors(cfg) == "arrays":
            store_rows(qin_ref, I * SUB, _mul(q[I], ch.Ein[I]))
            store_rows(kout_ref, I * SUB, _mul(k[I], ch.Eout[I]))
        elif row_factors(cfg) == "columns":  # [16, 1] row factors q_in = q ⊙ ein, k_out = k ⊙ eout
            one = jnp.ones((SUB, 1), F32)
            store_rows(qin_ref, I * SUB, _mul(one, ch.Ein[I]) * cfg.scale)
            store_rows(kout_ref, I * SUB, _mul(one, ch.Eout[I]))
        for J in range(nb):
            tile = M[I][J] if J <= I else jnp.zeros((SUB, SUB), F32)
            m_ref[pl.ds(I * SUB, SUB), pl.ds(J * SUB, SUB)] = tile.astype(m_ref.dtype)
    # f32: the backward's UT solve starts from these, never from k and g again; the diagonal tiles'
    # inverses ride in their upper triangles (KK_II is strictly lower, T_IIᵀ unit upper: no extra bytes)
    if residuals:
        _store_lower(kk[0], KK, upper=tT)
    if flag:
        safe = ch.span_safe(0)
        for I in range(1, nb):
            safe = safe & ch.span_safe(I)
        flag_ref[...] = jnp.broadcast_to(jnp.where(safe, 0.0, 1.0), flag_ref.shape).astype(flag_ref.dtype)
    K = dend_ref.shape[0]
    if ch.d_end is None:
        d = jnp.ones((K, 1), F32)
    elif cfg.channel:
        d = row_to_col(ch.d_end, cfg.transpose)
    else:
        d = jnp.broadcast_to(ch.d_end, (K, 1))
    dend_ref[...] = d.astype(dend_ref.dtype)


def gate_prefix(cfg: Cfg) -> bool:
    """Whether the kernels read a scalar gate as its chunk-local inclusive prefix sums
    ``Q_i = Σ_{t <= i} g_t`` (formed in XLA before the kernels, ``api._gate_in``) instead of ``g``: the
    whole-chunk kernels with 16-bit inputs (:func:`_whole_gates`), whose decays are differences of
    them. Formed in the kernels by ``[C, C]`` masked sums they took GDN's forward kernel from 3352 to 3704
    SASS instructions per thread and its scores kernel from 3216 to 3856 (spill stores 16 → 332 B; bf16,
    triton 3.6); paired on one H200 (``kernel_bench --parts ab --ab_ref``, commit c1628d6 against the
    one before): GDN fwd+bwd 0.930 (2, 8192), 0.924 (8, 2048), 0.951 (1, 32768); forward 0.956–0.981."""
    return cfg.gate == "scalar" and cfg.intra in ("whole", "halves") and cfg.mm_dtype != F32


def _whole_gates(cfg: Cfg, r, C: int):
    """Scalar or no gates, whole chunk (:func:`intra_fwd_whole`, :func:`intra_bwd_scores_whole`):
    ``(Γ, E_in, E_out, d_end)`` — ``Γ [C, C]`` the decays on the causal (diagonal included),
    same-document entries, 0 elsewhere; ``E_in, E_out [C, 1]`` and ``d_end [1, 1]`` (None: ones).

    16-bit inputs (:func:`gate_prefix`: ``r["g"]`` holds the chunk's prefix sums ``Q_i = Σ_{t <= i} g_t``):
    ``Γ_ij = exp(Q_i − Q_j)``, ``E_in = e^Q``, ``E_out = e^{Q_last − Q}``, ``d_end = e^{Q_last}`` — after a
    huge gate (−1e3) the differences keep ~6e-5 of relative precision, far below the inputs' rounding.
    f32 inputs (``r["g"]`` the gates): the exponents are formed as
    :class:`~kernels.delta.tiles.Chunk` forms them per 16-row tile, so that a huge gate costs the same
    precision as there (f32 ≤ 1e-4 against the reference with gates to −1e3): with ``P_i`` the gates' sum
    over row ``i``'s tile after its first (anchor) row up to ``i``, ``Γ_ij = exp(P_i − P_j)`` within a tile,
    and across tiles the exponent is the sum of non-positive parts
    ``(P_i + g_{a_I}) + Σ_{J<L<I} tot_L + (span_J − P_j)`` (no difference of two long prefix sums);
    ``E_in = e^{Σ_{t <= i} g_t}``, ``E_out = e^{Σ_{t > i} g_t}``, ``d_end = e^{Σ g}``. The ``exp`` sees only
    the causal, same-document entries. Documents zero ``E_in`` after the chunk's first reset, ``E_out``
    before its last and ``d_end`` where the chunk holds a reset."""
    ri, ci = iota((C, C), 0), iota((C, C), 1)
    causal, sees, last, sees_last = _whole_docs(cfg, r, C)
    if not cfg.gated:
        return jnp.where(causal, 1.0, 0.0), sees, last, sees_last
    if gate_prefix(cfg):  # 16-bit inputs: the chunk's prefix sums
        Q = r["g"][...].astype(F32)                                          # [C, 1]
        q_last = load_rows(r["g"], C - 1, 1)                                 # [1, 1]
        decay = jnp.where(causal, exp(jnp.where(causal, Q - col_to_row(Q, cfg.transpose), 0.0)), 0.0)
        return decay, _mul(exp(Q), sees), _mul(exp(q_last - Q), last), _mul(exp(q_last), sees_last)
    g_row = col_to_row(r["g"][...].astype(F32), cfg.transpose)               # [1, C]

    def rows(mask):  # [C, 1]: Σ over the columns where mask holds
        return jnp.sum(jnp.where(mask, g_row, 0.0), axis=1, keepdims=True)

    sh = SUB.bit_length() - 1
    t, tc = lax.shift_right_logical(ri, sh), lax.shift_right_logical(ci, sh)  # tiles of the row, the column
    same, anchor = t == tc, (ci & (SUB - 1)) == 0
    P = rows(same & (ci <= ri) & ~anchor)
    span = rows(same & ~anchor)
    ga = rows(same & anchor)
    expo = (P + ga) + col_to_row(span - P, cfg.transpose)                     # across tiles
    for L in range(1, C // SUB - 1):  # whole tiles between the row's and the column's
        tot = jnp.sum(jnp.where(tc == L, g_row, 0.0), axis=1, keepdims=True)  # [1, 1]
        expo = expo + jnp.where((t > L) & (tc < L), tot, 0.0)
    expo = jnp.where(same, P - col_to_row(P, cfg.transpose), expo)
    decay = jnp.where(causal, exp(jnp.where(causal, expo, 0.0)), 0.0)
    ein = _mul(exp(rows(ci <= ri)), sees)
    eout = _mul(exp(rows(ci > ri)), last)
    return decay, ein, eout, _mul(exp(jnp.sum(g_row, axis=1, keepdims=True)), sees_last)


def _whole_docs(cfg: Cfg, r, C: int):
    """``(causal, sees, last, sees_last)`` of a whole chunk: the ``[C, C]`` causal (diagonal included),
    same-document mask; ``[C, 1]`` 0/1 columns "no reset since the chunk's start" and "in the chunk's last
    document", and ``[1, 1]`` "no reset in the chunk" (the three None without documents)."""
    ri, ci = iota((C, C), 0), iota((C, C), 1)
    causal = ri >= ci
    if not cfg.docs:
        return causal, None, None, None
    doc = r["doc"][...].astype(F32)                                          # [C, 1]: document index in the chunk
    causal = causal & (doc == col_to_row(doc, cfg.transpose))
    doc_last = load_rows(r["doc"], C - 1, 1)                                 # [1, 1]
    return (causal, (doc == 0.0).astype(F32), (doc == doc_last).astype(F32),
            (doc_last == 0.0).astype(F32))


def _whole_channel(cfg: Cfg, r, C: int):
    """Per-channel gates whose in-chunk sums stay within ``WHOLE_SPAN`` of the chunk's middle row ``m``
    (bounded gates: ``(C/2)·|bound| <= WHOLE_SPAN``; exact gates: the chunks whose ``span`` allows it — the
    first pass of ``anchored_fwd="fixup"`` flags the others),
    whole chunk (:func:`intra_fwd_whole`): ``(causal, up, down, ein, eout, d_end, span)`` with ``P_i`` the gates'
    sum over rows ``1..i`` (row 0's own gate left out: a huge gate there costs no precision) and
    ``up = e^{P − P_m}``, ``down = e^{P_m − P}`` ``[C, K]`` — a decayed score is one matmul,
    ``(l ⊙ up)(r ⊙ down)ᵀ``, masked after it (the masked upper triangle may overflow; a ``where`` drops it).
    ``ein = e^{g_0 + P}``, ``eout = e^{P_last − P}``, ``d_end = e^{g_0 + P_last}`` (documents as in
    :func:`_whole_gates`); ``span [1, K]``: ``min(P_m − P_0, P_last − P_m)``, the larger distance from the
    anchor (gates ``<= 0``: ``P`` is monotone)."""
    ri, ci = iota((C, C), 0), iota((C, C), 1)
    causal, sees, last, sees_last = _whole_docs(cfg, r, C)
    g = r["g"][...].astype(F32)                                              # [C, K]
    P = tri_dot((ci <= ri) & (ci >= 1), g)                                   # [C, K], exact in f32 (3 bf16 MMAs)
    g0, pm, pl_ = load_rows(r["g"], 0, 1), get_row(P, C // 2), get_row(P, C - 1)
    up, down = exp(P - pm), exp(pm - P)
    ein = _mul(exp(g0 + P), sees)
    eout = _mul(exp(pl_ - P), last)
    return causal, up, down, ein, eout, _mul(exp(g0 + pl_), sees_last), jnp.minimum(pm, pl_ - pm)


def _whole_in(cfg: Cfg, ref):
    """A whole ``[C, D]`` block as the bulk matmuls take it (16-bit as stored, else f32)."""
    x = ref[...]
    return x if cfg.mm_dtype != F32 else x.astype(F32)


def _whole_solve(cfg: Cfg, r, C: int, uw: bool = True, factors=None, gates=None):
    """One chunk's (or half-chunk's, :func:`intra_fwd_halves`) whole-chunk forward products from the input
    refs ``r``: ``(q, k, v, beta, ein, eout, d_end, KK, M, tt, U, W)`` — ``KK`` the decayed ``k kᵀ`` (strictly
    lower), ``M`` the decayed, scaled scores, ``tt = (I + A)⁻ᵀ``, ``U``, ``W`` in f32 (None unless ``uw``);
    gates :func:`_whole_gates`. ``factors(q, k, ein, eout)``, if given, runs right after the gates, before
    the ``[C, C]`` products are live: :func:`intra_fwd_whole` stores ``q_in``/``k_out`` there (stored after
    the solve, the "arrays" mode of :func:`row_factors` spilled 664 B per thread; bf16, triton 3.6)."""
    ri, ci = iota((C, C), 0), iota((C, C), 1)
    q, k, v = _whole_in(cfg, r["q"]), _whole_in(cfg, r["k"]), _whole_in(cfg, r["v"])
    beta = r["beta"][...].astype(F32)                                        # [C, 1]
    if cfg.channel:
        causal, up, down, ein, eout, d_end, _ = gates if gates is not None else _whole_channel(cfg, r, C)
        if factors is not None:
            factors(r["q"][...], r["k"][...], ein, eout)
        kd = k.astype(F32) * down
        KK = jnp.where(causal & (ri > ci), dot(k.astype(F32) * up, kd, tb=True, precision=cfg.solve_prec), 0.0)
        M = jnp.where(causal, mm(cfg, q.astype(F32) * up, kd, tb=True), 0.0) * cfg.scale
    else:
        decay, ein, eout, d_end = _whole_gates(cfg, r, C)
        if factors is not None:
            factors(r["q"][...], r["k"][...], ein, eout)
        # 16-bit inputs: k kᵀ from the stored values with f32 accumulation is the solve's tf32 product exactly
        KK = jnp.where(ri > ci, dot(k, k, tb=True, precision=cfg.solve_prec) * decay, 0.0)
        M = mm(cfg, q, k, tb=True) * (decay * cfg.scale)
    tt = unit_lower_inverse_t(beta * KK, False, "blocks", inverse_prec(cfg))  # (I + A)⁻ᵀ
    if not uw:
        return q, k, v, beta, ein, eout, d_end, KK, M, tt, None, None
    U = dot(tt, beta * v.astype(F32), ta=True, precision=cfg.solve_prec)
    W = dot(tt, _mul(beta * k.astype(F32), ein), ta=True, precision=cfg.solve_prec)
    return q, k, v, beta, ein, eout, d_end, KK, M, tt, U, W


def _whole_outs(cfg: Cfg, refs):
    """The output refs of :func:`intra_fwd_whole` / :func:`intra_fwd_halves`: ``(w, u, m, q_in | ein,
    k_out | eout, d_end, [KK])`` (``q_in``/``k_out`` None in the "scale" mode of :func:`row_factors`)."""
    w_ref, u_ref, m_ref, *outs = refs
    rows = row_factors(cfg)
    qin_ref, kout_ref = (None, None) if rows == "scale" else (outs.pop(0), outs.pop(0))
    dend_ref, *kk = outs
    return w_ref, u_ref, m_ref, qin_ref, kout_ref, dend_ref, kk


def _store_factors(cfg: Cfg, qin_ref, kout_ref, rows, q, k, ein, eout):
    """``q_in``/``k_out`` (the "arrays" mode) or their row factors (``ein`` with ``scale`` folded in, ``eout``;
    the "columns" mode) on the token rows ``rows`` (``slice(None)``: all); nothing in the "scale" mode."""
    mode = row_factors(cfg)
    if mode == "arrays":
        qin_ref[rows, :] = (q.astype(F32) * (cfg.scale if ein is None else ein * cfg.scale)).astype(qin_ref.dtype)
        kout_ref[rows, :] = _mul(k.astype(F32), eout).astype(kout_ref.dtype)
    elif mode == "columns":
        one = jnp.ones((q.shape[0], 1), F32)
        qin_ref[rows, :] = (_mul(one, ein) * cfg.scale).astype(qin_ref.dtype)
        kout_ref[rows, :] = _mul(one, eout).astype(kout_ref.dtype)


def _store_dend(cfg: Cfg, dend_ref, d_end):
    K = dend_ref.shape[0]
    if d_end is None:
        d = jnp.ones((K, 1), F32)
    elif cfg.channel:
        d = row_to_col(d_end, cfg.transpose)
    else:
        d = jnp.broadcast_to(d_end, (K, 1))
    dend_ref[...] = d.astype(dend_ref.dtype)


def intra_fwd_whole(cfg: Cfg, *refs, residuals: bool = True, flag: bool = False):
    """:func:`intra_fwd` on whole-chunk operands (``intra="whole"``): each product is one ``[C, C]`` or ``[C, D]``
    matmul instead of 16-row tile pairs, and ``(I + A)⁻¹`` is inverted whole by recursive doubling
    (``unit_lower_inverse_t``, "blocks"). Same outputs, except that ``KK`` carries the whole transposed inverse
    ``(I + A)⁻ᵀ`` on and above its diagonal (its diagonal 16×16 blocks are the tile inverses :func:`intra_fwd`
    stores there; :func:`intra_bwd_solve_whole` reads all of it, or merges it again from those blocks after
    per-channel gates, whose chunks may come from :func:`intra_fwd_fixup`). Gates: :func:`_whole_gates`
    (scalar, none); per-channel ones (16-bit KDA) anchored at the chunk's middle row, :func:`_whole_channel`
    — bounded gates whose span allows it, or (``flag``, exact gates: the first pass of
    ``anchored_fwd="fixup"``) with a ``[C, 1]`` column that is 1 where the chunk spans more than
    ``WHOLE_SPAN`` from its anchor (that chunk's outputs here are then not to be used), as :func:`intra_fwd`'s."""
    r, outs = _split_in(cfg, refs, ("q", "k", "v", "g", "beta", "doc"))
    if flag:
        *outs, flag_ref = outs
    w_ref, u_ref, m_ref, qin_ref, kout_ref, dend_ref, kk = _whole_outs(cfg, outs)
    C = cfg.chunk
    ri, ci = iota((C, C), 0), iota((C, C), 1)
    gates = _whole_channel(cfg, r, C) if cfg.channel else None
    if flag:  # exact per-channel gates, first pass of anchored_fwd="fixup": 1 where the chunk spans too far
        safe = jnp.min(gates[-1]) >= -WHOLE_SPAN
        flag_ref[...] = jnp.broadcast_to(jnp.where(safe, 0.0, 1.0), flag_ref.shape).astype(flag_ref.dtype)
    *_, d_end, KK, M, tt, U, W = _whole_solve(
        cfg, r, C, factors=lambda q, k, ein, eout: _store_factors(cfg, qin_ref, kout_ref, slice(None), q, k, ein, eout),
        gates=gates)
    u_ref[...] = U.astype(u_ref.dtype)
    w_ref[...] = W.astype(w_ref.dtype)
    m_ref[...] = M.astype(m_ref.dtype)
    if residuals:
        kk[0][...] = jnp.where(ri > ci, KK, tt).astype(kk[0].dtype)
    _store_dend(cfg, dend_ref, d_end)


_SOLVE_COLS = 64  # intra_fwd_halves: the column blocks of its last products


class ChunkView:
    """Chunk ``g`` of a block of G chunks, indexed as the one-chunk block a kernel body expects:
    token blocks ``[G·C, cols]`` by row offset ``g·C``, chunk blocks ``[G, R, cols]`` by leading
    index ``g`` (Triton refs take one indexer, so the offset is folded into each access). Used for
    the chunks a backward program loops over (``api._grouped``) and for the halves of a chunk
    (:func:`intra_fwd_halves`, G = 2); ``minus`` (a ``[1, 1]`` value) is subtracted from what it reads
    (a document index or a gate prefix sum, then counted from the view's first row)."""

    def __init__(self, ref, g, rows, minus=None):
        self.ref, self.g, self.rows, self.minus = ref, g, rows, minus  # rows: C (token block) or None (chunk block)

    @property
    def shape(self):
        return self.ref.shape[1:] if self.rows is None else (self.rows,) + tuple(self.ref.shape[1:])

    @property
    def dtype(self):
        return self.ref.dtype

    def _index(self, idx):
        idx = idx if isinstance(idx, tuple) else (idx,)
        if self.rows is None:
            return (self.g,) + idx
        if idx and idx[0] is Ellipsis:
            idx = (slice(None),) * len(self.shape)
        first, rest = idx[0], idx[1:]
        off = self.g * self.rows
        if isinstance(first, slice) and first == slice(None):
            first = pl.ds(off, self.rows)
        elif isinstance(first, pl.Slice):
            first = pl.ds(off + first.start, first.size)
        else:
            first = off + first
        return (first,) + tuple(rest)

    def __getitem__(self, idx):
        x = self.ref[self._index(idx)]
        return x if self.minus is None else x - self.minus

    def __setitem__(self, idx, value):
        self.ref[self._index(idx)] = value


def intra_fwd_halves(cfg: Cfg, *refs, residuals: bool = True):
    """:func:`intra_fwd_whole`'s outputs for a chunk of ``C`` rows, computed from its two halves ``a``, ``b``
    of ``C/2`` rows (``intra="halves"``), so that the state passes run on chunks of ``C`` rows — half the
    dependent steps — while no product here is larger than a half's. Each half's scores and inverse
    ``T = (I + A)⁻¹`` as in :func:`_whole_solve`; then the block solve of the whole chunk: the decay from a
    row of ``a`` to one of ``b`` is ``E_out,a E_in,b``, so the cross block of ``k kᵀ`` is
    ``KK_ba = E_in,b ⊙ (k_b k_out,aᵀ)``, the inverse's is ``−Y`` with ``Y = T_b (β_b ⊙ KK_ba) T_a``, and
    ``U_b = T_b (β_b v_b) − Y (β_a v_a)``, ``W_b = T_b (β_b k_b ⊙ d_a E_in,b) − Y (β_a k_a ⊙ E_in,a)`` (in
    64-column blocks, to keep registers down). The scores' cross block is ``q_in,b k_out,aᵀ``; the row factors
    across halves ``E_in,b ← d_a E_in,b``, ``E_out,a ← d_b E_out,a``, ``d_end = d_a d_b``; documents are
    counted from each half's start. ``KK``'s upper triangle gets the whole ``(I + A)⁻ᵀ = [[T_aᵀ, −Yᵀ],
    [0, T_bᵀ]]``, as the backward's whole-chunk kernels read it. Measured on one H200 (commit fee572b, bf16,
    H 16, D 128, C = 64 at 4 warps against the default C = 32 whole-chunk forward): this kernel took 0.307 ms (DeltaNet)
    and 0.399 (GDN) at (2, 8192) against 0.185 and 0.229, more than the C = 64 state pass saves, so the
    forward took 0.945× (DeltaNet) and 1.10× (GDN) there, 1.16–1.42× at (8, 2048) and (1, 32768)
    (docs/kernels.md, "Chunks of 64 from two halves")."""
    assert not cfg.channel, "intra_fwd_halves: scalar or no gates"
    r, outs = _split_in(cfg, refs, ("q", "k", "v", "g", "beta", "doc"))
    w_ref, u_ref, m_ref, qin_ref, kout_ref, dend_ref, kk = _whole_outs(cfg, outs)
    C = cfg.chunk
    H = C // 2
    ch = dataclasses.replace(cfg, chunk=H)
    A, B = pl.ds(0, H), pl.ds(H, H)
    ra = {n: (None if x is None else ChunkView(x, 0, H)) for n, x in r.items()}
    # half b counts documents, and prefix-summed gates (gate_prefix), from its own start
    counted = [n for n in ("doc", "g") if r[n] is not None and (n == "doc" or gate_prefix(cfg))]
    minus = {n: load_rows(r[n], H - 1, 1) for n in counted}
    rb = {n: (None if x is None else ChunkView(x, 1, H, minus.get(n))) for n, x in r.items()}
    # half a: stored as it is, except the factors that depend on b's decay
    _, _, _, _, ein_a, eout_a, d_a, KK, M, tt_a, U, W = _whole_solve(ch, ra, H)
    u_ref[A, :] = U.astype(u_ref.dtype)
    w_ref[A, :] = W.astype(w_ref.dtype)
    m_ref[A, A] = M.astype(m_ref.dtype)
    m_ref[A, B] = jnp.zeros((H, H), m_ref.dtype)
    if residuals:
        ri, ci = iota((H, H), 0), iota((H, H), 1)
        kk[0][A, A] = jnp.where(ri > ci, KK, tt_a).astype(kk[0].dtype)
    # half b with the cross terms (a's inputs read again where they are used)
    q, k, _, beta, ein_b, eout_b, d_b, KK, M, tt_b, _, _ = _whole_solve(ch, rb, H, uw=False)
    m_ref[B, B] = M.astype(m_ref.dtype)
    k_out_a = _mul(ra["k"][...].astype(F32), eout_a).astype(ch.mm_dtype)  # [H, K]
    m_ref[B, A] = (_mul(mm(ch, q, k_out_a, tb=True), ein_b) * cfg.scale).astype(m_ref.dtype)  # q_in,b k_out,aᵀ
    _store_factors(cfg, qin_ref, kout_ref, B, q, k, _mul(ein_b, d_a), eout_b)
    KKc = _mul(dot(k, k_out_a, tb=True, precision=ch.solve_prec), ein_b)     # decayed k_b k_aᵀ
    Y = sm(ch, dot(tt_b, beta * KKc, ta=True, precision=ch.solve_prec), tt_a, tb=True)  # T_b A_ba T_a
    if residuals:
        ri, ci = iota((H, H), 0), iota((H, H), 1)
        kk[0][B, A] = KKc.astype(kk[0].dtype)
        kk[0][B, B] = jnp.where(ri > ci, KK, tt_b).astype(kk[0].dtype)
        kk[0][A, B] = (-Y.T).astype(kk[0].dtype)
    ba, ein_b = ra["beta"][...].astype(F32), _mul(ein_b, d_a)
    for out, x, fa, fb in ((u_ref, "v", None, None), (w_ref, "k", ein_a, ein_b)):
        n = min(out.shape[1], _SOLVE_COLS)
        for c in range(0, out.shape[1], n):  # U_b, W_b in column blocks: two [H, n] products live, not [H, D]
            cols = pl.ds(c, n)
            out[B, cols] = (dot(tt_b, _mul(beta * rb[x][:, cols].astype(F32), fb), ta=True, precision=ch.solve_prec)
                            - mm(ch, Y, _mul(ba * ra[x][:, cols].astype(F32), fa))).astype(out.dtype)
    _store_factors(cfg, qin_ref, kout_ref, A, ra["q"][...], ra["k"][...], ein_a, _mul(eout_a, d_b))
    _store_dend(cfg, dend_ref, _mul(d_a, d_b))


def intra_fwd_fixup(cfg: Cfg, n_in: int, *refs, residuals: bool = True):
    """Second pass of ``anchored_fwd="fixup"`` (exact per-channel gates): :func:`intra_fwd` with ``cfg``
    (each diagonal tile anchored or looped, as its gates allow) on the chunks the first pass flagged.
    Refs: the ``n_in − 1`` inputs of :func:`intra_fwd`, the flag column, the first pass's outputs and
    this kernel's outputs — the same buffers (aliased), so the chunks not flagged keep the first pass's
    values and the program returns at once."""
    ins, flag_ref = refs[:n_in - 1], refs[n_in - 1]
    outs = refs[n_in + (len(refs) - n_in) // 2:]

    @pl.when(flag_ref[0, 0] > 0)
    def _():
        intra_fwd(cfg, *ins, *outs, residuals=residuals)


# ---------------------------------------------------------------------------
# state passes
# ---------------------------------------------------------------------------
def row_factors(cfg: Cfg) -> str:
    """How the state passes get ``q_in = q ⊙ E_in`` and ``k_out = k ⊙ E_out``: ``"arrays"`` (per-channel
    gates: ``[T, K]`` arrays written by :func:`intra_fwd`), ``"columns"`` (scalar gates or documents:
    ``q`` and ``k`` with the ``[T, 1]`` f32 row factors ``ein`` — ``scale`` folded in — and ``eout``
    written in their place; ``"arrays"`` with ``cfg.qk_arrays``), ``"scale"`` (DeltaNet without documents:
    ``E_in = scale``, ``E_out = 1``).
    Row factors are applied to the state passes' ``[C, bv]`` operands and results where they feed a
    matmul: ``k_outᵀ Ũ = kᵀ (eout ⊙ Ũ)``, ``k_out dS = eout ⊙ (k dS)``, ``q_inᵀ dO = qᵀ (ein ⊙ dO)``;
    the fused output scales ``q``'s ``[C, K]`` tile (``q_in S = (ein ⊙ q) S``), so that ``ein``'s
    load, too, feeds a matmul and is pipelined (:func:`_lagged_decay`)."""
    if cfg.channel:
        return "arrays"
    if cfg.gated or cfg.docs:
        return "arrays" if cfg.qk_arrays else "columns"
    return "scale"


def _rows(ref, rows):
    """``eout``'s rows ``[C, 1]`` (None: no factor)."""
    return None if ref is None else ref[rows, :]


def state_fwd_step(cfg: Cfg, S, w, u, ko, d, eout=None):
    """``d``: the chunk's decay ``[K, 1]``, or None (no gate, no resets: ``d_end = 1``)."""
    ut, upd = _fwd_update(cfg, S, w, u, ko, eout)
    return ut, _mul(S, d) + upd


def _fwd_update(cfg: Cfg, S, w, u, ko, eout=None):
    """``(Ũ, k_outᵀ Ũ)`` of a chunk with state ``S``: ``Ũ = U − W S`` and the state's update."""
    ut = u - mm(cfg, w, S)
    return ut, mm(cfg, ko, _mul(ut, eout), ta=True)


def _decays(cfg: Cfg) -> bool:
    """Whether the state decays between chunks (``d_end != 1``): gates or document resets."""
    return cfg.gated or cfg.docs


def _d_end(cfg: Cfg, dend_ref, n):
    """Chunk ``n``'s decay ``[K, 1]`` for the state loops (scalar gates and document resets store their
    one number down the column), or None (no decay)."""
    if not _decays(cfg):
        return None
    return dend_ref[n].astype(F32)


def _lagged_decay(cfg: Cfg, dend_ref, n_chunks: int, step, first, row=None):
    """The decay the loops apply at the top of a step: that of the chunk before it in the loop's order
    (``step``, clamped), and 1 at the ``first`` step. The loops carry a state and its last update
    apart and combine them a step late (``S_n = d_{n−1} ⊙ S_{n−1} + k_outᵀ Ũ_{n−1}``), so that ``d``
    feeds that step's matmuls: Triton's pipeliner then prefetches it with the matmuls' operands. A
    load that fed only the carried state was not pipelined and waited on memory inside every step,
    even issued a step ahead (``docs/kernels.md``, "State passes: every load pipelined").
    ``row``: as a row, which scales the columns of a transposed state ``Sᵀ [bv, K]``: ``"full"`` the
    ``[K, 1]`` column turned into a ``[1, K]`` row (a scalar decay's number K times), ``"block"``
    :func:`_d_row` (``[1, 1]`` for a scalar decay); None: the ``[K, 1]`` column (:func:`_d_end`). Triton
    pipelines the full row's load and not the ``[1, 1]`` block's, so the training forward and the
    backward take the full row: paired on one H200 (``kernel_bench --parts ab --ab_ref``, the kernels of
    commit 2b5230a, with the block, against a copy with the full row; ``knobs_h200.json``,
    ``paired.gdn_decay_row``) GDN's fwd+bwd took 0.975 at (2, 8192) (its backward's Triton loop), 0.998
    at (8, 2048) and 1.004 at (1, 32768) (at those two the backward's storing pass runs on Mosaic GPU).
    The forward that stores nothing keeps the block: with the full row GDN's forward took 1.00, 1.02
    and 1.04× as long."""
    if not _decays(cfg):
        return None
    n = jnp.clip(step, 0, n_chunks - 1)
    if row == "full":
        return jnp.where(first, 1.0, col_to_row(_d_end(cfg, dend_ref, n), cfg.transpose))
    return jnp.where(first, 1.0, (_d_row if row == "block" else _d_end)(cfg, dend_ref, n))


def _chunk_rows(n, C):
    """The token rows of chunk ``n`` (a traced index, or a Python int before the loop)."""
    return pl.ds(n * C if isinstance(n, int) else pl.multiple_of(n * C, C), C)


def state_fwd_loop(cfg: Cfg, n_chunks: int, out: "StateOut", *refs, pairs: bool = False, transposed: bool = False):
    """GPU: one program per ``(b, h, value block)`` carries ``S`` through the chunks (its decay applied a
    step late: :func:`_lagged_decay`). With ``out.o`` each chunk's output block ``O_n = q_in S_n + M Ũ_n``
    is taken here, from the state in registers (the output kernel's work, without writing and
    re-reading ``h``); without ``out.h`` and ``out.ut`` neither per-chunk states nor ``Ũ`` are stored
    (a forward that no backward reads). ``q_in`` and ``k_out`` as :func:`row_factors` says; every
    operand of a step feeds its matmuls (``ein`` scales ``q``'s rows for the output), so Triton
    pipelines all of their loads. ``pairs``: two chunks a step (:func:`_pair_step`), half the
    dependent steps; an odd last chunk takes a step of its own. ``transposed`` (not with ``pairs``): the
    loop carries ``Sᵀ [bv, K]`` (:func:`_transposed_step`; ``h`` transposed back for its store)."""
    ins, outs = out.split(cfg, refs)
    dend_ref, h0_ref = ins[3], ins[4]
    st_ref = outs[2]
    if transposed:
        assert not pairs, "state_fwd_loop: transposed with pairs"
        h_ref = outs[0]

        row = "block" if h_ref is None else "full"  # (_lagged_decay)

        def tbody(n, carry):  # the decay applied a step late, as below
            St, upd = carry
            St = _mul(St, _lagged_decay(cfg, dend_ref, n_chunks, n - 1, n == 0, row=row)) + upd
            if h_ref is not None:
                h_ref[n] = jnp.transpose(St).astype(h_ref.dtype)
            return St, _transposed_step(cfg, ins, outs, n, St)

        St0 = jnp.transpose(h0_ref[...].astype(F32))
        St, upd = lax.fori_loop(0, n_chunks, tbody, (St0, jnp.zeros_like(St0)))
        St = _mul(St, _lagged_decay(cfg, dend_ref, n_chunks, n_chunks - 1, False, row=row)) + upd
        st_ref[...] = jnp.transpose(St).astype(st_ref.dtype)
        return
    step = 2 if pairs else 1
    n_steps = n_chunks // step

    def body(i, carry):
        S, upd = carry
        n = i * step
        if pairs:  # the previous pair's two decays (_lagged_decay's, as one factor)
            d = None if not _decays(cfg) else jnp.where(i == 0, 1.0, _d_end(cfg, dend_ref, jnp.maximum(n - 2, 0))
                                                         * _d_end(cfg, dend_ref, jnp.maximum(n - 1, 0)))
            return _pair_step(cfg, ins, outs, n, _mul(S, d) + upd)
        S = _mul(S, _lagged_decay(cfg, dend_ref, n_chunks, n - 1, n == 0)) + upd
        return S, _chunk_step(cfg, ins, outs, n, S)

    S0 = h0_ref[...].astype(F32)
    S, upd = lax.fori_loop(0, n_steps, body, (S0, jnp.zeros_like(S0)))
    last = n_steps * step - 1
    if pairs and n_steps:
        S = _mul(S, None if not _decays(cfg) else _d_end(cfg, dend_ref, last - 1) * _d_end(cfg, dend_ref, last))
    else:
        S = _mul(S, _d_end(cfg, dend_ref, last)) if n_steps else S
    S = S + upd
    if n_steps * step < n_chunks:  # the odd last chunk of pairs
        upd = _chunk_step(cfg, ins, outs, n_chunks - 1, S)
        S = _mul(S, _d_end(cfg, dend_ref, n_chunks - 1)) + upd
    st_ref[...] = S.astype(st_ref.dtype)


def _q_rows(cfg: Cfg, qin_ref, ein_ref, rows):
    """Chunk rows of ``q_in`` (f32 where a row factor scales it) and the factor left to apply to
    ``q_in S`` (``_ein``: ``cfg.scale`` in the "scale" mode, else None)."""
    qin = qin_ref[rows, :]
    if row_factors(cfg) == "columns":
        return qin.astype(F32) * ein_ref[rows, :], None
    return qin, _ein(cfg, None, rows)


def _chunk_step(cfg: Cfg, ins, outs, n, S):
    """One chunk ``n`` of :func:`state_fwd_loop` from its state ``S``: stores ``h``, ``Ũ``, ``o`` as
    ``outs`` asks and returns the state's update ``k_outᵀ Ũ``."""
    w_ref, u_ref, ko_ref, dend_ref, h0_ref, qin_ref, m_ref, ein_ref, eout_ref = ins
    h_ref, ut_ref, _, o_ref = outs
    rows = _chunk_rows(n, cfg.chunk)
    if h_ref is not None:
        h_ref[n] = S.astype(h_ref.dtype)
    ut, upd = _fwd_update(cfg, S, w_ref[rows, :], u_ref[rows, :].astype(F32), ko_ref[rows, :], _rows(eout_ref, rows))
    if ut_ref is not None:
        ut_ref[rows, :] = ut.astype(ut_ref.dtype)
    if o_ref is not None:
        qin, ein = _q_rows(cfg, qin_ref, ein_ref, rows)
        o_ref[rows, :] = _chunk_output(cfg, qin, S, m_ref[rows, :], ut, ein).astype(o_ref.dtype)
    return upd


def _transposed_step(cfg: Cfg, ins, outs, n, St):
    """One chunk ``n`` of :func:`state_fwd_loop` with the state transposed, ``Sᵀ [bv, K]``: stores ``Ũ`` and
    the output ``Oᵀ = Sᵀ q_inᵀ + Ũᵀ Mᵀ`` as ``outs`` asks (transposed back) and returns
    ``(k_outᵀ Ũ)ᵀ = Ũᵀ k_out``, with ``Ũᵀ = Uᵀ − Sᵀ Wᵀ``. Every product has the ``bv`` rows of ``Sᵀ``
    (Triton: ``mma.sync``, the update too, which the untransposed loop lowers to a ``wgmma`` over the ``K``
    rows). Row-factor columns: ``ein`` scales ``q``'s rows as in :func:`_chunk_step`; ``eout`` comes as a
    ``[1, C]`` row per chunk (``eout_ref [N, 1, C]``) and scales ``Ũᵀ``'s columns for the update."""
    w_ref, u_ref, ko_ref, dend_ref, h0_ref, qin_ref, m_ref, ein_ref, eout_ref = ins
    ut_ref, o_ref = outs[1], outs[3]
    rows = _chunk_rows(n, cfg.chunk)
    ut_t = jnp.transpose(u_ref[rows, :].astype(F32)) - mm(cfg, St, w_ref[rows, :], tb=True)   # [bv, C]
    if ut_ref is not None:
        ut_ref[rows, :] = jnp.transpose(ut_t).astype(ut_ref.dtype)
    if o_ref is not None:
        qin, ein = _q_rows(cfg, qin_ref, ein_ref, rows)                                        # ein: scale or None
        o_t = _mul(mm(cfg, St, qin, tb=True), ein) + mm(cfg, ut_t, m_ref[rows, :], tb=True)
        o_ref[rows, :] = jnp.transpose(o_t).astype(o_ref.dtype)
    eout = None if eout_ref is None else eout_ref[n].astype(F32)                               # [1, C]
    return mm(cfg, _mul(ut_t, eout), ko_ref[rows, :])                                          # [bv, K]


def _d_row(cfg: Cfg, dend_ref, n):
    """Chunk ``n``'s decay as a row: ``[1, K]`` for per-channel gates, ``[1, 1]`` otherwise (one number
    down the column)."""
    if cfg.channel:
        return col_to_row(dend_ref[n].astype(F32), cfg.transpose)
    return dend_ref[n, pl.ds(0, 1), :].astype(F32)


def _pair_step(cfg: Cfg, ins, outs, n, S):
    """Chunks ``a = n`` and ``b = n + 1`` of :func:`state_fwd_loop` from ``a``'s state ``S``, as one
    chunk of ``2C`` rows: returns ``(S, update)`` with ``S_{n+2} = d_a d_b ⊙ S + update``.

    ``b``'s state is ``S' = d_a ⊙ S + k_outₐᵀ Ũ_a``, so with ``X = W_b k_outₐᵀ`` (``[C, C]``),
    ``Ũ_b = U_b − W_b S' = (U_b − X U_a) − (W_b ⊙ d_aᵀ − X W_a) S``: the pair's ``W`` and ``U`` are
    merged (their ``b`` rows rewritten) by products that do not involve ``S``, and ``Ũ`` of both
    chunks is one ``[2C, K] × [K, bv]`` matmul from ``S`` (64 rows at C = 32: Hopper's wgmma shape).
    The update is ``(k_out ⊙ f)ᵀ Ũ`` with ``f = d_b`` on ``a``'s rows, and the output
    ``O = (q_in ⊙ f') S + M₂ Ũ`` with ``f' = d_a`` on ``b``'s rows and ``M₂`` the pair's scores: the
    chunks' own ``M`` on the diagonal blocks, ``q_in,b k_outₐᵀ`` below. ``S'`` is formed only to be
    stored (``h``). ``[2C, 2C]`` matrices are written on the whole pair and masked to the block
    they mean; row factors (the "columns" mode) scale the right-hand operands
    (``X U_a = (W_b kₐᵀ)(eoutₐ ⊙ U_a)``); scalar decays are ``[1, 1]``."""
    w_ref, u_ref, ko_ref, dend_ref, h0_ref, qin_ref, m_ref, ein_ref, eout_ref = ins
    h_ref, ut_ref, _, o_ref = outs
    C = cfg.chunk
    rows = pl.ds(pl.multiple_of(n * C, 2 * C), 2 * C)
    row_b = iota((2 * C, 1), 0) >= C  # b's rows
    col_b = iota((1, 2 * C), 1) >= C
    cross = row_b & jnp.logical_not(col_b)  # [2C, 2C]: b's rows, a's columns
    w, ko = w_ref[rows, :], ko_ref[rows, :]
    eo = _rows(eout_ref, rows)
    mode = row_factors(cfg)
    fa = fb = None  # d_a on b's rows, d_b on a's rows
    if _decays(cfg):
        fa = jnp.where(row_b, _d_row(cfg, dend_ref, n), 1.0)
        fb = jnp.where(row_b, 1.0, _d_row(cfg, dend_ref, n + 1))
    # −W₂, −U₂ and Ũ each as a matmul plus a term: a form a compiler may fold into the matmul's
    # accumulator (Triton 3.6 does not: the TTGIR keeps zero accumulators and separate adds)
    X = jnp.where(cross, mm(cfg, w, ko, tb=True), 0.0)  # W_b kₐᵀ (eoutₐ: on the right-hand operands)
    nw2 = mm(cfg, X, w if eo is None else w.astype(F32) * eo) + -_mul(w.astype(F32), fa)  # −W₂
    u = u_ref[rows, :].astype(F32)
    nu2 = mm(cfg, X, _mul(u, eo)) + -u  # −U₂
    if h_ref is not None:
        h_ref[n] = S.astype(h_ref.dtype)
    ut = mm(cfg, nw2, S) + -nu2  # Ũ of both chunks: U₂ − W₂ S
    ut_e = _mul(ut, eo)
    if mode == "arrays":
        upd = mm(cfg, ko if fb is None else ko.astype(F32) * fb, ut, ta=True)
    else:  # "columns": d_b rides on eoutₐ; "scale": no factors
        upd = mm(cfg, ko, _mul(ut_e, fb), ta=True)
    if h_ref is not None:  # b's state S'
        h_ref[n + 1] = (_mul(S, None if fa is None else dend_ref[n].astype(F32))
                        + mm(cfg, jnp.where(row_b, 0.0, ko.astype(F32)), ut_e, ta=True)).astype(h_ref.dtype)
    if ut_ref is not None:
        ut_ref[rows, :] = ut.astype(ut_ref.dtype)
    if o_ref is not None:
        q = qin_ref[rows, :]
        if mode == "arrays":  # q_in, with d_a on b's rows
            qs, rf = (q if fa is None else q.astype(F32) * fa), None
        else:  # q and its row factor (ein, scale folded in; or the scale), d_a rides on it
            qs, rf = q, _mul(_ein(cfg, ein_ref, rows), fa)
        tile2 = (iota((C, 2 * C), 1) == iota((C, 2 * C), 0)) | (iota((C, 2 * C), 1) == iota((C, 2 * C), 0) + C)
        M = m_ref[rows, :]
        Md = jnp.where(row_b == col_b, mm(cfg, M, jnp.where(tile2, 1.0, 0.0).astype(M.dtype)), 0.0)  # the chunks' M
        Mc = jnp.where(cross, _mul(mm(cfg, q, ko, tb=True), _ein(cfg, ein_ref, rows)), 0.0)  # q_in,b kₐᵀ
        o = (_mul(mm(cfg, qs, S), rf) + mm(cfg, Md, ut)) + mm(cfg, Mc, ut_e)
        o_ref[rows, :] = o.astype(o_ref.dtype)
    return S, upd


def state_fwd_grid(cfg: Cfg, out: "StateOut", *refs):
    """TPU: the chunk axis is the last grid axis, the state lives in a VMEM scratch buffer; ``out`` as
    in :func:`state_fwd_loop`."""
    ins, (h_ref, ut_ref, st_ref, o_ref) = out.split(cfg, refs[:-1])
    w_ref, u_ref, ko_ref, dend_ref, h0_ref, qin_ref, m_ref, ein_ref, eout_ref = ins
    s_scr = refs[-1]
    n = pl.program_id(3)
    every = slice(None)

    @pl.when(n == 0)
    def _():
        s_scr[...] = h0_ref[...].astype(F32)

    S_n = s_scr[...]
    if h_ref is not None:
        h_ref[...] = S_n.astype(h_ref.dtype)
    ut, S = state_fwd_step(cfg, S_n, w_ref[...], u_ref[...].astype(F32), ko_ref[...], dend_ref[...].astype(F32),
                           _rows(eout_ref, every))
    if ut_ref is not None:
        ut_ref[...] = ut.astype(ut_ref.dtype)
    if o_ref is not None:
        o_ref[...] = _chunk_output(cfg, qin_ref[...], S_n, m_ref[...], ut, _ein(cfg, ein_ref, every)).astype(o_ref.dtype)
    s_scr[...] = S

    @pl.when(n == pl.num_programs(3) - 1)
    def _():
        st_ref[...] = S.astype(st_ref.dtype)


@dataclasses.dataclass(frozen=True)
class StateOut:
    """What the forward state pass writes besides the final state: ``h`` (the state before every
    chunk, for the backward), ``ut`` (``Ũ``: the backward's, or the output kernel's) and/or ``o``
    (the output, fused: then ``q_in`` and ``M`` are inputs too)."""

    h: bool = True
    o: bool = False
    ut: bool = True

    def split(self, cfg: Cfg, refs):
        """A kernel's refs as 9 inputs ``(w, u, k_out, d_end, h0, q_in, M, ein, eout)`` and 4 outputs
        ``(h, Ũ, final state, o)``, ``None`` where absent (row factors: :func:`row_factors`)."""
        it = iter(refs)
        ins = [next(it) for _ in range(5)] + ([next(it), next(it)] if self.o else [None, None])
        cols = row_factors(cfg) == "columns"
        ins += [next(it) if (cols and self.o) else None, next(it) if cols else None]
        outs = [next(it) if self.h else None, next(it) if self.ut else None, next(it),
                next(it) if self.o else None]
        return ins, outs


def _ein(cfg: Cfg, ref, rows):
    """``q_in``'s row factor: the ``ein`` column, ``cfg.scale`` ("scale" mode) or None ("arrays")."""
    mode = row_factors(cfg)
    return cfg.scale if mode == "scale" else (ref[rows, :] if mode == "columns" else None)


def state_bwd_step(cfg: Cfg, dS, m, do, ko, qi, w, d, ein=None, eout=None):
    """``d`` as in :func:`state_fwd_step`."""
    dut, upd = _bwd_update(cfg, dS, m, do, ko, qi, w, ein, eout)
    return dut, _mul(dS, d) + upd


def _bwd_update(cfg: Cfg, dS, m, do, ko, qi, w, ein=None, eout=None):
    """``(dŨ, q_inᵀ dO − Wᵀ dŨ)`` of a chunk whose end state has the cotangent ``dS``: ``dŨ`` and the
    part of the cotangent of its start state that is not ``d ⊙ dS``."""
    dut = mm(cfg, m, do, ta=True) + _mul(mm(cfg, ko, dS), eout)
    if isinstance(ein, float):  # a constant: scale the [K, bv] product (no rounding of dO)
        qdo = mm(cfg, qi, do, ta=True) * ein
    else:
        qdo = mm(cfg, qi, _mul(do, ein), ta=True)
    return dut, qdo - mm(cfg, w, dut, ta=True)


def _bwd_refs(cfg: Cfg, refs, n_out: int):
    """The backward state pass's refs: 7 inputs ``(M, dO, k_out, q_in, W, d_end, dS_T)``, the row
    factors ``(ein, eout)`` (None unless "columns") and the ``n_out`` remaining refs."""
    cols = row_factors(cfg) == "columns"
    n_in = 9 if cols else 7
    ins = list(refs[:7]) + (list(refs[7:9]) if cols else [None, None])
    return ins, refs[n_in:n_in + n_out] if n_out else refs[n_in:]


def state_bwd_loop(cfg: Cfg, n_chunks: int, *refs, stores: bool = True, transposed: bool = False):
    """GPU: one program per ``(b, h, value block)`` carries ``dS`` back through the chunks; ``q_in``
    and ``k_out`` as :func:`row_factors` says. ``stores=False``: ``dh0`` is the only output (no
    per-chunk ``dh``, no ``dŨ``: the first pass of a split sequence, ``api._state_backward``).
    ``transposed``: the loop carries ``dSᵀ [bv, K]`` (:func:`_transposed_bwd_step`; ``dh`` transposed
    back for its store; row-factor columns: ``eout`` as a ``[1, C]`` row per chunk, ``eout_ref [N, 1, C]``)."""
    ins, outs = _bwd_refs(cfg, refs, 3 if stores else 1)
    dh_ref, dut_ref, dh0_ref = outs if stores else (None, None, outs[0])
    m_ref, do_ref, ko_ref, qi_ref, w_ref, dend_ref, dst_ref, ein_ref, eout_ref = ins
    C = cfg.chunk
    if transposed:
        def tbody(i, carry):  # the decay applied a step late, as below
            dSt, upd = carry
            n = n_chunks - 1 - i
            dSt = _mul(dSt, _lagged_decay(cfg, dend_ref, n_chunks, n + 1, i == 0, row="full")) + upd
            if dh_ref is not None:
                dh_ref[n] = jnp.transpose(dSt).astype(dh_ref.dtype)
            return dSt, _transposed_bwd_step(cfg, ins, dut_ref, n, dSt)

        dSt0 = jnp.transpose(dst_ref[...].astype(F32))
        dSt, upd = lax.fori_loop(0, n_chunks, tbody, (dSt0, jnp.zeros_like(dSt0)))
        dSt = _mul(dSt, _lagged_decay(cfg, dend_ref, n_chunks, 0, False, row="full")) + upd
        dh0_ref[...] = jnp.transpose(dSt).astype(dh0_ref.dtype)
        return

    def body(i, carry):
        dS, upd = carry
        n = n_chunks - 1 - i
        dS = _mul(dS, _lagged_decay(cfg, dend_ref, n_chunks, n + 1, i == 0)) + upd
        if dh_ref is not None:
            dh_ref[n] = dS.astype(dh_ref.dtype)
        rows = _chunk_rows(n, C)
        dut, upd = _bwd_update(cfg, dS, m_ref[rows, :], do_ref[rows, :], ko_ref[rows, :], qi_ref[rows, :],
                               w_ref[rows, :], _ein(cfg, ein_ref, rows), _rows(eout_ref, rows))
        if dut_ref is not None:
            dut_ref[rows, :] = dut.astype(dut_ref.dtype)
        return dS, upd

    dS0 = dst_ref[...].astype(F32)
    dS, upd = lax.fori_loop(0, n_chunks, body, (dS0, jnp.zeros_like(dS0)))
    dh0_ref[...] = (_mul(dS, _d_end(cfg, dend_ref, 0)) + upd).astype(dh0_ref.dtype)


def _transposed_bwd_step(cfg: Cfg, ins, dut_ref, n, dSt):
    """One chunk ``n`` of :func:`state_bwd_loop` with the cotangent transposed, ``dSᵀ [bv, K]``: stores
    ``dŨ`` (transposed back from ``dŨᵀ = dOᵀ M + (dSᵀ k_outᵀ) ⊙ eoutᵀ``) and returns
    ``(q_inᵀ dO − Wᵀ dŨ)ᵀ = dOᵀ q_in − dŨᵀ W`` (``ein`` on ``dO``'s rows). Every product has ``bv``
    rows."""
    m_ref, do_ref, ko_ref, qi_ref, w_ref, dend_ref, dst_ref, ein_ref, eout_ref = ins
    rows = _chunk_rows(n, cfg.chunk)
    do = do_ref[rows, :]
    eout = None if eout_ref is None else eout_ref[n].astype(F32)                      # [1, C]
    dut_t = mm(cfg, do, m_ref[rows, :], ta=True) + _mul(mm(cfg, dSt, ko_ref[rows, :], tb=True), eout)
    if dut_ref is not None:
        dut_ref[rows, :] = jnp.transpose(dut_t).astype(dut_ref.dtype)
    ein = _ein(cfg, ein_ref, rows)
    if isinstance(ein, float):  # a constant: scale the [bv, K] product (no rounding of dO)
        qdo = mm(cfg, do, qi_ref[rows, :], ta=True) * ein
    else:
        qdo = mm(cfg, _mul(do, ein), qi_ref[rows, :], ta=True)
    return qdo - mm(cfg, dut_t, w_ref[rows, :])


def state_bwd_grid(cfg: Cfg, *refs, stores: bool = True):
    """TPU: the chunk axis is the last grid axis, ``dS`` lives in a VMEM scratch buffer; ``stores`` as
    in :func:`state_bwd_loop`."""
    ins, outs = _bwd_refs(cfg, refs, 4 if stores else 2)
    dh_ref, dut_ref, dh0_ref, s_scr = outs if stores else (None, None, *outs)
    m_ref, do_ref, ko_ref, qi_ref, w_ref, dend_ref, dst_ref, ein_ref, eout_ref = ins
    i = pl.program_id(3)
    every = slice(None)

    @pl.when(i == 0)
    def _():
        s_scr[...] = dst_ref[...].astype(F32)

    dS = s_scr[...]
    if dh_ref is not None:
        dh_ref[...] = dS.astype(dh_ref.dtype)
    dut, dS = state_bwd_step(cfg, dS, m_ref[...], do_ref[...], ko_ref[...], qi_ref[...], w_ref[...],
                             dend_ref[...].astype(F32), _ein(cfg, ein_ref, every), _rows(eout_ref, every))
    if dut_ref is not None:
        dut_ref[...] = dut.astype(dut_ref.dtype)
    s_scr[...] = dS

    @pl.when(i == pl.num_programs(3) - 1)
    def _():
        dh0_ref[...] = dS.astype(dh0_ref.dtype)


# ---------------------------------------------------------------------------
# output
# ---------------------------------------------------------------------------
def _chunk_output(cfg: Cfg, qin, S, M, ut, ein=None):
    """``O_n = q_in S_n + M Ũ_n`` (f32): the state's contribution and the chunk's own tokens'
    (``q_in = ein ⊙ q`` when ``ein`` is given)."""
    return _mul(mm(cfg, qin, S), ein) + mm(cfg, M, ut)


def output(cfg: Cfg, qin_ref, h_ref, m_ref, ut_ref, o_ref):
    o_ref[...] = _chunk_output(cfg, qin_ref[...], h_ref[...], m_ref[...], ut_ref[...]).astype(o_ref.dtype)


# ---------------------------------------------------------------------------
# intra_bwd
# ---------------------------------------------------------------------------
# The backward of one chunk in two halves that share nothing but ``dKK`` (the cotangent of
# the β-scaled ``k·k`` scores, ``[C, C]``) and ``β ⊙ dR_w`` (``[C, K]``):
#
# * :func:`_bwd_solve` — back through the UT solve: ``dv, dβ`` and those two (needs S, not dS,
#   q, dO or Ũ);
# * :func:`_bwd_scores` — back through the decayed scores and the state pass's per-chunk
#   inputs: ``dq, dk, dg`` (needs S and dS, dO, Ũ; not v, U, W, dŨ).
#
# GPU: two pallas_calls (``intra_bwd_solve_whole`` then ``intra_bwd_scores``) with the hand-off in
# HBM — ``dKK`` in f32, ``dR_u`` in the bulk matmuls' dtype — written and read again, so that each Triton
# program holds half the tiles (the fused kernel spilled 1.5–7.3 KB per thread). TPU: one
# kernel (``intra_bwd``) that runs both halves; Mosaic keeps the tiles in VMEM.
def _bwd_solve(cfg: Cfg, ch: Chunk, r, kk_ref, dut_ref, ut_ref, dv_ref):
    """Back through the UT solve: stores ``dv``; returns ``dKK`` (tiles), ``dR_u`` and the part of
    ``dβ`` without the ``k_in ⊙ dR_w`` term. Needs no state: ``W``'s cotangent is ``−dŨ Sᵀ`` and the
    back-solve acts on the token rows, so ``dR_w = −dR_u Sᵀ`` (left to :func:`_bwd_scores`), and
    since ``W S = U − Ũ`` (the state pass), ``dA = −(dR_u Uᵀ + dR_w Wᵀ) = −dR_u Ũᵀ``. Needs no gate
    either: the decayed ``k·k`` scores ``KK`` come from the forward kernel (``kk_ref``, f32), so
    ``ch`` serves only the diagonal tiles' causal and document masks."""
    nb = cfg.nb
    beta = _tiles(r["beta"], nb)
    KK, tT = _load_lower(kk_ref, nb, upper=True)
    A = ut_matrix(cfg, KK, beta)
    dRu = solve_backward(cfg, A, tT, _tiles(dut_ref, nb))
    ut = Lazy(lambda J: load_rows(ut_ref, J * SUB, SUB))
    dKK = [dict() for _ in range(nb)]
    dbeta = []
    for I in range(nb):
        store_rows(dv_ref, I * SUB, beta[I] * dRu[I])
        db = jnp.sum(load_rows(r["v"], I * SUB, SUB) * dRu[I], axis=1, keepdims=True)
        for J in range(I + 1):
            dA = -mm(cfg, dRu[I], ut[J], tb=True)
            if J == I:
                dA = jnp.where(ch.diag_mask(I, True), dA, 0.0)
            db = db + jnp.sum(dA * KK[I][J], axis=1, keepdims=True)
            dKK[I][J] = beta[I] * dA
        dbeta.append(db)
    return dKK, dRu, dbeta


def _bwd_scores(cfg: Cfg, ch: Chunk, r, do_ref, ut_ref, h_ref, dh_ref, dKK, get_dru, get_dbeta, dq_ref, dk_ref,
                dbeta_ref, dg_refs):
    """Stores ``dq, dk, dβ`` and the gate's gradient (gated: :func:`_store_dg` into ``dg_refs``), from
    :func:`_bwd_solve`'s ``dKK``, ``dR_u`` and partial ``dβ`` (``get_dru(I)``, ``get_dbeta(I)``: per
    tile). The decayed scores (and their 16-step loops) first, then ``dO Sᵀ`` and ``dR_w = −dR_u Sᵀ``,
    then ``Ũ dSᵀ``, so that those ``[16, K]`` tiles are not live across the loops."""
    nb = cfg.nb
    q = _tiles(r["q"], nb, cfg.scale)
    k = _tiles(r["k"], nb)
    do = [do_ref[pl.ds(I * SUB, SUB), :] for I in range(nb)]
    ut = [ut_ref[pl.ds(I * SUB, SUB), :] for I in range(nb)]
    dM = [dict() for _ in range(nb)]
    dMd = []  # [16, 1]: the diagonal of each dM_II
    for I in range(nb):
        for J in range(I):
            dM[I][J] = mm(cfg, do[I], ut[J], tb=True)
        # The diagonal entries (Γ_ii = 1: no gate dependence) are taken out and added to dq, dk
        # directly, so that their cancelling contributions never reach dg (with strong gates dg is
        # ~e^{-20} smaller than dq, dk and would drown in their rounding).
        dii = mm(cfg, do[I], ut[I], tb=True)
        dMd.append(get_diag(dii))
        dM[I][I] = jnp.where(ch.diag_mask(I, True), dii, 0.0)

    # -- back through the decayed scores
    zero = jnp.zeros_like(k[0])
    dqS = [zero] * nb
    dkL = [zero] * nb
    dkR = [zero] * nb
    if not cfg.channel:
        # [16, 16] decays (or masks) on the score tiles: plain matmuls of the decayed cotangents.
        for I in range(nb):
            for J in range(I + 1):
                dMg = apply_decay(dM[I][J], ch.decay(I, J))
                dKg = apply_decay(dKK[I][J], ch.decay(I, J, strict=True))
                dqS[I] = dqS[I] + mm(cfg, dMg, k[J])
                dkL[I] = dkL[I] + mm(cfg, dKg, k[J])
                dkR[J] = dkR[J] + mm(cfg, dMg, q[I], ta=True) + mm(cfg, dKg, k[I], ta=True)
    else:
        Lq, Lk, Rk = anchored(cfg, ch, q, k)
    for I in range(nb if cfg.channel else 0):
        for J in range(I):
            mij = ch.m[I, J]
            dqS[I] = dqS[I] + _mul(_mul(mm(cfg, dM[I][J], Rk[J]), mij), ch.fL[I])
            dkL[I] = dkL[I] + _mul(_mul(sm(cfg, dKK[I][J], Rk[J]), mij), ch.fL[I])
            dkR[J] = dkR[J] + _mul(_mul(mm(cfg, dM[I][J], Lq[I], ta=True) + sm(cfg, dKK[I][J], Lk[I], ta=True),
                                        mij), ch.fR[J])

        def anchored_tile(I=I):
            # anchored at the middle row: Γ_ij = e^{P_i − P_m} e^{P_m − P_j}; dM, dKK are already masked
            up, down = ch.anchor_factors(I)
            return (dqS[I] + mm(cfg, dM[I][I], k[I] * down) * up,
                    dkL[I] + sm(cfg, dKK[I][I], k[I] * down) * up,
                    dkR[I] + (mm(cfg, dM[I][I], q[I] * up, ta=True) + sm(cfg, dKK[I][I], k[I] * up, ta=True)) * down)

        def exact_tile(I=I):
            def body(j, gam, c):
                dq_, dkl_, dkr_ = c
                kj = load_rows(r["k"], I * SUB + j, 1)
                dmc = get_col(dM[I][I], j)
                dkc = get_col(dKK[I][I], j)
                kg = kj * gam
                right = jnp.sum((dmc * q[I] + dkc * k[I]) * gam, axis=0, keepdims=True)
                return dq_ + dmc * kg, dkl_ + dkc * kg, dkr_ + jnp.where(ch.r16 == j, right, 0.0)

            return ch.diag_loop(I, body, (dqS[I], dkL[I], dkR[I]))

        dqS[I], dkL[I], dkR[I] = ch.diag_tile(I, anchored_tile, exact_tile)

    # dk's score terms in one tile, and the gate's row sums of k ⊙ (dkL − dkR), before S and dS are
    # loaded: dkL and dkR die here rather than live on to the dk store
    dGk = [_gate_sum(cfg, k[I] * (dkL[I] - dkR[I])) if cfg.gated else None for I in range(nb)]
    dkLR = [dkL[I] + dkR[I] + dMd[I] * q[I] for I in range(nb)]
    # -- the state pass's per-chunk inputs, and assemble: dq with S (dO Sᵀ), then dk with dS (Ũ dSᵀ)
    # and β ⊙ dR_w, tile by tile — never both [K, V] states nor all [16, K] partials live at once.
    S = h_ref[...]
    dG, dRws = [], []
    for I in range(nb):
        dqin = mm(cfg, do_ref[pl.ds(I * SUB, SUB), :], S, tb=True)
        dq_gated = _mul(dqin, ch.Ein[I]) + dqS[I]  # dq's gate-dependent part
        store_rows(dq_ref, I * SUB, (dq_gated + dMd[I] * k[I]) * cfg.scale)
        dRw = -mm(cfg, get_dru(I), S, tb=True)
        kdRw = _mul(k[I], ch.Ein[I]) * dRw
        db = jnp.sum(kdRw, axis=1, keepdims=True)
        store_rows(dbeta_ref, I * SUB, get_dbeta(I) + db)
        beta = load_rows(r["beta"], I * SUB, SUB)
        dRws.append(beta * dRw)
        if cfg.gated:
            # the gate's row side: q through e^{G_i} and the scores' rows, k through W = β k ⊙ E_in
            # (the channel sum of k E_in β dR_w is β times dβ's row sum)
            dG.append(dGk[I] + _gate_sum(cfg, q[I] * dq_gated) + (beta * kdRw if cfg.channel else beta * db))
    dS = dh_ref[...]
    dE = []
    for I in range(nb):
        dkout = mm(cfg, ut_ref[pl.ds(I * SUB, SUB), :], dS, tb=True)
        store_rows(dk_ref, I * SUB, _mul(dRws[I], ch.Ein[I]) + _mul(dkout, ch.Eout[I]) + dkLR[I])
        if cfg.gated:
            dE.append(_gate_sum(cfg, k[I] * dkout, ch.Eout[I]))
    if cfg.gated:
        _store_dg(cfg, dG, dE, _state_dot(cfg, h_ref, dh_ref) * ch.d_end, dg_refs)


def _store_dg(cfg: Cfg, dG, dE, dGC, dg_refs):
    """The gate's gradient from its per-row parts (``[16, 1]`` or ``[16, K]`` tiles): with ``G_i`` the
    gate's in-chunk prefix sum, ``dg_s = Σ_{i >= s} dG_i + Σ_{i < s} dE_i + dG_C`` — ``dG_i`` the
    gradient w.r.t. ``G_i`` through ``e^{G_i}`` and the row side of the scores, minus their column
    side; ``dE_i`` that through ``e^{G_C − G_i}`` (which depends on ``g_s`` for ``s > i`` only — a
    forward prefix sum, so a large ``e^{G_C − G_i}`` near the chunk end never cancels against small
    earlier terms); ``dG_C`` through the chunk's decay ``e^{G_C}`` (``Σ S ⊙ dS e^{G_C}``).

    Per-channel gates: the prefix sums run here (``[16, K]``: triangle matmuls) into ``dg``. Scalar
    gates: the kernel stores the two ``[C, 1]`` columns, ``dG`` with ``dG_C`` added to its last row,
    and ``dE``; :func:`kernels.delta.api._gate_grad` takes their prefix sums (in a ``[16, 1]``
    column each is a chain of shuffles: in-kernel they were ~200 of GDN's ~5000 SASS instructions,
    ptxas, bf16)."""
    nb = len(dG)
    if not cfg.channel:
        dg_ref, de_ref = dg_refs
        last = jnp.where(iota((SUB, 1), 0) == SUB - 1, dGC, 0.0)
        _store_tiles(dg_ref, dG[:-1] + [dG[-1] + last])
        _store_tiles(de_ref, dE)
        return
    (dg_ref,) = dg_refs
    tail = [None] * nb
    acc = dGC
    for I in reversed(range(nb)):
        tail[I] = acc
        acc = acc + jnp.sum(dG[I], axis=0, keepdims=True)
    head = None
    for I in range(nb):
        g_s = prefix_sum(dG[I], reverse=True) + tail[I] + prefix_sum(dE[I], reverse=False)
        if head is not None:
            g_s = g_s + head
        store_rows(dg_ref, I * SUB, g_s)
        h = jnp.sum(dE[I], axis=0, keepdims=True)
        head = h if head is None else head + h


def _gate_sum(cfg: Cfg, x, f=None):
    """A scalar gate feeds every channel: its gradient is their sum (of ``x ⊙ f``; a ``[16, 1]`` row
    factor ``f`` multiplies the sum)."""
    return _mul(x, f) if cfg.channel else _mul(jnp.sum(x, axis=1, keepdims=True), f)


def _state_dot(cfg: Cfg, h_ref, dh_ref):
    """``Σ_v S ⊙ dS``: ``[1, K]`` (per-channel gate) or ``[1, 1]``. Scalar gates: over 16-row blocks of the
    states, their products summed elementwise, then one reduction; or (``cfg.state_dot == "tensor"``,
    16-bit states) the trace of ``Σ_b S_b dS_bᵀ`` over ``STATE_DOT_ROWS``-row blocks."""
    K, V = h_ref.shape
    acc = None
    if cfg.channel:
        # the row sums as a [1, K] row straight from the tensor cores: ones [16, w] times the products'
        # transpose, value block by value block, every row of the [16, K] result the same — no [K, 1] ->
        # [1, K] transposition. Each product is split into bf16 parts that hold it exactly: two for
        # 16-bit states (8 + 8 mantissa bits), three for f32 ones; the sum is f32-accurate.
        w = min(V, 32)
        ones = jnp.ones((SUB, w), jnp.bfloat16)
        n_parts = 2 if jnp.dtype(h_ref.dtype).itemsize == 2 and jnp.dtype(dh_ref.dtype).itemsize == 2 else 3
        for c in range(V // w):
            cols = pl.ds(c * w, w)
            p = h_ref[:, cols].astype(F32) * dh_ref[:, cols].astype(F32)
            for part in split_bf16(p)[:n_parts]:
                t = dot(ones, part, tb=True)
                acc = t if acc is None else acc + t
        return jnp.sum(jnp.where(iota((SUB, 1), 0) == 0, acc, 0.0), axis=0, keepdims=True)
    if cfg.state_dot == "tensor" and jnp.dtype(h_ref.dtype).itemsize == 2 and jnp.dtype(dh_ref.dtype).itemsize == 2:
        # 16-bit states: the trace of Σ_b S_b dS_bᵀ over STATE_DOT_ROWS-row blocks b, tensor-core products
        # of the stored values (exact, f32 accumulation)
        R = min(K, STATE_DOT_ROWS)
        for b in range(K // R):
            t = dot(h_ref[pl.ds(b * R, R), :], dh_ref[pl.ds(b * R, R), :], tb=True)
            acc = t if acc is None else acc + t
        diag = jnp.where(iota((R, R), 0) == iota((R, R), 1), acc, 0.0)
        return jnp.sum(jnp.sum(diag, axis=1, keepdims=True), axis=0, keepdims=True)
    for b in range(K // SUB):
        p = load_rows(h_ref, b * SUB, SUB) * load_rows(dh_ref, b * SUB, SUB)
        acc = p if acc is None else acc + p
    return jnp.sum(jnp.sum(acc, axis=1, keepdims=True), axis=0, keepdims=True)


def _fused_state_dot(cfg: Cfg, h_ref, dh_ref) -> bool:
    """``state_dot="fused"`` applies: scalar gates, 16-bit states."""
    return (cfg.state_dot == "fused" and not cfg.channel and jnp.dtype(h_ref.dtype).itemsize == 2
            and jnp.dtype(dh_ref.dtype).itemsize == 2)


def _store_tiles(ref, tiles, scale=None):
    for I, x in enumerate(tiles):
        store_rows(ref, I * SUB, x if scale is None else x * scale)


def _store_lower(ref, T, upper=None):
    """Lower-triangular tiles ``T[I][J]`` (``J <= I``, diagonal tiles strictly lower) into ``ref [C, C]``
    (zeros above); with ``upper`` (tiles ``[16, 16]``, upper triangular) the diagonal tile ``I`` holds
    ``upper[I]`` on and above its diagonal."""
    nb = len(T)
    r, c = iota((SUB, SUB), 0), iota((SUB, SUB), 1)
    for I in range(nb):
        for J in range(nb):
            tile = T[I][J] if J <= I else jnp.zeros((SUB, SUB), F32)
            if J == I and upper is not None:
                tile = jnp.where(r > c, tile, upper[I])
            ref[pl.ds(I * SUB, SUB), pl.ds(J * SUB, SUB)] = tile.astype(ref.dtype)


def _load_lower(ref, nb, upper=False):
    """The tiles :func:`_store_lower` stored; with ``upper`` also the diagonal tiles' upper triangles
    (``(lower, upper)``), the lower ones' diagonal tiles masked to their strict lower triangle."""
    T = [{J: ref[pl.ds(I * SUB, SUB), pl.ds(J * SUB, SUB)].astype(F32) for J in range(I + 1)} for I in range(nb)]
    if not upper:
        return T
    r, c = iota((SUB, SUB), 0), iota((SUB, SUB), 1)
    up = [jnp.where(r <= c, T[I][I], 0.0) for I in range(nb)]
    for I in range(nb):
        T[I][I] = jnp.where(r > c, T[I][I], 0.0)
    return T, up


def intra_bwd_scores(cfg: Cfg, *refs):
    """GPU, second half: ``dq, dk, dβ`` and the gate's gradient (:func:`_store_dg`) from the first
    half's hand-off."""
    r, rest = _split_in(cfg, refs, ("q", "k", "v", "g", "beta", "doc"))
    ut_ref, do_ref, h_ref, dh_ref, dkk_ref, dru_ref, dbp_ref = rest[:7]
    dq_ref, dk_ref, dbeta_ref = rest[7:10]
    ch = Chunk(cfg, r["g"], r["doc"])
    _bwd_scores(cfg, ch, r, do_ref, ut_ref, h_ref, dh_ref, _load_lower(dkk_ref, cfg.nb),
                lambda I: load_rows(dru_ref, I * SUB, SUB), lambda I: load_rows(dbp_ref, I * SUB, SUB),
                dq_ref, dk_ref, dbeta_ref, rest[10:])


def intra_bwd_solve_whole(cfg: Cfg, *refs):
    """GPU, first half of the intra-chunk backward (every rule): ``dv`` and the hand-off ``dKK [C, C]``,
    partial ``dβ [C, 1]`` (f32), ``dR_u [C, V]`` from ``v, β[, doc], KK, Ũ, dŨ`` (no q, k or gate; the
    terms of :func:`_bwd_solve`, which the TPU kernel runs on tiles). ``dR_u = (I + A)⁻ᵀ dŨ`` is one matmul
    with the transposed inverse the whole-chunk forward kernels store in ``KK``'s upper triangle; after the
    tile kernel :func:`intra_fwd` (``cfg.intra == "tiles"``: KDA, f32 inputs), whose ``KK`` holds the 16×16
    tile inverses alone, the inverse is first merged whole from them (``unit_lower_inverse_t`` from 16-row
    blocks: one merge of two ``[C, C]`` products at C = 32).

    A back-solve on 16-row tiles lowered with both warps over the same rows (Triton 3.6: a chained dot with
    M ≥ N gets ``warpsPerCTA = [2, 1]`` at 2 warps), each repeating the other's work; this kernel compiles to
    1864 SASS instructions per thread against the tile kernel's 2416, no spills (bf16, KDA, two chunks a
    program). Paired on one H200 (H 16, D 128, ``kernel_bench --parts ab --ab_ref``; ``knobs_h200.json``):
    16-bit KDA fwd+bwd 0.978–0.981 at (2, 8192), (8, 2048) and (1, 32768), exact and bounded gates (commit
    9f5fb94; the kernel 0.126 ms against 0.185 at (2, 8192)); f32 inputs 0.957 (KDA) and 0.983 (DeltaNet) at
    (2, 8192), 0.962 and 0.986 at (8, 2048) (commit a10b2fb, ``paired.whole_back_solve_f32``)."""
    r, rest = _split_in(cfg, refs, ("v", "beta", "doc"))
    kk_ref, ut_ref, dut_ref, dv_ref, dbp_ref, dkk_ref, dru_ref = rest
    C = cfg.chunk
    ri, ci = iota((C, C), 0), iota((C, C), 1)
    strict = ri > ci
    if cfg.docs:
        doc = r["doc"][...].astype(F32)
        strict = strict & (doc == col_to_row(doc, cfg.transpose))
    kk = kk_ref[...].astype(F32)
    KK = jnp.where(ri > ci, kk, 0.0)
    beta = r["beta"][...].astype(F32)
    tt = jnp.where(ri <= ci, kk, 0.0)
    if cfg.intra == "tiles" or cfg.channel:  # the diagonal 16×16 blocks of (I + A)⁻ᵀ: merge them whole
        sh = SUB.bit_length() - 1
        same = lax.shift_right_logical(ri, sh) == lax.shift_right_logical(ci, sh)
        tt = unit_lower_inverse_t(beta * KK, False, "blocks", inverse_prec(cfg), tt=jnp.where(same, tt, 0.0),
                                  block=SUB)
    dRu = dot(tt, dut_ref[...].astype(F32), precision=cfg.solve_prec)
    dv_ref[...] = (beta * dRu).astype(dv_ref.dtype)
    dA = jnp.where(strict, -mm(cfg, dRu, _whole_in(cfg, ut_ref), tb=True), 0.0)
    db = jnp.sum(r["v"][...].astype(F32) * dRu, axis=1, keepdims=True) + jnp.sum(dA * KK, axis=1, keepdims=True)
    dbp_ref[...] = db.astype(dbp_ref.dtype)
    dkk_ref[...] = (beta * dA).astype(dkk_ref.dtype)
    dru_ref[...] = dRu.astype(dru_ref.dtype)


def intra_bwd_scores_whole(cfg: Cfg, *refs):
    """:func:`intra_bwd_scores` on whole-chunk operands (``intra="whole"``; scalar or no gates): the same
    terms as :func:`_bwd_scores`, each one ``[C, C]`` or ``[C, D]`` matmul."""
    r, rest = _split_in(cfg, refs, ("q", "k", "v", "g", "beta", "doc"))
    ut_ref, do_ref, h_ref, dh_ref, dkk_ref, dru_ref, dbp_ref = rest[:7]
    dq_ref, dk_ref, dbeta_ref = rest[7:10]
    C = cfg.chunk
    ri, ci = iota((C, C), 0), iota((C, C), 1)
    decay, ein, eout, d_end = _whole_gates(cfg, r, C)
    decay = jnp.where(ri > ci, decay, 0.0)  # the diagonal (Γ_ii = 1) is taken apart: see _bwd_scores
    # operands are read from their refs where they are used (not held across the kernel: registers)
    k = lambda: _whole_in(cfg, r["k"])                                       # noqa: E731
    kf = lambda: r["k"][...].astype(F32)                                     # noqa: E731
    qs = lambda: r["q"][...].astype(F32) * cfg.scale                         # noqa: E731
    dM = mm(cfg, _whole_in(cfg, do_ref), _whole_in(cfg, ut_ref), tb=True)
    dMd = get_diag(dM)                                                       # [C, 1]
    dMg = dM * decay
    dKg = dkk_ref[...].astype(F32) * decay
    # dq first, then dk's score terms, then the state's: few [C, K] f32 values live at once
    dq_gated = _mul(mm(cfg, _whole_in(cfg, do_ref), h_ref[...], tb=True), ein) + mm(cfg, dMg, k())
    dq_ref[...] = ((dq_gated + dMd * kf()) * cfg.scale).astype(dq_ref.dtype)
    dG = _gate_sum(cfg, qs() * dq_gated) if cfg.gated else None
    dkL = mm(cfg, dKg, k())
    dkR = mm(cfg, dMg, qs(), ta=True) + mm(cfg, dKg, k(), ta=True)
    if cfg.gated:
        dG = dG + _gate_sum(cfg, kf() * (dkL - dkR))
    dk = dkL + dkR + dMd * qs()
    beta = r["beta"][...].astype(F32)
    fused = cfg.gated and _fused_state_dot(cfg, h_ref, dh_ref)
    dRw = -mm(cfg, dru_ref[...], h_ref[...], tb=True)
    kdRw = _mul(kf(), ein) * dRw
    db = jnp.sum(kdRw, axis=1, keepdims=True)
    dbeta_ref[...] = (dbp_ref[...].astype(F32) + db).astype(dbeta_ref.dtype)
    dk = dk + _mul(beta * dRw, ein)
    ut = _whole_in(cfg, ut_ref)
    dS = dh_ref[...]
    dkout = mm(cfg, ut, dS, tb=True)
    if fused:  # Σ S ⊙ dS from the dS just loaded for dkout (only S is read again)
        sdot = jnp.sum(h_ref[...].astype(F32) * dS.astype(F32), axis=1, keepdims=True)
        sdot = jnp.sum(sdot, axis=0, keepdims=True)
    dk_ref[...] = (dk + _mul(dkout, eout)).astype(dk_ref.dtype)
    if cfg.gated:
        dg_ref, de_ref = rest[10:]
        dGC = (sdot if fused else _state_dot(cfg, h_ref, dh_ref)) * d_end
        dg_ref[...] = (dG + beta * db + jnp.where(iota((C, 1), 0) == C - 1, dGC, 0.0)).astype(dg_ref.dtype)
        de_ref[...] = _gate_sum(cfg, kf() * dkout, eout).astype(de_ref.dtype)


def intra_bwd(cfg: Cfg, *refs):
    """TPU: both halves in one kernel (the hand-off stays on chip)."""
    r, rest = _split_in(cfg, refs, ("q", "k", "v", "g", "beta", "doc"))
    kk_ref, ut_ref, dut_ref, do_ref, h_ref, dh_ref = rest[:6]
    dq_ref, dk_ref, dv_ref, dbeta_ref = rest[6:10]
    ch = Chunk(cfg, r["g"], r["doc"])
    dKK, dRu, dbeta = _bwd_solve(cfg, ch, r, kk_ref, dut_ref, ut_ref, dv_ref)
    _bwd_scores(cfg, ch, r, do_ref, ut_ref, h_ref, dh_ref, dKK, lambda I: dRu[I], lambda I: dbeta[I],
                dq_ref, dk_ref, dbeta_ref, rest[10:])
