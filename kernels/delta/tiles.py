"""In-kernel math of the chunked delta rule, on 16-row tiles.

Everything here runs *inside* a Pallas kernel body and is shared by the GPU
(Triton) and TPU (Mosaic) kernels and by ``interpret=True`` on the CPU. So it
uses only what lowers everywhere: static ``ref[pl.ds(..)]`` loads and stores,
2-D ``iota``, ``where``, ``exp``, row/column sums and ``lax.dot_general`` with
fp32 accumulation. There is no cumsum, no transpose, no triangular solve and no
value slicing: a prefix sum is a loop of row adds (gates) or a matmul with a 0/1
triangle (their gradient), a transpose is a ``dot_general`` contraction or a masked
sum against an identity (two exceptions: the block merges of :func:`unit_lower_inverse_t`
transpose one 16×16 tile, and on GPUs ``[16, 1]`` columns become ``[1, 16]`` rows by a
transpose, ``Cfg.transpose``), and the solve is forward substitution on 16×16 diagonal
tiles (or block merges) joined by matmuls. The 16-step loops
are ``lax.fori_loop`` on GPU/CPU (Triton compile time) and Python-unrolled on TPU
(``Cfg.unroll``).

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

Gate kinds (``Cfg.gate``), one mechanism:

* ``"channel"`` (KDA): the factors above are ``[16, K]`` and multiply the operands; a diagonal
  tile is one matmul anchored at its middle row ``m``, ``(q ⊙ e^{P − P_m})(k ⊙ e^{P_m − P})ᵀ``
  masked after the matmul, when its exponents stay ``<= 64`` (``ANCHOR_SPAN``) — always with
  ``Cfg.gate_bound`` (every gate ``>= bound >= -8``), per tile at run time with
  ``Cfg.anchor_when_safe`` (:meth:`Chunk.diag_tile`) — and otherwise loops over its 16 columns
  (exact for any gate).
* ``"scalar"`` (Gated DeltaNet) and ``"none"`` (DeltaNet): the factors are ``[16, 1]`` columns,
  so the decay of a whole score tile is a ``[16, 16]`` matrix (:meth:`Chunk.decay`) applied to
  the plain ``l rᵀ`` product; the diagonal tile's is ``exp`` of in-tile differences behind a
  double ``where``. The scalar gate's gradient is the channel sum of the per-channel one.

Gate gradients avoid cancellation: the diagonal of the ``q·k`` scores (``Γ_ii = 1``) bypasses
``dg``, and the part through ``e^{G_C − G_i}`` is a forward prefix sum, so ``dg`` stays accurate
relative to its own size even when strong gates (−20 per token) make it ~1e-8 of ``dq``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

SUB = 16  # tile rows: the diagonal blocks of the solve
ANCHOR_SPAN = 64.0  # largest |P_i − P_m| of an anchored diagonal tile: 8 rows of gates >= -8 (api.MIN_GATE_BOUND)
F32 = jnp.float32
HIGHEST = lax.Precision.HIGHEST


GATES = ("none", "scalar", "channel")
INTRAS = ("tiles", "whole", "halves")
STATE_DOTS = ("elementwise", "tensor", "fused")


@dataclasses.dataclass(frozen=True)
class Cfg:
    """Static configuration of one kernel family instance (hashable)."""

    chunk: int            # C, tokens per chunk (multiple of 16)
    gate: str             # "none" (DeltaNet), "scalar" (GDN: one log-decay per token) or "channel" (KDA)
    docs: bool            # segment resets present
    scale: float          # q multiplier
    mm_dtype: Any         # operand dtype of the bulk matmuls (bf16 or f32)
    mm_prec: Any          # precision of the bulk matmuls when they are f32
    solve_prec: Any       # precision of the f32 matmuls of A and the solve
    unroll: bool = False  # Python-unroll the 16-step inner loops (TPU) or lax.fori_loop them (GPU, CPU)
    gate_bound: Optional[float] = None  # "channel" only: every gate >= gate_bound (>= -8): anchored diagonal tiles
    anchor_when_safe: bool = False  # "channel", exact gates: anchor each diagonal tile whose gates allow it
                                    # (a per-tile branch, Chunk.anchor_safe), the 16-step loop elsewhere
    inverse: str = "loop"  # the diagonal tiles' (I + A)⁻¹: "loop" (16-step forward substitution) or
                           # "blocks" (four block merges, matmuls); see unit_lower_inverse_t
    qk_arrays: bool = False  # scalar gates / documents: the state passes read q_in, k_out as [T, K] arrays
                             # (kernels.row_factors), as with per-channel gates
    transpose: bool = False  # GPU (Triton): [n, 1] <-> [1, n] by a layout transpose; else (Mosaic TPU) by a
                             # masked sum against the identity (col_to_row)
    intra: str = "tiles"  # the intra-chunk kernels' form (INTRAS): "tiles" (16-row tile pairs) or, without
                          # per-channel gates, "whole" (one [C, C] / [C, D] matmul per product; kernels.intra_fwd_whole)
                          # or "halves" (the forward's products and solve in two halves of C/2 rows, then merged:
                          # kernels.intra_fwd_halves; the backward's kernels as "whole")
    state_dot: str = "fused"  # scalar gates, 16-bit states: Σ S ⊙ dS in the backward's scores kernel from the
                              # loaded dS, as elementwise products or on tensor cores (STATE_DOTS;
                              # kernels._fused_state_dot, kernels._state_dot)

    @property
    def nb(self) -> int:
        return self.chunk // SUB

    @property
    def gated(self) -> bool:
        return self.gate != "none"

    @property
    def channel(self) -> bool:
        """Per-channel decays: applied to the operands (anchored), diagonal tiles loop or anchor."""
        return self.gate == "channel"


LOG2E = 1.4426950408889634


def exp(x):
    """``e^x`` as ``2^(x·log₂e)``, the form of every ``exp`` in the kernels. Triton lowers an f32
    ``exp`` to libdevice's ``expf`` (a range reduction around ``MUFU.EX2``) and ``exp2`` to the bare
    ``MUFU.EX2``; a KDA chunk's gate factors are ``exp`` of whole ``[16, K]`` tiles (SASS of the bounded-gate
    forward kernel, bf16: 4808 instructions per thread with ``exp``, 3576 with this). ``exp(-inf) = 0``; rounding
    ``x·log₂e`` costs a relative ``|x|·2⁻²³`` at most (``8e-6`` at ``|x| = 64``, the anchored tiles'
    largest exponent)."""
    return jnp.exp2(x * LOG2E)


def iota(shape, dim):
    return lax.broadcasted_iota(jnp.int32, shape, dim)


BF16X6 = "bf16x6"  # a `precision`: f32 dots as six bf16 MMAs (see `dot`)
BF16X3 = "bf16x3"  # a `precision`: f32 dots as three bf16 MMAs over two-part splits (~2⁻¹⁶ relative)


def split_bf16(x):
    """f32 ``x`` as three bf16 parts ``x₁ + x₂ + x₃`` (8 + 8 + 8 mantissa bits: all of f32's 24)."""
    x1 = x.astype(jnp.bfloat16)
    rem = x - x1.astype(F32)
    x2 = rem.astype(jnp.bfloat16)
    x3 = (rem - x2.astype(F32)).astype(jnp.bfloat16)
    return x1, x2, x3


def dot(a, b, *, ta=False, tb=False, dtype=None, precision=None):
    """``a @ b`` (``aᵀ`` / ``bᵀ`` when ``ta`` / ``tb``) with f32 accumulation.

    ``precision=BF16X6`` (f32 operands, GPU): six bf16 MMAs over the split operands — every
    cross term down to 2⁻²⁴ relative, i.e. f32 accuracy — instead of an IEEE-f32 dot, which
    Triton expands into FMA loops (a minute or more to compile per backward kernel, and slow).
    """
    if dtype is not None:
        a = a.astype(dtype)
        b = b.astype(dtype)
    if a.dtype != F32 or b.dtype != F32:
        precision = None
    dn = (((0 if ta else 1,), (1 if tb else 0,)), ((), ()))
    if precision == BF16X3:
        a1 = a.astype(jnp.bfloat16)
        a2 = (a - a1.astype(F32)).astype(jnp.bfloat16)
        b1 = b.astype(jnp.bfloat16)
        b2 = (b - b1.astype(F32)).astype(jnp.bfloat16)

        def d(x, y):
            return lax.dot_general(x, y, dn, preferred_element_type=F32)
        return (d(a1, b2) + d(a2, b1)) + d(a1, b1)
    if precision == BF16X6:
        a1, a2, a3 = split_bf16(a)
        b1, b2, b3 = split_bf16(b)

        def d(x, y):
            return lax.dot_general(x, y, dn, preferred_element_type=F32)
        # smallest terms first
        return (d(a1, b3) + d(a2, b2) + d(a3, b1)) + (d(a1, b2) + d(a2, b1)) + d(a1, b1)
    return lax.dot_general(a, b, dn, precision=precision, preferred_element_type=F32)


def mm(cfg: Cfg, a, b, **kw):
    """Bulk matmul: operands in ``cfg.mm_dtype``."""
    return dot(a, b, dtype=cfg.mm_dtype, precision=cfg.mm_prec, **kw)


def sm(cfg: Cfg, a, b, **kw):
    """Solve-side matmul: f32 operands at ``cfg.solve_prec``."""
    return dot(a.astype(F32), b.astype(F32), precision=cfg.solve_prec, **kw)


def col_to_row(x, transpose=False):
    """``[n, 1] -> [1, n]``: a transpose (``transpose``: Triton lowers it to a layout conversion) or a
    masked sum against the identity (lowers everywhere; on Triton a select and a cross-thread
    reduction)."""
    n = x.shape[0]
    if transpose:
        return x.T
    return jnp.sum(jnp.where(iota((n, n), 0) == iota((n, n), 1), x, 0.0), axis=0, keepdims=True)


def row_to_col(x, transpose=False):
    """``[1, n] -> [n, 1]`` (as :func:`col_to_row`)."""
    n = x.shape[1]
    if transpose:
        return x.T
    return jnp.sum(jnp.where(iota((n, n), 0) == iota((n, n), 1), x, 0.0), axis=1, keepdims=True)


def get_row(x, j):
    """Row ``j`` (static) of ``x`` as ``[1, n]``."""
    return jnp.sum(jnp.where(iota((x.shape[0], 1), 0) == j, x, 0.0), axis=0, keepdims=True)


def get_col(x, j):
    """Column ``j`` (static) of ``x`` as ``[m, 1]``."""
    return jnp.sum(jnp.where(iota((1, x.shape[1]), 1) == j, x, 0.0), axis=1, keepdims=True)


def get_diag(x):
    """The diagonal of square ``x`` as a column ``[n, 1]``."""
    n = x.shape[0]
    return jnp.sum(jnp.where(iota((n, n), 0) == iota((n, n), 1), x, 0.0), axis=1, keepdims=True)


def tri_dot(tri, x):
    """``tri @ x`` for a 0/1 matrix ``tri [16, 16]`` and f32 ``x [16, n]``, to f32 accuracy by three
    bf16 MMAs (:func:`split_bf16`; every product exact, f32 accumulation). An IEEE-f32 dot
    expands to FMA loops on Triton: slow to compile and to run."""
    t = tri.astype(jnp.bfloat16)
    x1, x2, x3 = split_bf16(x)
    return (dot(t, x3) + dot(t, x2)) + dot(t, x1)


def prefix_sum(x, reverse: bool):
    """In-tile prefix sums of ``x [16, n]`` along the rows: ``Σ_{s >= i} x_s`` (``reverse``,
    inclusive) or ``Σ_{s < i} x_s`` (forward, exclusive). f32; a triangle matmul for ``n >= 16``,
    a masked row sum for a ``[16, 1]`` column (a dot needs 16 columns on Triton)."""
    r, c = iota((SUB, SUB), 0), iota((SUB, SUB), 1)
    tri = (c >= r) if reverse else (c < r)
    if x.shape[1] == 1:
        return jnp.sum(jnp.where(tri, col_to_row(x), 0.0), axis=1, keepdims=True)
    return tri_dot(tri, x)


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


INVERSES = ("blocks", "loop")


def unit_lower_inverse_t(a, unroll=False, method="loop", precision=BF16X6, tt=None, block=1):
    """``(I + a)⁻ᵀ`` for strictly lower ``a`` ``[n, n]`` (``n`` a power of two), f32.

    ``"blocks"``: recursive doubling of the diagonal blocks. With ``T`` the inverse of the
    block-diagonal part of ``I + a`` in ``b``-blocks (``T = I`` for ``b = 1``), the inverse in
    ``2b``-blocks is ``T − T a_b T``, where ``a_b`` keeps the entries of ``a`` whose row lies in the
    lower and column in the upper half of one ``2b``-block (``[[T₁, 0], [−T₂ a₂₁ T₁, T₂]]`` for
    every block at once). ``log₂ n`` merges of two small matmuls, taken at ``precision`` (default
    :data:`BF16X6`: f32-accurate products); every intermediate is a block of the inverse itself, so
    nothing grows beyond it (unlike a Neumann product ``Π (I + a^{2^k})``). Built transposed:
    ``Tᵀ ← Tᵀ − Tᵀ a_bᵀ Tᵀ``. ``tt`` (with ``block``, a power of two): the merges start from that
    transposed inverse of the block-diagonal part in ``block``-blocks instead of ``T = I`` (the whole-chunk
    back-solve from the 16×16 tile inverses :func:`~kernels.delta.kernels.intra_fwd` stores in ``KK``).

    ``"loop"``: forward substitution, ``n − 1`` dependent steps of masked row/column sums:
    row ``i`` of ``T`` is ``e_i − Σ_{j<i} a_ij T_j``, built as ``Tᵀ`` column by column.
    """
    n = a.shape[0]
    r, c = iota((n, n), 0), iota((n, n), 1)
    if method == "blocks":
        if tt is None:
            tt, block = (r == c).astype(F32), 1
        blk = lambda x, s: lax.shift_right_logical(x, jnp.int32(s))  # noqa: E731  x // 2^s (x >= 0)
        s_ = block.bit_length() - 1
        while (1 << s_) < n:  # b = 2^s_
            a_b = jnp.where((blk(r, s_ + 1) == blk(c, s_ + 1)) & (blk(r, s_) > blk(c, s_)), a, 0.0)
            if s_ == 0:  # T = I: the first merge is I − a_bᵀ, exactly, without a product
                tt = tt - jnp.transpose(a_b)
            else:
                tt = tt - dot(dot(tt, a_b, tb=True, precision=precision), tt, precision=precision)
            s_ += 1
        return tt
    if method != "loop":
        raise ValueError(f"`inverse` must be one of {INVERSES}, got {method!r}")

    def body(i, tt):
        a_i = jnp.sum(jnp.where(r == i, a, 0.0), axis=0, keepdims=True)  # [1, n]: a[i, :]
        col = jnp.sum(tt * a_i, axis=1, keepdims=True)                     # [n, 1]: Tᵀ[:, <i] a_i
        return jnp.where(c == i, jnp.where(r == i, 1.0, 0.0) - col, tt)

    return loop(unroll, 1, n, body, (r == c).astype(F32))


def apply_decay(x, d):
    """Score tile ``x`` times its decay/mask ``d`` (None: ones; bool: a mask; else a factor)."""
    if d is None:
        return x
    if d.dtype == jnp.bool_:
        return jnp.where(d, x, 0.0)
    return x * d


class Lazy:
    """``x[key]`` computed by ``fn(key)`` on first access and cached. Inside a kernel the value is
    traced where it is first used; so never first-access one inside a loop body (its value would be
    that body's tracer)."""

    def __init__(self, fn):
        self._fn, self._v = fn, {}

    def __getitem__(self, key):
        if key not in self._v:
            self._v[key] = self._fn(key)
        return self._v[key]


class Chunk:
    """Per-chunk, per-tile quantities of the gates and the document masks.

    Built at trace time inside a kernel from the chunk's refs. ``None`` stands for
    "all ones" (no gate / no documents), so ungated kernels carry no dead work.

    Gate kinds (``cfg.gate``): per-token factors are ``[16, K]`` ("channel") or
    ``[16, 1]`` columns ("scalar", broadcast over the channels); tile-pair factors
    ``[1, K]`` or ``[1, 1]``. With no per-channel gate ("none", "scalar") the decay of
    a score tile is a ``[16, 16]`` matrix (:meth:`decay`) applied to the plain product
    ``l rᵀ`` — the diagonal tile is one masked matmul, as for DeltaNet.
    """

    def __init__(self, cfg: Cfg, g_ref=None, doc_ref=None):
        self.cfg = cfg
        nb = cfg.nb
        self.r16 = iota((SUB, 1), 0)
        # per-channel gates whose diagonal tiles always run the exact loop: sequential prefix sums
        self.seq_prefix = cfg.channel and cfg.gate_bound is None and not cfg.anchor_when_safe
        self._decay = {}
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
        self.g_ref, self.doc_ref = g_ref, doc_ref
        if cfg.gated:
            if cfg.gate == "channel":
                P, tot, ga, span = self._prefix_channel(g_ref)
            else:
                P, tot, ga, span = self._prefix_scalar(g_ref)
            self.P = P
            self.span = span  # [1, K|1] per tile: P_I[15], the tile's gate sum without its anchor row
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
            # P_I[i] = Σ_{a_I < t <= i} g_t: the anchor row's own gate is left out, so a huge gate there
            # costs no precision in the in-tile differences.

            def with_a(I):  # Σ_{a_I <= t <= i}
                return ga[I] + P[I]

            def m(IJ):
                I, J = IJ
                e = ga[I]
                for L in range(J + 1, I):
                    e = e + tot[L]
                f = exp(e)                                                                   # e^{G_a_I - G_b_J}
                if cfg.docs:
                    f = f * (self.doc_a[I] == self.doc_b[J]).astype(F32)
                return f

            # Lazy (traced where first used): per-channel factors are [16, K] tiles, and computing all
            # of them up front keeps them live across every loop of a kernel (Triton register spills).
            self.Ein = Lazy(lambda I: _mul(exp(with_a(I) if before[I] is None else before[I] + with_a(I)),
                                           sees[I]))
            self.Eout = Lazy(lambda I: _mul(exp((span[I] - P[I]) if after[I] is None
                                                    else after[I] + (span[I] - P[I])), last[I]))
            self.d_end = _mul(exp(total), sees_last)                                       # [1, K|1]
            self.fL = Lazy(lambda I: _mul(exp(P[I]), mL[I]))
            self.fR = Lazy(lambda I: _mul(exp(span[I] - P[I]), mR[I]))                      # e^{G_b - G_J}
            self.m = Lazy(m)
        else:
            self.P = None
            self.Ein, self.Eout = sees, last
            self.d_end = sees_last
            self.fL, self.fR = mL, mR
            self.m = {}
            for I in range(nb):
                for J in range(I):
                    self.m[I, J] = None if not cfg.docs else (self.doc_a[I] == self.doc_b[J]).astype(F32)
        if cfg.channel and cfg.gate_bound is not None:
            self._anc = Lazy(self._anchor_factors)  # every diagonal tile anchored: computed once
        if not cfg.channel:
            self.fR_row = Lazy(lambda J: None if self.fR[J] is None else col_to_row(self.fR[J], cfg.transpose))
            if cfg.gate == "scalar":
                self.P_row = [col_to_row(p, cfg.transpose) for p in self.P]

    def anchor_factors(self, I):
        if self.cfg.gate_bound is not None:
            return self._anc[I]
        return self._anchor_factors(I)  # inside a branch of diag_tile: not cached

    def _anchor_factors(self, I):
        """Diagonal tile ``I`` anchored at its middle row ``m``: ``(e^{P − P_m}, e^{P_m − P})``. With
        ``|P_i − P_m| <= ANCHOR_SPAN`` (bounded gates: ``8·|bound| <= 64``) both stay finite and normal
        in f32 and bf16 (the masked upper triangle may overflow: it is dropped by a `where`, never
        multiplied)."""
        pm = get_row(self.P[I], SUB // 2)
        return exp(self.P[I] - pm), exp(pm - self.P[I])

    def anchor_safe(self, I):
        """Scalar bool: every channel's gates in tile ``I`` keep ``|P_i − P_m| <= ANCHOR_SPAN`` (gates
        ``<= 0``: the in-tile prefix is monotone, so its ends bound it). False for NaN gates."""
        P = self.P[I]
        pm = get_row(P, SUB // 2)
        lo = jnp.minimum(pm - get_row(P, 0), get_row(P, SUB - 1) - pm)  # [1, K], <= 0
        return jnp.min(lo) >= -ANCHOR_SPAN

    def span_safe(self, I):
        """Scalar bool, a cheaper sufficient test than :meth:`anchor_safe`: every channel's in-tile gate
        sum ``P_I[15] − P_I[0]`` (``P_I[0] = 0``) is ``>= -ANCHOR_SPAN``, so no ``|P_i − P_m|`` can
        exceed it (gates ``<= 0``). False for NaN gates."""
        return jnp.min(self.span[I]) >= -ANCHOR_SPAN

    def _prefix_channel(self, g_ref):
        """Per-channel in-tile prefix sums ``P_I[i] = Σ_{a_I < t <= i} g_t`` ``[16, K]`` (the anchor
        row's own gate left out, as for scalar gates). Kernels that always run the exact diagonal
        loop: sequential adds (:meth:`_seq_prefix`, which the loop redoes); kernels that may anchor:
        one triangle matmul (:func:`tri_dot`)."""
        P, tot, ga, span = [], [], [], []
        r, c = iota((SUB, SUB), 0), iota((SUB, SUB), 1)
        for I in range(self.cfg.nb):
            if self.seq_prefix:
                tile = self._seq_prefix(I)
            else:
                tile = tri_dot((c <= r) & (c >= 1), load_rows(g_ref, I * SUB, SUB))
            a = load_rows(g_ref, I * SUB, 1)                                   # [1, K]
            sp = get_row(tile, SUB - 1)                                        # [1, K] = P_I[15]
            P.append(tile)
            ga.append(a)
            span.append(sp)
            tot.append(a + sp)
        return P, tot, ga, span

    def _seq_add(self, I, j, acc):
        """``acc + g_j`` (``+ 0`` for the anchor row ``j = 0``): one step of :meth:`_seq_prefix`."""
        return acc + jnp.where(j == 0, 0.0, load_rows(self.g_ref, I * SUB + j, 1))

    def _seq_prefix(self, I):
        """``P_I`` by sequential f32 adds, row by row (what :meth:`diag_loop` redoes per column)."""
        K = self.g_ref.shape[-1]

        def body(j, c):
            acc, tile = c
            acc = self._seq_add(I, j, acc)
            return acc, jnp.where(self.r16 == j, acc, tile)

        return loop(self.cfg.unroll, 0, SUB, body, (jnp.zeros((1, K), F32), jnp.zeros((SUB, K), F32)))[1]

    def _prefix_scalar(self, g_ref):
        """Scalar gates: ``P_I[i] = Σ_{a_I < t <= i} g_t`` ``[16, 1]`` (the anchor row's own gate left
        out, so a huge gate there costs no precision in the in-tile differences), by a masked sum."""
        P, tot, ga, span = [], [], [], []
        r, c = iota((SUB, SUB), 0), iota((SUB, SUB), 1)
        for I in range(self.cfg.nb):
            g = load_rows(g_ref, I * SUB, SUB)                                 # [16, 1]
            a = load_rows(g_ref, I * SUB, 1)                                   # [1, 1]
            g_row = col_to_row(jnp.where(self.r16 == 0, 0.0, g), self.cfg.transpose)  # [1, 16]
            p = jnp.sum(jnp.where(c <= r, g_row, 0.0), axis=1, keepdims=True)  # [16, 1]
            sp = jnp.sum(g_row, axis=1, keepdims=True)                         # [1, 1] = P_I[15]
            P.append(p)
            ga.append(a)
            span.append(sp)
            tot.append(a + sp)
        return P, tot, ga, span

    # ------------------------------------------------------------------ masks
    def same_doc(self, I):
        """``[16, 16]`` same-document mask of diagonal tile ``I`` (or None)."""
        if not self.cfg.docs:
            return None
        return self.doc[I] == col_to_row(self.doc[I], self.cfg.transpose)

    def diag_mask(self, I, strict: bool):
        r, c = iota((SUB, SUB), 0), iota((SUB, SUB), 1)
        m = (r > c) if strict else (r >= c)
        sd = self.same_doc(I)
        return m if sd is None else (m & sd)

    def decay(self, I, J, strict=False):
        """Gate kinds "none"/"scalar": the ``[16, 16]`` factor of score tile ``(I, J)``, ``J <= I``.

        ``Γ[i, j] = exp(G_i − G_j)`` on the causal, same-document entries, else 0 (None: all
        ones; a bool array: a pure mask). Off-diagonal tiles: the outer product of the
        anchored factors ``e^{G_i − G_a} · e^{G_a − G_b} · e^{G_b − G_j}`` (each <= 1).
        Diagonal tiles: ``exp`` of in-tile differences with the double ``where`` (the
        upper triangle, whose differences may be huge and positive, never reaches ``exp``).
        """
        key = (I, J, strict and I == J)
        if key in self._decay:
            return self._decay[key]
        if J < I:
            d = None
            for f in (self.fL[I], self.fR_row[J], self.m[I, J]):
                if f is not None:
                    d = f if d is None else d * f
            if d is not None:
                d = jnp.broadcast_to(d, (SUB, SUB))
        else:
            mask = self.diag_mask(I, strict)
            if self.cfg.gate == "scalar":
                diff = self.P[I] - self.P_row[I]
                d = jnp.where(mask, exp(jnp.where(mask, diff, 0.0)), 0.0)
            elif self.cfg.docs:
                # a data-dependent bool tile reused by several kernels' tiles: Triton (jax 0.11 lowering)
                # may route it through shared memory, which holds no i1 -> keep it as a 0/1 f32 factor
                d = jnp.where(mask, 1.0, 0.0)
            else:
                d = mask
        self._decay[key] = d
        return d

    def diag_tile(self, I, anchored, exact):
        """Per-channel gates: the diagonal tile ``I``'s ``anchored()`` form (bounded gates), its ``exact()``
        16-step loop, or — ``anchor_when_safe`` — whichever :meth:`anchor_safe` allows, decided per tile
        at run time (``lax.cond``: one branch runs). Both return the same values up to rounding."""
        cfg = self.cfg
        if cfg.gate_bound is not None:
            return anchored()
        if cfg.anchor_when_safe:
            return lax.cond(self.anchor_safe(I), anchored, exact)
        return exact()

    def diag_loop(self, I, body, carry):
        """Run ``body(j, gam_j, carry)`` for the 16 columns ``j`` of diagonal tile ``I``.

        ``gam_j [16, K]`` is ``exp(G_i − G_j)`` for rows ``i >= j`` of ``j``'s document,
        else exactly 0 (masked before the ``exp``): safe for any gate magnitude. Its own prefix
        sums are sequential f32 adds, redone in the same order for column ``j``'s, so that
        ``Γ_jj = e^0 = 1`` exactly.
        """
        cfg = self.cfg
        K = self.P[I].shape[-1]
        P = self.P[I] if self.seq_prefix else self._seq_prefix(I)

        def step(j, c):
            acc, inner = c
            acc = self._seq_add(I, j, acc)                                         # P_I[j]
            mask = self.r16 >= j
            if cfg.docs:
                mask = mask & (self.doc[I] == load_rows(self.doc_ref, I * SUB + j, 1))
            gam = exp(jnp.where(mask, P - acc, -jnp.inf))
            return acc, body(j, gam, inner)

        return loop(cfg.unroll, 0, SUB, step, (jnp.zeros((1, K), F32), carry))[1]


# ---------------------------------------------------------------------------
# Scores: M (q with k, diagonal included) and KK (k with k, strictly lower).
# ---------------------------------------------------------------------------
def scores(cfg: Cfg, ch: Chunk, q, k, k_ref, want_m=True):
    """Tiles ``M[I][J]``, ``KK[I][J]`` for ``J <= I`` (lists of dicts), decayed and masked.

    ``q``/``k``: per-tile ``[16, K]`` f32 lists (q already scaled). Per-channel gates:
    off-diagonal tiles by anchored matmuls; diagonal tiles column by column (exact) or by
    one matmul anchored at the middle row (bounded gates). No per-channel gate: every
    tile is a plain matmul times its ``[16, 16]`` decay (:meth:`Chunk.decay`).
    """
    nb = cfg.nb
    M = [dict() for _ in range(nb)]
    KK = [dict() for _ in range(nb)]
    if not cfg.channel:
        for I in range(nb):
            for J in range(I + 1):
                if want_m:
                    M[I][J] = apply_decay(mm(cfg, q[I], k[J], tb=True), ch.decay(I, J))
                KK[I][J] = apply_decay(sm(cfg, k[I], k[J], tb=True), ch.decay(I, J, strict=True))
        return M, KK, None
    Lq, Lk, Rk = anchored(cfg, ch, q if want_m else None, k)
    for I in range(nb):
        for J in range(I):
            mij = ch.m[I, J]
            if want_m:
                M[I][J] = mm(cfg, _mul(Lq[I], mij), Rk[J], tb=True)
            KK[I][J] = sm(cfg, _mul(Lk[I], mij), Rk[J], tb=True)

        def anchored_tile(I=I):
            up, down = ch.anchor_factors(I)
            kd = k[I] * down
            m_ii = jnp.zeros((SUB, SUB), F32)
            if want_m:
                m_ii = jnp.where(ch.diag_mask(I, False), mm(cfg, q[I] * up, kd, tb=True), 0.0)
            return m_ii, jnp.where(ch.diag_mask(I, True), sm(cfg, k[I] * up, kd, tb=True), 0.0)

        def exact_tile(I=I):
            c16 = iota((1, SUB), 1)

            def body(j, gam, c):
                m_ii, kk_ii = c
                gam = gam * load_rows(k_ref, I * SUB + j, 1)                        # [16, K]
                if want_m:
                    m_ii = m_ii + jnp.where(c16 == j, jnp.sum(q[I] * gam, axis=1, keepdims=True), 0.0)
                kcol = jnp.sum(k[I] * gam, axis=1, keepdims=True)
                kk_ii = kk_ii + jnp.where(c16 == j, jnp.where(ch.r16 > j, kcol, 0.0), 0.0)
                return m_ii, kk_ii

            z = jnp.zeros((SUB, SUB), F32)
            return ch.diag_loop(I, body, (z, z))

        m_ii, kk_ii = ch.diag_tile(I, anchored_tile, exact_tile)
        if want_m:
            M[I][I] = m_ii
        KK[I][I] = kk_ii
    return M, KK, (Lq, Lk, Rk)


def anchored(cfg: Cfg, ch: Chunk, q, k):
    """Per-channel gates: the anchored operands ``(q ⊙ fL, k ⊙ fL, k ⊙ fR)`` of the off-diagonal
    score tiles (``q`` None: its factor is skipped), :class:`Lazy` per tile."""
    Lq = None if q is None else Lazy(lambda I: _mul(q[I], ch.fL[I]))
    return Lq, Lazy(lambda I: _mul(k[I], ch.fL[I])), Lazy(lambda J: _mul(k[J], ch.fR[J]))


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


def ut_matrix(cfg: Cfg, KK, beta):
    """``A = β ⊙ KK`` (tiles)."""
    return [{J: beta[I] * KK[I][J] for J in KK[I]} for I in range(cfg.nb)]


def ut_system(cfg: Cfg, ch: Chunk, KK, beta):
    """``A = β ⊙ KK`` (tiles) and the transposed inverses of its diagonal tiles."""
    A = ut_matrix(cfg, KK, beta)
    prec = inverse_prec(cfg)
    tT = [unit_lower_inverse_t(A[I][I], cfg.unroll, cfg.inverse, prec) for I in range(cfg.nb)]
    return A, tT


def inverse_prec(cfg: Cfg):
    """The precision of the UT inverse's products (``inverse="blocks"``): f32-accurate for f32 inputs (TPU:
    HIGHEST; GPU: six bf16 MMAs); with 16-bit inputs, whose solve runs at tf32 (GPU), three bf16 MMAs
    (~2⁻¹⁶ relative) suffice."""
    if cfg.solve_prec == HIGHEST:
        return HIGHEST
    return BF16X6 if cfg.mm_dtype == F32 else BF16X3
