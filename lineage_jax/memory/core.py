"""The one update equation, three ways to run it.

Every fixed-state memory of the lineage is one rule (row-vector convention,
state ``S`` is ``[K, V]``, write ``S += kᵀu``, read ``o = q S``)::

    S_t = Diag(α_t) S_{t-1} + k_tᵀ u_t
    u_t = β_t · (v_t − e · k_t Diag(α_t) S_{t-1})        e = 1: erase, e = 0: add
    o_t = q_t S_t

and each architecture is one edit to it:

    ============================  =================  ==========  =====
    rule                          α_t = exp(g_t)     β_t          e
    ============================  =================  ==========  =====
    linear attention              1                  1           0
    DeltaNet                      1                  β_t         1
    Gated DeltaNet                scalar per head    β_t         1
    Kimi Delta Attention (KDA)    one per channel    β_t         1
    ============================  =================  ==========  =====

(``Diag(α)`` first, then the erase: the per-channel rule decays, then erases, as
in Kimi Linear's Eq. 1.) A reset (``segment_ids`` changing) zeroes ``S_{t-1}``.

This module implements the rule once:

* :func:`step` — one token, the decode path;
* :func:`recurrent` — ``lax.scan`` of :func:`step` over tokens, the reference;
* :func:`chunked` — the WY/UT form: per chunk of ``C`` tokens a unit lower
  triangular solve ``T = (I + A)⁻¹`` turns the sequential chain of corrections
  into matmuls, and a ``lax.scan`` over chunks carries the state (see docs/design.md,
  "The chunked form").

Internal layout is ``[B, T, H, D]`` for sequences and ``[B, H, K, V]`` for the
state; the gate ``g`` is ``None`` (no decay), ``[..., 1]`` (one scalar per head)
or ``[..., K]`` (per channel). All arithmetic runs in the compute dtype chosen by
the caller (float32 for float32/bf16 inputs, float64 for float64 inputs under x64).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
from jax import lax

Array = jax.Array


def _einsum(spec: str, *operands: Array) -> Array:
    """The products of the rule, at the matmul precision in force (``jax.default_matmul_precision``;
    see docs/design.md, "Numerics": float32 on CPU, TF32 / bf16 passes on GPU / TPU unless "highest")."""
    return jnp.einsum(spec, *operands)


def prefix_sum(x: Array, axis: int, *, reverse: bool = False) -> Array:
    """Inclusive prefix sum along ``axis`` (``reverse``: suffix sum ``Σ_{s >= t}``), as one product
    with a 0/1 triangle at full float32 precision whatever the policy (gate sums must stay exact).

    Not ``jnp.cumsum``: XLA:GPU (jaxlib 0.11) lowers a cumsum to a ``reduce-window`` and, when its
    input is a chunk that is mostly zero padding (sequences shorter than 8 tokens in a chunk of 16
    or more), fails to emit the fused kernel ("Failed to translate module to LLVM IR"). Chunks
    are at most a few hundred tokens, so the triangle costs nothing that matters.
    """
    n = x.shape[axis]
    i = jnp.arange(n)
    tri = (i[None, :] >= i[:, None]) if reverse else (i[None, :] <= i[:, None])  # tri[t, s]: s counts for t
    dtype = x.dtype if jnp.issubdtype(x.dtype, jnp.floating) else jnp.float32
    xm = jnp.moveaxis(x, axis, -1).astype(dtype)
    out = jnp.einsum("...s,ts->...t", xm, tri.astype(dtype), precision=lax.Precision.HIGHEST)
    return jnp.moveaxis(out, -1, axis).astype(x.dtype)


class RuleInputs(NamedTuple):
    """One rule's per-token inputs, layout ``[B, T, H, ...]`` (or ``[B, H, ...]`` for a step).

    q is already multiplied by its scale. ``g`` is a natural-log decay (<= 0),
    ``beta`` the write strength, ``reset`` marks tokens whose incoming state is
    zeroed (``[B, T]`` / ``[B]``).
    """

    q: Array
    k: Array
    v: Array
    g: Optional[Array] = None
    beta: Optional[Array] = None
    reset: Optional[Array] = None


# ----------------------------------------------------------------------------
# One token.
# ----------------------------------------------------------------------------
def step(state: Array, x: RuleInputs, *, erase: bool) -> tuple[Array, Array]:
    """One token of the rule. ``x`` fields are ``[B, H, D]`` (``g``: ``[B, H, Kg]``,
    ``beta``: ``[B, H]``, ``reset``: ``[B]``); ``state`` is ``[B, H, K, V]``."""
    S = state
    if x.reset is not None:
        S = jnp.where(x.reset[:, None, None, None], jnp.zeros_like(S), S)
    if x.g is not None:
        S = S * jnp.exp(x.g)[..., :, None]  # Diag(α): decay rows (key channels)
    u = x.v
    if erase:
        u = u - _einsum("bhk,bhkv->bhv", x.k, S)  # v − (what k currently reads)
    if x.beta is not None:
        u = x.beta[..., None] * u
    S = S + _einsum("bhk,bhv->bhkv", x.k, u)
    o = _einsum("bhk,bhkv->bhv", x.q, S)
    return o, S


def recurrent(x: RuleInputs, state: Array, *, erase: bool) -> tuple[Array, Array]:
    """``lax.scan`` of :func:`step` over the token axis. Returns ``(o [B,T,H,V], S)``."""

    def time_major(a):
        return None if a is None else jnp.moveaxis(a, 1, 0)

    xs = RuleInputs(*(time_major(a) for a in x))

    def body(S, xt):
        o, S = step(S, RuleInputs(*xt), erase=erase)
        return S, o

    state, o = lax.scan(body, state, xs)
    return jnp.moveaxis(o, 0, 1), state


# ----------------------------------------------------------------------------
# The chunked (WY / UT) form.
# ----------------------------------------------------------------------------
def _masked_exp(diff: Array, mask: Array) -> Array:
    """``exp(diff)`` where ``mask`` else 0, with no inf/NaN reaching any gradient.

    The double ``where``: masked entries (whose differences may be huge and
    positive) are replaced by 0 *before* ``exp``, so neither the value nor its
    cotangent can overflow.
    """
    safe = jnp.where(mask, diff, jnp.zeros_like(diff))
    return jnp.where(mask, jnp.exp(safe), jnp.zeros_like(diff))


def _subblock(chunk: int) -> int:
    return 16 if chunk % 16 == 0 else chunk


def segment_sums(g: Array) -> Array:
    """``D[i, j] = Σ_{j < s <= i} g_s`` for ``i > j`` (0 elsewhere): ``[..., C, Kg] -> [..., C, C, Kg]``.

    ``exp(D[i, j])`` is the decay between tokens ``j`` and ``i``. Each entry is a
    direct running sum of the gates in between, never a difference of two long
    cumulative sums: with gates near −20 a chunk's cumulative sum reaches −1000,
    whose float32 spacing (~1e-4) would swamp a nearby pair's true difference.
    """
    C = g.shape[-2]
    below = jnp.tril(jnp.ones((C, C), dtype=bool), -1)[:, :, None]
    x = jnp.where(below, g[..., :, None, :], jnp.zeros((), g.dtype))  # x[s, j] = g_s for s > j
    return prefix_sum(x, axis=-3)


def decayed_scores(lefts: tuple[Array, ...], right: Array, g: Optional[Array]) -> tuple[Array, ...]:
    """``P[i, j] = Σ_c left_i[c] · right_j[c] · Π_{j<s<=i} α_s[c]`` for ``j <= i``, else 0.

    ``left``/``right`` are ``[..., C, K]``; ``g`` the chunk's log-decays
    ``[..., C, Kg]`` (``Kg`` = 1 or ``K``) or ``None``.

    Numerics: decays are ``exp`` of segment sums (exponent <= 0; see
    :func:`segment_sums`) — never ``exp(G_i) · exp(−G_j)``, which overflows. The
    diagonal (``exp(0) = 1``) is set, not computed, so no cancelling cotangents
    reach the gates. Per-channel decays avoid a ``[C, C, K]`` tensor by splitting
    the chunk into sub-blocks of 16: diagonal blocks are explicit, and a pair
    (row block ``I``, column ``j`` in an earlier block) is anchored at
    ``a = first row of I``: ``decay(j→i) = decay(a→i) · decay(j→a)``, both <= 1.
    """
    C = right.shape[-2]
    incl = jnp.tril(jnp.ones((C, C), dtype=bool))
    if g is None:
        return tuple(jnp.where(incl, _einsum("...ik,...jk->...ij", left, right), 0.0) for left in lefts)
    strict = jnp.tril(jnp.ones((C, C), dtype=bool), -1)
    if g.shape[-1] == 1:
        gamma = _masked_exp(segment_sums(g)[..., 0], strict) + jnp.eye(C, dtype=g.dtype)
        return tuple(_einsum("...ik,...jk->...ij", left, right) * gamma for left in lefts)

    s = _subblock(C)
    nb = C // s
    K = right.shape[-1]
    lead = right.shape[:-2]
    gb = g.reshape(*lead, nb, s, K)
    Rb = right.reshape(*lead, nb, s, K)
    # Diagonal sub-blocks, explicit: E[n, i, j, :] = decay(j → i) inside block n.
    E = _masked_exp(segment_sums(gb), jnp.tril(jnp.ones((s, s), dtype=bool), -1)[:, :, None])
    E = E + jnp.eye(s, dtype=g.dtype)[:, :, None]
    # Row side of the anchor: decay(a → i) = exp(Σ_{a < t <= i} g_t) within the block.
    left_decay = jnp.exp(prefix_sum(gb.at[..., 0, :].set(0.0), axis=-2))  # [..., nb, s, K]
    # Column side: decay(j → a_I) = exp(Σ_{j < t <= a_I} g_t) for columns before block I.
    anchors = jnp.arange(nb) * s
    upto = jnp.arange(C)[None, :] <= anchors[:, None]  # [nb, C]: t <= a_I
    g_upto = jnp.where(upto[:, :, None], g[..., None, :, :], 0.0)  # [..., nb, C, K]
    suffix = prefix_sum(g_upto, axis=-2, reverse=True)  # Σ_{j <= t <= a_I}
    suffix = jnp.concatenate([suffix[..., 1:, :], jnp.zeros_like(suffix[..., :1, :])], axis=-2)
    col_before = (jnp.arange(C)[None, :] < anchors[:, None])[:, :, None]  # [nb, C, 1]
    R_anch = right[..., None, :, :] * _masked_exp(suffix, col_before)  # [..., nb, C, K]
    eye = jnp.eye(nb, dtype=right.dtype)
    out = []
    for left in lefts:
        Lb = left.reshape(*lead, nb, s, K)
        p_diag = _einsum("...nik,...njk,...nijk->...nij", Lb, Rb, E)
        p_off = _einsum("...nik,...njk->...nij", Lb * left_decay, R_anch).reshape(*lead, C, C)
        p_bd = _einsum("...nij,nm->...nimj", p_diag, eye).reshape(*lead, C, C)
        out.append(p_off + p_bd)
    return tuple(out)


def _pad_time(a: Optional[Array], pad: int, value=0) -> Optional[Array]:
    if a is None or pad == 0:
        return a
    widths = [(0, 0)] * a.ndim
    widths[1] = (0, pad)
    return jnp.pad(a, widths, constant_values=value)


def _to_chunks(a: Optional[Array], n: int, c: int) -> Optional[Array]:
    """``[B, T, H, ...] -> [B, H, N, C, ...]``."""
    if a is None:
        return None
    a = jnp.moveaxis(a, 2, 1)
    return a.reshape(a.shape[0], a.shape[1], n, c, *a.shape[3:])


def ut_transform(kk: Array, k: Array, v: Array, beta: Array, decay_in: Array,
                 same_doc: Optional[Array] = None) -> tuple[Array, Array]:
    """The UT transform of one chunk: the erase chain as one triangular solve.

    Within a chunk the corrections obey ``u_i = β_i (v_i − k̃_i S0) − Σ_{j<i} A_ij u_j``
    with ``A_ij = β_i Σ_c k_i k_j Π_{j<s<=i} α_s`` (strictly lower). So
    ``(I + A) Ũ = β V − (β K ⊙ e^G) S0``, and with ``T = (I + A)⁻¹``:
    ``U = T(β ⊙ V)``, ``W = T(β ⊙ K ⊙ e^G)``, ``Ũ = U − W S0``.

    Args:
      kk: decayed key overlaps ``[..., C, C]`` (:func:`decayed_scores` of ``k`` with itself).
      k, v: ``[..., C, K]``, ``[..., C, V]``; beta: ``[..., C]``.
      decay_in: ``e^{G_t}`` from the chunk start (0 past a reset), broadcastable to ``k``.
      same_doc: optional ``[..., C, C]`` mask of token pairs in one document.
    Returns:
      ``(U [..., C, V], W [..., C, K])``.
    """
    C = k.shape[-2]
    A = jnp.where(~jnp.eye(C, dtype=bool), kk, 0.0) * beta[..., :, None]
    if same_doc is not None:
        A = A * same_doc
    rhs = jnp.concatenate([beta[..., None] * v, beta[..., None] * k * decay_in], axis=-1)
    sol = _einsum("...ij,...jd->...id", unit_lower_inverse(A), rhs)
    return sol[..., : v.shape[-1]], sol[..., v.shape[-1]:]


def unit_lower_inverse(A: Array) -> Array:
    """``T = (I + A)⁻¹`` for strictly lower triangular ``A [..., C, C]``, by matmuls alone.

    Block inversion, bottom-up: with ``L = [[L11, 0], [L21, L22]]``,
    ``L⁻¹ = [[L11⁻¹, 0], [−L22⁻¹ L21 L11⁻¹, L22⁻¹]]``. Starting from 1×1 blocks (whose
    inverse is 1) each level doubles the block size, so ``log2 C`` levels of batched
    matmuls build ``T`` — no triangular-solve lowering (absent on TPU; and jaxlib's CPU
    batched ``trsm`` can deadlock when two run at once on a small thread pool).
    ``C`` that is not a power of two is padded with identity rows.
    """
    C = A.shape[-1]
    n = 1 << max(C - 1, 0).bit_length()
    lead = A.shape[:-2]
    if n != C:
        A = jnp.pad(A, [(0, 0)] * len(lead) + [(0, n - C), (0, n - C)])
    T = jnp.ones((*lead, n, 1, 1), A.dtype)  # n diagonal blocks of size 1
    s = 1
    while s < n:
        m = n // (2 * s)  # blocks of size 2s
        blocks = A.reshape(*lead, m, 2 * s, m, 2 * s)
        diag = jnp.diagonal(blocks, axis1=-4, axis2=-2)  # [..., 2s, 2s, m]
        L21 = jnp.moveaxis(diag, -1, -3)[..., s:, :s]  # [..., m, s, s]
        T11, T22 = T.reshape(*lead, m, 2, s, s)[..., 0, :, :], T.reshape(*lead, m, 2, s, s)[..., 1, :, :]
        T21 = -_einsum("...ij,...jk,...kl->...il", T22, L21, T11)
        top = jnp.concatenate([T11, jnp.zeros_like(T11)], axis=-1)
        bottom = jnp.concatenate([T21, T22], axis=-1)
        T = jnp.concatenate([top, bottom], axis=-2)  # [..., m, 2s, 2s]
        s *= 2
    # T is [..., 1, n, n]: one block covering the padded chunk.
    return T.reshape(*lead, n, n)[..., :C, :C]


def chunked(x: RuleInputs, state: Array, *, erase: bool, chunk_size: int) -> tuple[Array, Array]:
    """The rule in WY/UT chunked form. Same inputs and results as :func:`recurrent`.

    Per chunk (docs/design.md): ``A`` strictly lower with decayed key overlaps,
    ``T = (I + A)⁻¹`` by triangular solve, ``W = T(β ⊙ K ⊙ e^G)``, ``U = T(β ⊙ V)``;
    then, sequentially over chunks, ``Ũ = U − W S``, ``O = (Q ⊙ e^G) S + M Ũ``,
    ``S ← Diag(e^{G_C}) S + (K ⊙ e^{G_C − G})ᵀ Ũ``. Everything that does not
    depend on the carried state is computed for all chunks at once.
    """
    B, T, H, K = x.q.shape
    V = x.v.shape[-1]
    C = chunk_size
    n = -(-T // C)
    pad = n * C - T
    dtype = state.dtype

    # Padding tokens write nothing (k = 0, β = 0) and decay nothing (g = 0).
    q, k, v, g, beta = (_to_chunks(_pad_time(a, pad), n, C) for a in (x.q, x.k, x.v, x.g, x.beta))
    G = None if g is None else prefix_sum(g, axis=-2)  # [B, H, N, C, Kg]

    # Segment resets inside a chunk: doc index relative to the chunk's incoming state.
    if x.reset is None:
        sees_state = jnp.ones((B, 1, n, C), dtype=bool)
        same_doc = None
    else:
        reset = _pad_time(x.reset, pad, False).reshape(B, 1, n, C)
        doc = prefix_sum(reset.astype(jnp.int32), axis=-1)
        sees_state = doc == 0  # no reset between the chunk start and this token
        same_doc = doc[..., :, None] == doc[..., None, :]  # [B, 1, N, C, C]
        last_doc = doc[..., -1:]

    # exp(G_t) from the chunk start, zero past a reset: the weight of the incoming state.
    if G is None:
        decay_in = sees_state[..., None].astype(dtype)  # [B, 1|H, N, C, 1]
    else:
        decay_in = jnp.exp(G) * sees_state[..., None]
    # Weight of each token's write in the outgoing state: exp(G_C − G_j), same doc as the end.
    if G is None:
        decay_out = jnp.ones((1, 1, 1, 1, 1), dtype)
        decay_end = jnp.ones((1, 1, 1, 1), dtype)
    else:
        # G_C − G_j as the sum of the gates after j (exactly 0, with no gradient path, at j = C).
        after = prefix_sum(g, axis=-2, reverse=True)
        after = jnp.concatenate([after[..., 1:, :], jnp.zeros_like(after[..., :1, :])], axis=-2)
        decay_out = jnp.exp(after)
        decay_end = jnp.exp(G[..., -1, :])  # [B, H, N, Kg]
    decay_end = decay_end * sees_state[..., -1, None]
    if same_doc is not None:
        decay_out = decay_out * (doc == last_doc)[..., None]

    if erase:
        M, KK = decayed_scores((q, k), k, g)
        U, W = ut_transform(KK, k, v, beta, decay_in, same_doc)
    else:
        (M,) = decayed_scores((q,), k, g)
        U = v if beta is None else beta[..., None] * v
        W = None
    if same_doc is not None:
        M = M * same_doc

    q_in = q * decay_in
    k_out = k * decay_out

    def time_major(a):
        return None if a is None else jnp.moveaxis(a, 2, 0)  # chunk axis first

    xs = tuple(time_major(a) for a in (q_in, k_out, M, U, W))
    decay_end = jnp.broadcast_to(decay_end, (B, H, n, decay_end.shape[-1]))
    xs = xs + (jnp.moveaxis(decay_end, 2, 0),)

    def body(S, xc):
        q_c, k_c, M_c, U_c, W_c, d_c = xc
        if W_c is not None:
            U_c = U_c - _einsum("bhck,bhkv->bhcv", W_c, S)  # the true corrections
        o_c = _einsum("bhck,bhkv->bhcv", q_c, S) + _einsum("bhij,bhjv->bhiv", M_c, U_c)
        S = d_c[..., :, None] * S + _einsum("bhck,bhcv->bhkv", k_c, U_c)
        return S, o_c

    state, o = lax.scan(body, state, xs)  # o: [N, B, H, C, V]
    o = jnp.moveaxis(o, 0, 2).reshape(B, H, n * C, V)[:, :, :T]
    return jnp.moveaxis(o, 1, 2), state
