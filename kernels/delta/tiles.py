"""In-kernel math of the chunked delta rule, on 16-row tiles.

Everything here runs *inside* a Pallas kernel body and is shared by the GPU
(Triton) and TPU (Mosaic) kernels and by ``interpret=True`` on the CPU. So it
uses only what lowers everywhere: static ``ref[pl.ds(..)]`` loads and stores,
2-D ``iota``, ``where``, ``exp``, row/column sums and ``lax.dot_general`` with
fp32 accumulation. There is no cumsum, no transpose, no triangular solve and no
value slicing: a prefix sum is a loop of row adds (gates) or a matmul with a 0/1
triangle (their gradient), a transpose is a ``dot_general`` contraction or a masked
sum against an identity, and the solve is forward substitution on 16×16 diagonal
tiles merged by matmuls. The 16-step loops are ``lax.fori_loop`` on GPU/CPU (Triton
compile time) and Python-unrolled on TPU (``Cfg.unroll``).

Notation for one chunk of ``C`` tokens split into ``nb = C/16`` tiles ``I``:

* ``P_I``      inclusive prefix sum of the gates *inside tile I* (``[16, K]``);
* ``tot_I``    the tile's gate total (``[1, K]``); ``G_i = Σ_{L<I} tot_L + P_I[i]``;
* ``a_I``/``b_I`` the first/last row of tile I (the anchors).

A decayed score ``P[i, j] = Σ_c l_i[c] r_j[c] exp(G_i[c] − G_j[c])`` is, for
``I > J``, ``(l_I ⊙ e^{G_I − G_{a_I}} ⊙ e^{G_{a_I} − G_{b_J}}) (r_J ⊙ e^{G_{b_J} − G_J})ᵀ``:
three factors, each ``exp`` of a segment sum ``<= 0`` (never ``e^{G_i}·e^{−G_j}``,
which overflows for large gates). Inside a diagonal tile each column ``j`` is
computed directly as ``exp(where(i >= j, P_I − P_I[j], −inf))`` — masked before
the ``exp``, so nothing overflows for any gate. Document boundaries (resets)
factor the same way: documents are monotone in the token index, so
``doc_i == doc_j`` iff ``doc_i == doc_a == doc_b == doc_j`` for ``j <= b < a <= i``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

SUB = 16  # tile rows: the diagonal blocks of the solve
F32 = jnp.float32
HIGHEST = lax.Precision.HIGHEST


@dataclasses.dataclass(frozen=True)
class Cfg:
    """Static configuration of one kernel family instance (hashable)."""

    chunk: int            # C, tokens per chunk (multiple of 16)
    gated: bool           # per-channel log-decays present
    docs: bool            # segment resets present
    scale: float          # q multiplier
    mm_dtype: Any         # operand dtype of the bulk matmuls (bf16 or f32)
    mm_prec: Any          # precision of the bulk matmuls when they are f32
    solve_prec: Any       # precision of the f32 matmuls of A and the solve
    unroll: bool = False  # Python-unroll the 16-step inner loops (TPU) or lax.fori_loop them (GPU, CPU)

    @property
    def nb(self) -> int:
        return self.chunk // SUB


def iota(shape, dim):
    return lax.broadcasted_iota(jnp.int32, shape, dim)


def dot(a, b, *, ta=False, tb=False, dtype=None, precision=None):
    """``a @ b`` (``aᵀ`` / ``bᵀ`` when ``ta`` / ``tb``) with f32 accumulation."""
    if dtype is not None:
        a = a.astype(dtype)
        b = b.astype(dtype)
    if a.dtype != F32 or b.dtype != F32:
        precision = None
    dn = (((0 if ta else 1,), (1 if tb else 0,)), ((), ()))
    return lax.dot_general(a, b, dn, precision=precision, preferred_element_type=F32)


def mm(cfg: Cfg, a, b, **kw):
    """Bulk matmul: operands in ``cfg.mm_dtype``."""
    return dot(a, b, dtype=cfg.mm_dtype, precision=cfg.mm_prec, **kw)


def sm(cfg: Cfg, a, b, **kw):
    """Solve-side matmul: f32 operands at ``cfg.solve_prec``."""
    return dot(a.astype(F32), b.astype(F32), precision=cfg.solve_prec, **kw)


def col_to_row(x):
    """``[n, 1] -> [1, n]`` without a transpose (masked sum against the identity)."""
    n = x.shape[0]
    return jnp.sum(jnp.where(iota((n, n), 0) == iota((n, n), 1), x, 0.0), axis=0, keepdims=True)


def row_to_col(x):
    """``[1, n] -> [n, 1]``."""
    n = x.shape[1]
    return jnp.sum(jnp.where(iota((n, n), 0) == iota((n, n), 1), x, 0.0), axis=1, keepdims=True)


def get_row(x, j):
    """Row ``j`` (static) of ``x`` as ``[1, n]``."""
    return jnp.sum(jnp.where(iota((x.shape[0], 1), 0) == j, x, 0.0), axis=0, keepdims=True)


def get_col(x, j):
    """Column ``j`` (static) of ``x`` as ``[m, 1]``."""
    return jnp.sum(jnp.where(iota((1, x.shape[1]), 1) == j, x, 0.0), axis=1, keepdims=True)


def load_rows(ref, start, n):
    return ref[pl.ds(start, n), :].astype(F32)


def store_rows(ref, start, x):
    ref[pl.ds(start, x.shape[0]), :] = x.astype(ref.dtype)


def _mul(x, f):
    return x if f is None else x * f


def loop(unroll: bool, lo: int, hi: int, body, carry):
    """``for j in range(lo, hi): carry = body(j, carry)`` — unrolled, or one ``scf.for``.

    Triton compile time grows steeply with straight-line code, so the GPU kernels keep
    the 16-step loops rolled; Mosaic TPU gets them unrolled (static row offsets).
    """
    if unroll:
        for j in range(lo, hi):
            carry = body(j, carry)
        return carry
    return lax.fori_loop(lo, hi, body, carry)


def unit_lower_inverse_t(a, unroll=False):
    """``(I + a)⁻ᵀ`` for strictly lower ``a`` ``[n, n]``, by forward substitution.

    Row ``i`` of ``T = (I + a)⁻¹`` is ``e_i − Σ_{j<i} a_ij T_j``; we build ``Tᵀ``
    column by column so that each step reads row ``i`` of ``a`` (a masked sum over
    rows) and needs no transpose. f32 throughout.
    """
    n = a.shape[0]
    r, c = iota((n, n), 0), iota((n, n), 1)

    def body(i, tt):
        a_i = jnp.sum(jnp.where(r == i, a, 0.0), axis=0, keepdims=True)  # [1, n]: a[i, :]
        col = jnp.sum(tt * a_i, axis=1, keepdims=True)                     # [n, 1]: Tᵀ[:, <i] a_i
        return jnp.where(c == i, jnp.where(r == i, 1.0, 0.0) - col, tt)

    return loop(unroll, 1, n, body, (r == c).astype(F32))


class Chunk:
    """Per-chunk, per-tile quantities of the gates and the document masks.

    Built at trace time inside a kernel from the chunk's refs. ``None`` stands for
    "all ones" (no gate / no documents), so ungated kernels carry no dead work.
    """

    def __init__(self, cfg: Cfg, g_ref=None, doc_ref=None):
        self.cfg = cfg
        nb, C = cfg.nb, cfg.chunk
        self.r16 = iota((SUB, 1), 0)
        # ---- documents
        if cfg.docs:
            self.doc = [load_rows(doc_ref, I * SUB, SUB) for I in range(nb)]          # [16, 1]
            self.doc_a = [load_rows(doc_ref, I * SUB, 1) for I in range(nb)]          # [1, 1]
            self.doc_b = [load_rows(doc_ref, I * SUB + SUB - 1, 1) for I in range(nb)]
            doc_last = self.doc_b[-1]
            sees = [(d == 0.0).astype(F32) for d in self.doc]          # no reset since chunk start
            last = [(d == doc_last).astype(F32) for d in self.doc]     # same document as the chunk end
            sees_last = (doc_last == 0.0).astype(F32)                  # [1, 1]
            mL = [(self.doc[I] == self.doc_a[I]).astype(F32) for I in range(nb)]
            mR = [(self.doc[I] == self.doc_b[I]).astype(F32) for I in range(nb)]
        else:
            self.doc = None
            sees = last = mL = mR = [None] * nb
            sees_last = None
        # ---- gates
        if cfg.gated:
            self.g_ref, self.doc_ref = g_ref, doc_ref
            # In-tile prefix sums, row by row: P_I[j] = 0 + g_a + ... + g_j (sequential f32 adds).
            # The diagonal loops redo the same adds, so P_I[j] − (their row j) is exactly 0.
            self.P, tot, ga = [], [], []
            K = g_ref.shape[-1]
            for I in range(nb):
                def body(j, carry, I=I):
                    acc, tile = carry
                    acc = acc + load_rows(g_ref, I * SUB + j, 1)
                    return acc, jnp.where(self.r16 == j, acc, tile)
                acc, tile = loop(cfg.unroll, 0, SUB, body, (jnp.zeros((1, K), F32), jnp.zeros((SUB, K), F32)))
                self.P.append(tile)
                tot.append(acc)                                                    # = P_I[15]
                ga.append(load_rows(g_ref, I * SUB, 1))                            # = P_I[0]
            before = [None] * nb
            after = [None] * nb
            acc = None
            for I in range(nb):
                before[I] = acc
                acc = tot[I] if acc is None else acc + tot[I]
            total = acc
            acc = None
            for I in reversed(range(nb)):
                after[I] = acc
                acc = tot[I] if acc is None else acc + tot[I]
            self.Ein = [_mul(jnp.exp(self.P[I] if before[I] is None else before[I] + self.P[I]), sees[I])
                        for I in range(nb)]
            self.Eout = [_mul(jnp.exp((tot[I] - self.P[I]) if after[I] is None else after[I] + (tot[I] - self.P[I])),
                              last[I]) for I in range(nb)]
            self.d_end = _mul(jnp.exp(total), sees_last)                                     # [1, K]
            self.fL = [_mul(jnp.exp(self.P[I] - ga[I]), mL[I]) for I in range(nb)]             # e^{G_I - G_a}
            self.fR = [_mul(jnp.exp(tot[I] - self.P[I]), mR[I]) for I in range(nb)]            # e^{G_b - G_J}
            self.m = {}
            for I in range(nb):
                for J in range(I):
                    e = ga[I]
                    for L in range(J + 1, I):
                        e = e + tot[L]
                    f = jnp.exp(e)                                                             # e^{G_a_I - G_b_J}
                    if cfg.docs:
                        f = f * (self.doc_a[I] == self.doc_b[J]).astype(F32)
                    self.m[I, J] = f
        else:
            self.P = None
            self.Ein, self.Eout = sees, last
            self.d_end = sees_last
            self.fL, self.fR = mL, mR
            self.m = {}
            for I in range(nb):
                for J in range(I):
                    self.m[I, J] = None if not cfg.docs else (self.doc_a[I] == self.doc_b[J]).astype(F32)

    # ------------------------------------------------------------------ masks
    def same_doc(self, I):
        """``[16, 16]`` same-document mask of diagonal tile ``I`` (or None)."""
        if not self.cfg.docs:
            return None
        return self.doc[I] == col_to_row(self.doc[I])

    def diag_mask(self, I, strict: bool):
        r, c = iota((SUB, SUB), 0), iota((SUB, SUB), 1)
        m = (r > c) if strict else (r >= c)
        sd = self.same_doc(I)
        return m if sd is None else (m & sd)

    def diag_loop(self, I, body, carry):
        """Run ``body(j, gam_j, carry)`` for the 16 columns ``j`` of diagonal tile ``I``.

        ``gam_j [16, K]`` is ``exp(G_i − G_j)`` for rows ``i >= j`` of ``j``'s document,
        else exactly 0 (masked before the ``exp``): safe for any gate magnitude.
        """
        cfg = self.cfg
        K = self.P[I].shape[-1]

        def step(j, c):
            acc, inner = c
            acc = acc + load_rows(self.g_ref, I * SUB + j, 1)                      # P_I[j]
            mask = self.r16 >= j
            if cfg.docs:
                mask = mask & (self.doc[I] == load_rows(self.doc_ref, I * SUB + j, 1))
            gam = jnp.exp(jnp.where(mask, self.P[I] - acc, -jnp.inf))
            return acc, body(j, gam, inner)

        return loop(cfg.unroll, 0, SUB, step, (jnp.zeros((1, K), F32), carry))[1]


# ---------------------------------------------------------------------------
# Scores: M (q with k, diagonal included) and KK (k with k, strictly lower).
# ---------------------------------------------------------------------------
def scores(cfg: Cfg, ch: Chunk, q, k, k_ref, want_m=True):
    """Tiles ``M[I][J]``, ``KK[I][J]`` for ``J <= I`` (lists of dicts), decayed and masked.

    ``q``/``k``: per-tile ``[16, K]`` f32 lists (q already scaled). Off-diagonal
    tiles by anchored matmuls; diagonal tiles column by column (gated) or by one
    masked matmul (ungated).
    """
    nb = cfg.nb
    Lq = [_mul(q[I], ch.fL[I]) for I in range(nb)]
    Lk = [_mul(k[I], ch.fL[I]) for I in range(nb)]
    Rk = [_mul(k[J], ch.fR[J]) for J in range(nb)]
    M = [dict() for _ in range(nb)]
    KK = [dict() for _ in range(nb)]
    for I in range(nb):
        for J in range(I):
            mij = ch.m[I, J]
            if want_m:
                M[I][J] = mm(cfg, _mul(Lq[I], mij), Rk[J], tb=True)
            KK[I][J] = sm(cfg, _mul(Lk[I], mij), Rk[J], tb=True)
        if cfg.gated:
            c16 = iota((1, SUB), 1)

            def body(j, gam, c, I=I):
                m_ii, kk_ii = c
                gam = gam * load_rows(k_ref, I * SUB + j, 1)                        # [16, K]
                if want_m:
                    m_ii = m_ii + jnp.where(c16 == j, jnp.sum(q[I] * gam, axis=1, keepdims=True), 0.0)
                kcol = jnp.sum(k[I] * gam, axis=1, keepdims=True)
                kk_ii = kk_ii + jnp.where(c16 == j, jnp.where(ch.r16 > j, kcol, 0.0), 0.0)
                return m_ii, kk_ii

            z = jnp.zeros((SUB, SUB), F32)
            m_ii, kk_ii = ch.diag_loop(I, body, (z, z))
            if want_m:
                M[I][I] = m_ii
            KK[I][I] = kk_ii
        else:
            if want_m:
                M[I][I] = jnp.where(ch.diag_mask(I, False), mm(cfg, q[I], k[I], tb=True), 0.0)
            KK[I][I] = jnp.where(ch.diag_mask(I, True), sm(cfg, k[I], k[I], tb=True), 0.0)
    return M, KK, (Lq, Lk, Rk)


def solve_forward(cfg: Cfg, A, tT, rhs):
    """``X = (I + A)⁻¹ R`` tile by tile: ``X_I = T_II (R_I − Σ_{J<I} A_IJ X_J)``."""
    X = []
    for I in range(cfg.nb):
        r = rhs[I]
        for J in range(I):
            r = r - sm(cfg, A[I][J], X[J])
        X.append(sm(cfg, tT[I], r, ta=True))
    return X


def solve_backward(cfg: Cfg, A, tT, dX):
    """``dR = (I + A)⁻ᵀ dX``: ``dR_I = T_IIᵀ (dX_I − Σ_{J>I} A_JIᵀ dR_J)``."""
    nb = cfg.nb
    dR = [None] * nb
    for I in reversed(range(nb)):
        r = dX[I]
        for J in range(I + 1, nb):
            r = r - sm(cfg, A[J][I], dR[J], ta=True)
        dR[I] = sm(cfg, tT[I], r)
    return dR


def ut_system(cfg: Cfg, ch: Chunk, KK, beta):
    """``A = β ⊙ KK`` (tiles) and the transposed inverses of its diagonal tiles."""
    A = [{J: beta[I] * KK[I][J] for J in KK[I]} for I in range(cfg.nb)]
    tT = [unit_lower_inverse_t(A[I][I], cfg.unroll) for I in range(cfg.nb)]
    return A, tT
