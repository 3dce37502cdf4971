"""Kernel bodies of the chunked delta rule (forward and backward).

Five kernels; ``(par)`` ones run one program per ``(b, h, chunk)``, ``(seq)`` ones
carry the state across chunks:

=====================  =====  ==================================================
``intra_fwd``          par    gates, scores ``M``/``A``, solve → ``W, U, M, q_in, k_out, d_end``
``state_fwd_*``        seq    ``S_n`` per chunk, ``Ũ = U − W S``, ``S ← d ⊙ S + k_outᵀ Ũ``
``output``             par    ``O = q_in S_n + M Ũ``
``state_bwd_*``        seq    reverse: ``dŨ = Mᵀ dO + k_out dS``, ``dS ← q_inᵀ dO + d ⊙ dS − Wᵀ dŨ``
``intra_bwd``          par    ``dq, dk, dv, dβ, dg`` from ``S_n, dS_{n+1}, Ũ, dŨ``
=====================  =====  ==================================================

The sequential kernels come in two flavours with one shared step function:
``*_loop`` (GPU: one program per ``(b, h, v-block)`` loops over chunks with a
``fori_loop`` over refs that hold the whole sequence) and ``*_grid`` (TPU: the
chunk axis is the last, "arbitrary" grid axis and the state lives in a VMEM
scratch buffer).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from kernels.delta.tiles import (
    F32, HIGHEST, SUB, Cfg, Chunk, _mul, dot, get_col, iota, load_rows, mm, row_to_col, col_to_row,
    scores, sm, solve_backward, solve_forward, store_rows, ut_system,
)


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
def intra_fwd(cfg: Cfg, *refs):
    r, outs = _split_in(cfg, refs, ("q", "k", "v", "g", "beta", "doc"))
    w_ref, u_ref, m_ref, qin_ref, kout_ref, dend_ref = outs
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
        store_rows(qin_ref, I * SUB, _mul(q[I], ch.Ein[I]))
        store_rows(kout_ref, I * SUB, _mul(k[I], ch.Eout[I]))
        for J in range(nb):
            tile = M[I][J] if J <= I else jnp.zeros((SUB, SUB), F32)
            m_ref[pl.ds(I * SUB, SUB), pl.ds(J * SUB, SUB)] = tile.astype(m_ref.dtype)
    K = dend_ref.shape[0]
    if ch.d_end is None:
        d = jnp.ones((K, 1), F32)
    elif cfg.gated:
        d = row_to_col(ch.d_end)
    else:
        d = jnp.broadcast_to(ch.d_end, (K, 1))
    dend_ref[...] = d.astype(dend_ref.dtype)


# ---------------------------------------------------------------------------
# state passes
# ---------------------------------------------------------------------------
def state_fwd_step(cfg: Cfg, S, w, u, ko, d):
    ut = u - mm(cfg, w, S)
    S = d * S + mm(cfg, ko, ut, ta=True)
    return ut, S


def state_fwd_loop(cfg: Cfg, n_chunks: int, w_ref, u_ref, ko_ref, dend_ref, h0_ref, h_ref, ut_ref, st_ref):
    C = cfg.chunk

    def body(n, S):
        h_ref[n] = S.astype(h_ref.dtype)
        rows = pl.ds(pl.multiple_of(n * C, C), C)
        ut, S = state_fwd_step(cfg, S, w_ref[rows, :], u_ref[rows, :].astype(F32), ko_ref[rows, :],
                               dend_ref[n].astype(F32))
        ut_ref[rows, :] = ut.astype(ut_ref.dtype)
        return S

    st_ref[...] = lax.fori_loop(0, n_chunks, body, h0_ref[...].astype(F32)).astype(st_ref.dtype)


def state_fwd_grid(cfg: Cfg, w_ref, u_ref, ko_ref, dend_ref, h0_ref, h_ref, ut_ref, st_ref, s_scr):
    n = pl.program_id(3)

    @pl.when(n == 0)
    def _():
        s_scr[...] = h0_ref[...].astype(F32)

    S = s_scr[...]
    h_ref[...] = S.astype(h_ref.dtype)
    ut, S = state_fwd_step(cfg, S, w_ref[...], u_ref[...].astype(F32), ko_ref[...], dend_ref[...].astype(F32))
    ut_ref[...] = ut.astype(ut_ref.dtype)
    s_scr[...] = S

    @pl.when(n == pl.num_programs(3) - 1)
    def _():
        st_ref[...] = S.astype(st_ref.dtype)


def state_bwd_step(cfg: Cfg, dS, m, do, ko, qi, w, d):
    dut = mm(cfg, m, do, ta=True) + mm(cfg, ko, dS)
    dS = mm(cfg, qi, do, ta=True) + d * dS - mm(cfg, w, dut, ta=True)
    return dut, dS


def state_bwd_loop(cfg: Cfg, n_chunks: int, m_ref, do_ref, ko_ref, qi_ref, w_ref, dend_ref, dst_ref,
                   dh_ref, dut_ref, dh0_ref):
    C = cfg.chunk

    def body(i, dS):
        n = n_chunks - 1 - i
        dh_ref[n] = dS.astype(dh_ref.dtype)
        rows = pl.ds(pl.multiple_of(n * C, C), C)
        dut, dS = state_bwd_step(cfg, dS, m_ref[rows, :], do_ref[rows, :], ko_ref[rows, :], qi_ref[rows, :],
                                 w_ref[rows, :], dend_ref[n].astype(F32))
        dut_ref[rows, :] = dut.astype(dut_ref.dtype)
        return dS

    dh0_ref[...] = lax.fori_loop(0, n_chunks, body, dst_ref[...].astype(F32)).astype(dh0_ref.dtype)


def state_bwd_grid(cfg: Cfg, m_ref, do_ref, ko_ref, qi_ref, w_ref, dend_ref, dst_ref, dh_ref, dut_ref, dh0_ref,
                   s_scr):
    i = pl.program_id(3)

    @pl.when(i == 0)
    def _():
        s_scr[...] = dst_ref[...].astype(F32)

    dS = s_scr[...]
    dh_ref[...] = dS.astype(dh_ref.dtype)
    dut, dS = state_bwd_step(cfg, dS, m_ref[...], do_ref[...], ko_ref[...], qi_ref[...], w_ref[...],
                             dend_ref[...].astype(F32))
    dut_ref[...] = dut.astype(dut_ref.dtype)
    s_scr[...] = dS

    @pl.when(i == pl.num_programs(3) - 1)
    def _():
        dh0_ref[...] = dS.astype(dh0_ref.dtype)


# ---------------------------------------------------------------------------
# output
# ---------------------------------------------------------------------------
def output(cfg: Cfg, qin_ref, h_ref, m_ref, ut_ref, o_ref):
    o = mm(cfg, qin_ref[...], h_ref[...]) + mm(cfg, m_ref[...], ut_ref[...])
    o_ref[...] = o.astype(o_ref.dtype)


# ---------------------------------------------------------------------------
# intra_bwd
# ---------------------------------------------------------------------------
def intra_bwd(cfg: Cfg, *refs):
    r, rest = _split_in(cfg, refs, ("q", "k", "v", "g", "beta", "doc"))
    w_ref, u_ref, ut_ref, dut_ref, do_ref, h_ref, dh_ref = rest[:7]
    outs = rest[7:]
    dq_ref, dk_ref, dv_ref, dbeta_ref = outs[:4]
    dg_ref = outs[4] if cfg.gated else None
    nb = cfg.nb
    ch = Chunk(cfg, r["g"], r["doc"])
    q = _tiles(r["q"], nb, cfg.scale)
    k = _tiles(r["k"], nb)
    v = _tiles(r["v"], nb)
    beta = _tiles(r["beta"], nb)
    S = h_ref[...]
    dS = dh_ref[...]
    do = [do_ref[pl.ds(I * SUB, SUB), :] for I in range(nb)]
    ut = [ut_ref[pl.ds(I * SUB, SUB), :] for I in range(nb)]
    dut = _tiles(dut_ref, nb)

    # -- gradients of the state pass's per-chunk inputs
    dqin = [mm(cfg, do[I], S, tb=True) for I in range(nb)]
    dW = [-mm(cfg, dut[I], S, tb=True) for I in range(nb)]
    dkout = [mm(cfg, ut[I], dS, tb=True) for I in range(nb)]
    dM = [dict() for _ in range(nb)]
    for I in range(nb):
        for J in range(I):
            dM[I][J] = mm(cfg, do[I], ut[J], tb=True)
        dM[I][I] = jnp.where(ch.diag_mask(I, False), mm(cfg, do[I], ut[I], tb=True), 0.0)

    # -- back through the solve
    _, KK, (Lq, Lk, Rk) = scores(cfg, ch, q, k, r["k"], want_m=False)
    A, tT = ut_system(cfg, ch, KK, beta)
    U = _tiles(u_ref, nb)
    W = _tiles(w_ref, nb)
    dRu = solve_backward(cfg, A, tT, dut)
    dRw = solve_backward(cfg, A, tT, dW)
    dKK = [dict() for _ in range(nb)]
    dbeta = []
    for I in range(nb):
        kin = _mul(k[I], ch.Ein[I])
        db = jnp.sum(v[I] * dRu[I], axis=1, keepdims=True) + jnp.sum(kin * dRw[I], axis=1, keepdims=True)
        for J in range(I + 1):
            dA = -(sm(cfg, dRu[I], U[J], tb=True) + sm(cfg, dRw[I], W[J], tb=True))
            if J == I:
                dA = jnp.where(ch.diag_mask(I, True), dA, 0.0)
            db = db + jnp.sum(dA * KK[I][J], axis=1, keepdims=True)
            dKK[I][J] = beta[I] * dA
        dbeta.append(db)

    # -- back through the decayed scores
    zero = jnp.zeros_like(k[0])
    dqS = [zero] * nb
    dkL = [zero] * nb
    dkR = [zero] * nb
    for I in range(nb):
        for J in range(I):
            mij = ch.m[I, J]
            dqS[I] = dqS[I] + _mul(_mul(mm(cfg, dM[I][J], Rk[J]), mij), ch.fL[I])
            dkL[I] = dkL[I] + _mul(_mul(sm(cfg, dKK[I][J], Rk[J]), mij), ch.fL[I])
            dkR[J] = dkR[J] + _mul(_mul(mm(cfg, dM[I][J], Lq[I], ta=True) + sm(cfg, dKK[I][J], Lk[I], ta=True),
                                        mij), ch.fR[J])
        if cfg.gated:
            def body(j, gam, c, I=I):
                dq_, dkl_, dkr_ = c
                kj = load_rows(r["k"], I * SUB + j, 1)
                dmc = get_col(dM[I][I], j)
                dkc = get_col(dKK[I][I], j)
                kg = kj * gam
                right = jnp.sum((dmc * q[I] + dkc * k[I]) * gam, axis=0, keepdims=True)
                return dq_ + dmc * kg, dkl_ + dkc * kg, dkr_ + jnp.where(ch.r16 == j, right, 0.0)

            dqS[I], dkL[I], dkR[I] = ch.diag_loop(I, body, (dqS[I], dkL[I], dkR[I]))
        else:
            dqS[I] = dqS[I] + mm(cfg, dM[I][I], k[I])
            dkL[I] = dkL[I] + sm(cfg, dKK[I][I], k[I])
            dkR[I] = dkR[I] + mm(cfg, dM[I][I], q[I], ta=True) + sm(cfg, dKK[I][I], k[I], ta=True)

    # -- assemble
    dG = []
    dGC = None
    for I in range(nb):
        dRw_b = beta[I] * dRw[I]
        dq = _mul(dqin[I], ch.Ein[I]) + dqS[I]
        dk = _mul(dRw_b, ch.Ein[I]) + _mul(dkout[I], ch.Eout[I]) + dkL[I] + dkR[I]
        store_rows(dq_ref, I * SUB, dq * cfg.scale)
        store_rows(dk_ref, I * SUB, dk)
        store_rows(dv_ref, I * SUB, beta[I] * dRu[I])
        store_rows(dbeta_ref, I * SUB, dbeta[I])
        if cfg.gated:
            eout = ch.Eout[I] * (k[I] * dkout[I])
            d = (q[I] * dqS[I] + k[I] * (dkL[I] - dkR[I])
                 + ch.Ein[I] * (dRw_b * k[I] + q[I] * dqin[I]) - eout)
            dG.append(d)
            s = jnp.sum(eout, axis=0, keepdims=True)
            dGC = s if dGC is None else dGC + s
    if cfg.gated:
        dd = col_to_row(jnp.sum(S.astype(F32) * dS.astype(F32), axis=1, keepdims=True))  # [1, K]
        dGC = dGC + dd * ch.d_end
        # dg_s = Σ_{i >= s} dG_i (+ dG_C for every s): reverse prefix sums by a triangle matmul.
        triu = (iota((SUB, SUB), 1) >= iota((SUB, SUB), 0)).astype(F32)
        tail = dGC
        for I in reversed(range(nb)):
            store_rows(dg_ref, I * SUB, dot(triu, dG[I], precision=HIGHEST) + tail)
            tail = tail + jnp.sum(dG[I], axis=0, keepdims=True)
