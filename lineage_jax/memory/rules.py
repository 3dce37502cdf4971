"""Public fixed-state memories: linear attention, DeltaNet, Gated DeltaNet, KDA.

Each public function is the same rule (:mod:`lineage_jax.memory.core`) with one
edit — which gate, whether to erase — plus argument checks; :func:`update_rule` takes those
switches as arguments (every setting, named or not, e.g. GLA). Conventions
(docs/design.md):

* sequences ``[B, T, H, D]``; state ``[B, H, K, V]`` in float32 (float64 for float64 inputs under x64);
* ``q`` is multiplied by ``scale`` (default ``K ** -0.5``) before use;
* gates are natural-log decays ``g <= 0``: ``[B, T, H]`` (one scalar per head,
  Gated DeltaNet) or ``[B, T, H, K]`` (per channel, KDA);
* ``segment_ids [B, T]`` zero the state wherever the id changes (packed documents);
  ``initial_state`` feeds the first segment of each row;
* ``mode="recurrent"`` is a ``lax.scan`` over tokens, ``mode="chunked"`` the WY/UT
  form with a ``lax.scan`` over chunks of ``chunk_size`` (any ``T``: padded inside).

Outputs come back in the inputs' dtype; all arithmetic is float32 or wider.
"""

from __future__ import annotations

from typing import Any, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np

from lineage_jax.memory import _validate as V
from lineage_jax.memory import core
from lineage_jax.memory.options import MemoryOptions
from lineage_jax.memory.options import resolve as resolve_options
from lineage_jax.memory.segments import segment_starts
from lineage_jax.numerics import matmul_precision

Array = jax.Array
LinearState = Union[Array, tuple[Array, Array]]

_GATE_NONE, _GATE_SCALAR, _GATE_CHANNEL = "none", "scalar", "channel"


def _compute_dtype(*arrays: Any) -> jnp.dtype:
    return jnp.result_type(jnp.float32, *[a.dtype for a in arrays if a is not None])


def _check_sequence(fn, q, k, v, g, beta, gate, initial_state, segment_ids, mode, chunk_size, value_cols=0, *,
                    erase=True, gate_lower_bound=None, lead="q"):
    """Validate a sequence call (``beta`` required when the rule erases; ``gate_lower_bound``: the
    per-channel gate's promised bound, checked on concrete gates; ``lead``: the name of the argument the
    shapes are read from, ``"k"`` where there is no ``q``). Returns ``(B, T, H, K, Vd)``."""
    V.check_mode(fn, mode)
    if chunk_size is not None:  # None: the backend's own chunk
        V.check_chunk_size(fn, chunk_size)
    V.require_rank(fn, lead, q, 4, "[B,T,H,K]")
    B, T, H, K = V.shape_of(q)
    if T == 0:
        raise ValueError(f"{fn}: `{lead}` has T = 0 tokens; need at least one")
    if lead != "k":
        V.require_shape(fn, "k", k, (B, T, H, K), f"[B,T,H,K] (same as {lead})")
    V.require_rank(fn, "v", v, 4, "[B,T,H,V]")
    if V.shape_of(v)[:3] != (B, T, H):
        raise ValueError(f"{fn}: `v` must have shape [B,T,H,V] with B,T,H = {(B, T, H)} as in {lead}, "
                         f"got {V.shape_of(v)}")
    Vd = V.shape_of(v)[3]
    for name, a in [(lead, q)] + ([("k", k)] if lead != "k" else []) + [("v", v)]:
        V.require_float(fn, name, a)
    if gate == _GATE_SCALAR:
        V.require_shape(fn, "g", g, (B, T, H), "[B,T,H]")
    elif gate == _GATE_CHANNEL:
        V.require_shape(fn, "g", g, (B, T, H, K), "[B,T,H,K]")
    if g is not None:
        V.require_float(fn, "g", g)
        V.check_log_decay(fn, "g", g, lower_bound=gate_lower_bound)
    if erase or beta is not None:
        V.require_shape(fn, "beta", beta, (B, T, H), "[B,T,H]")
        V.require_float(fn, "beta", beta)
        V.check_finite(fn, "beta", beta)
    V.check_segment_ids(fn, segment_ids, B, T)
    return B, T, H, K, Vd


DELTA_RESIDUALS = "delta_rule_residuals"  # = kernels.delta.RESIDUALS (memory/ imports kernels/ lazily)
XLA_CHUNK = 64  # the XLA chunked form's chunk when ``chunk_size`` is None


def _rule_inputs(q, k, v, g, beta, *, gate, scale, dt, reset=None) -> core.RuleInputs:
    """The core's inputs in the compute dtype: ``q`` scaled, a per-head gate broadcast over keys
    (sequences ``[B, T, H, D]`` and one-token steps ``[B, H, D]`` alike)."""
    return core.RuleInputs(
        q=q.astype(dt) * scale,
        k=k.astype(dt),
        v=v.astype(dt),
        g=None if g is None else (g.astype(dt)[..., None] if gate == _GATE_SCALAR else g.astype(dt)),
        beta=None if beta is None else beta.astype(dt),
        reset=reset,
    )


def _run_pallas(q, k, v, g, beta, *, gate, scale, initial_state, segment_ids, dt, opts: MemoryOptions):
    from lineage_jax._kernels import chunk_delta_rule, chunk_gated_delta_rule, chunk_kda  # memory/ -> kernels/
    from lineage_jax.parallel.rules import per_device  # imports models/, which import memory/

    def kernels(q, k, v, g, beta, initial_state, segment_ids):
        # chunk_size None: the kernels' own chunk for the target (tile-tuned); an explicit one is used.
        kw = dict(scale=scale, initial_state=initial_state, segment_ids=segment_ids, chunk_size=opts.chunk_size)
        if gate == _GATE_NONE:
            return chunk_delta_rule(q, k, v, beta, **kw)
        if gate == _GATE_SCALAR:
            return chunk_gated_delta_rule(q, k, v, g, beta, **kw)
        return chunk_kda(q, k, v, g, beta, gate_lower_bound=opts.gate_lower_bound, **kw)

    # Under a sharded layout every device runs the kernels on its own sequences and heads (whole sequences:
    # the state runs along them); a kernel is a custom call XLA cannot partition.
    seq4, seq3 = ("batch", None, "heads", None), ("batch", None, "heads")
    o, S = per_device(kernels, (q, k, v, g, beta, initial_state, segment_ids),
                      (seq4, seq4, seq4, None if g is None else seq4[:g.ndim], seq3, ("batch", "heads", None, None),
                       ("batch", None)),
                      (seq4, ("batch", "heads", None, None)), what=f"{gate} delta rule kernels")
    return o.astype(jnp.result_type(q, k, v)), S.astype(dt)


def _run(fn, q, k, v, g, beta, *, gate, erase, scale, initial_state, segment_ids, mode, chunk_size=None, cast=True,
         backend=None, gate_lower_bound=None, options=None):
    opts = resolve_options(fn, options, backend=backend, chunk_size=chunk_size, gate_lower_bound=gate_lower_bound)
    B, T, H, K, Vd = _check_sequence(fn, q, k, v, g, beta, gate, initial_state, segment_ids, mode, None, erase=erase,
                                     gate_lower_bound=opts.gate_lower_bound if gate == _GATE_CHANNEL else None)
    if initial_state is not None:
        _single_state(fn, "initial_state", initial_state)
        V.require_shape(fn, "initial_state", initial_state, (B, H, K, Vd), "[B,H,K,V]")
        V.require_float(fn, "initial_state", initial_state)
        V.check_finite(fn, "initial_state", initial_state)
    scale = V.resolve_scale(fn, scale, K)
    dt = _compute_dtype(q, k, v, g, beta)
    out_dtype = jnp.result_type(q, k, v)
    if erase and opts.use_pallas(fn, mode, dt):
        return _run_pallas(q, k, v, g, beta, gate=gate, scale=scale, initial_state=initial_state,
                           segment_ids=segment_ids, dt=dt, opts=opts)
    with matmul_precision(opts.precision):
        x = _rule_inputs(q, k, v, g, beta, gate=gate, scale=scale, dt=dt,
                         reset=None if segment_ids is None else segment_starts(segment_ids))
        S0 = jnp.zeros((B, H, K, Vd), dt) if initial_state is None else initial_state.astype(dt)
        if mode == "recurrent":
            o, S = core.recurrent(x, S0, erase=erase)
        else:
            o, S = core.chunked(x, S0, erase=erase, chunk_size=opts.chunk_size or XLA_CHUNK)
    return (o.astype(out_dtype) if cast else o), S


# ----------------------------------------------------------------------------
# Sequence functions.
# ----------------------------------------------------------------------------
def linear_attention(
    q: Array,
    k: Array,
    v: Array,
    *,
    normalize: bool = False,
    eps: float = 1e-6,
    scale: Optional[float] = None,
    initial_state: Optional[LinearState] = None,
    segment_ids: Optional[Array] = None,
    mode: str = "chunked",
    chunk_size: Optional[int] = None,
) -> tuple[Array, LinearState]:
    """Causal linear attention: ``S_t = S_{t-1} + k_tᵀ v_t``, ``o_t = q_t S_t``.

    Feature maps (e.g. ``elu + 1``) are the caller's: ``q`` and ``k`` are used as
    given. With ``normalize=True`` the state is ``(S, z)`` with ``z_t = Σ k``
    (``[B, H, K]``) and ``o_t = (q_t S_t) / (q_t · z_t + eps)``.

    Args:
      q, k: ``[B, T, H, K]``; v: ``[B, T, H, V]``.
      initial_state: ``S [B, H, K, V]``, or ``(S, z)`` when ``normalize``.
    Returns:
      ``(o [B, T, H, V], state)`` with the final state (``S`` or ``(S, z)``).
    """
    fn = "linear_attention"
    _check_normalize(fn, normalize, eps)
    if not normalize:
        return _run(fn, q, k, v, None, None, gate=_GATE_NONE, erase=False, scale=scale,
                    initial_state=_plain_state(fn, initial_state), segment_ids=segment_ids,
                    mode=mode, chunk_size=chunk_size)
    B, T, H, K, Vd = _check_sequence(fn, q, k, v, None, None, _GATE_NONE, initial_state, segment_ids, mode, chunk_size,
                                     erase=False)
    S0 = _augmented_state(fn, initial_state, (B, H, K, Vd), _compute_dtype(q, k, v))
    # The normalizer is one more value column: z is the state's column for v = 1.
    v_aug = jnp.concatenate([v, jnp.ones((*v.shape[:-1], 1), v.dtype)], axis=-1)
    o_aug, S_aug = _run(fn, q, k, v_aug, None, None, gate=_GATE_NONE, erase=False, scale=scale,
                        initial_state=S0, segment_ids=segment_ids, mode=mode, chunk_size=chunk_size, cast=False)
    o = _normalized_read(o_aug, eps).astype(jnp.result_type(q, k, v))
    return o, (S_aug[..., :-1], S_aug[..., -1])


def delta_rule(
    q: Array,
    k: Array,
    v: Array,
    beta: Array,
    *,
    scale: Optional[float] = None,
    initial_state: Optional[Array] = None,
    segment_ids: Optional[Array] = None,
    mode: str = "chunked",
    chunk_size: Optional[int] = None,
    backend: Optional[str] = None,
    options: Optional[MemoryOptions] = None,
) -> tuple[Array, Array]:
    """DeltaNet: ``S_t = (I − β_t k_tᵀk_t) S_{t-1} + β_t k_tᵀ v_t``, ``o_t = q_t S_t``.

    Args:
      q, k: ``[B, T, H, K]`` (keys should be L2-normalized); v: ``[B, T, H, V]``;
      beta: ``[B, T, H]`` write strengths (typically in ``(0, 1)``).
      chunk_size: tokens per chunk of the chunked form; ``None`` (default) is each backend's
        own (64 for XLA, the kernels' tile-tuned chunk for Pallas). An explicit size is used
        by either backend (the kernels need a power of two >= 16 and say so otherwise).
      backend: ``"xla"`` (the default: :mod:`.core`), ``"pallas"`` (the :mod:`kernels.delta`
        kernels, chunked mode only; interpret mode on the CPU) or ``"auto"`` (Pallas on GPU/TPU
        for chunked calls computing in float32 — every input dtype but float64 — else XLA). The
        kernels take 16-bit q, k, v into their matmuls as they are (float32 accumulation, a
        float32 state) and float32 ones float32-accurately; ``MemoryOptions.precision`` is the XLA
        form's.
      options: a :class:`~lineage_jax.memory.MemoryOptions` (backend, chunk size, KDA's gate
        bound, matmul precision) instead of ``backend`` / ``chunk_size`` (not both).
    Returns:
      ``(o [B, T, H, V], S [B, H, K, V])``.
    """
    return _run("delta_rule", q, k, v, None, beta, gate=_GATE_NONE, erase=True, scale=scale,
                initial_state=initial_state, segment_ids=segment_ids, mode=mode, chunk_size=chunk_size, backend=backend,
                options=options)


def gated_delta_rule(
    q: Array,
    k: Array,
    v: Array,
    g: Array,
    beta: Array,
    *,
    scale: Optional[float] = None,
    initial_state: Optional[Array] = None,
    segment_ids: Optional[Array] = None,
    mode: str = "chunked",
    chunk_size: Optional[int] = None,
    backend: Optional[str] = None,
    options: Optional[MemoryOptions] = None,
) -> tuple[Array, Array]:
    """Gated DeltaNet: ``S_t = α_t (I − β_t k_tᵀk_t) S_{t-1} + β_t k_tᵀ v_t``, ``α_t = exp(g_t)``.

    Args:
      g: ``[B, T, H]`` log-decay, ``<= 0`` (one scalar per head and token).
      Others as :func:`delta_rule`.
    """
    return _run("gated_delta_rule", q, k, v, g, beta, gate=_GATE_SCALAR, erase=True, scale=scale,
                initial_state=initial_state, segment_ids=segment_ids, mode=mode, chunk_size=chunk_size, backend=backend,
                options=options)


def kda(
    q: Array,
    k: Array,
    v: Array,
    g: Array,
    beta: Array,
    *,
    scale: Optional[float] = None,
    initial_state: Optional[Array] = None,
    segment_ids: Optional[Array] = None,
    mode: str = "chunked",
    chunk_size: Optional[int] = None,
    backend: Optional[str] = None,
    gate_lower_bound: Optional[float] = None,
    options: Optional[MemoryOptions] = None,
) -> tuple[Array, Array]:
    """Kimi Delta Attention: ``S_t = (I − β_t k_tᵀk_t) Diag(α_t) S_{t-1} + β_t k_tᵀ v_t``.

    Decay first (per key channel, ``α_t = exp(g_t)``), then erase and write.

    Args:
      g: ``[B, T, H, K]`` per-channel log-decay, ``<= 0``.
      gate_lower_bound: a promise that ``g >= gate_lower_bound`` everywhere (K3's bounded gate
        ``g = −5·σ(·)`` gives ``-5.0``), in ``[-8, 0)``. The Pallas kernels then use the anchored
        bounded-gate form on every diagonal tile (one matmul instead of a 16-step loop; without
        the promise, GPU kernels choose it per tile where the gates allow); the XLA form is
        exact either way and ignores it. Concrete gates below the bound are refused.
      Others as :func:`delta_rule`.
    """
    return _run("kda", q, k, v, g, beta, gate=_GATE_CHANNEL, erase=True, scale=scale,
                initial_state=initial_state, segment_ids=segment_ids, mode=mode, chunk_size=chunk_size, backend=backend,
                gate_lower_bound=gate_lower_bound, options=options)


# ----------------------------------------------------------------------------
# Decode steps: one token, ``[B, H, D]``.
# ----------------------------------------------------------------------------
def _check_step_tokens(fn, q_t, k_t, v_t):
    """Validate one token's ``q_t, k_t [B, H, K]`` and ``v_t [B, H, V]``. Returns ``(B, H, K, Vd)``."""
    V.require_rank(fn, "q_t", q_t, 3, "[B,H,K]")
    B, H, K = V.shape_of(q_t)
    V.require_shape(fn, "k_t", k_t, (B, H, K), "[B,H,K] (same as q_t)")
    V.require_rank(fn, "v_t", v_t, 3, "[B,H,V]")
    if V.shape_of(v_t)[:2] != (B, H):
        raise ValueError(f"{fn}: `v_t` must have shape [B,H,V] with B,H = {(B, H)}, got {V.shape_of(v_t)}")
    for name, a in (("q_t", q_t), ("k_t", k_t), ("v_t", v_t)):
        V.require_float(fn, name, a)
    return B, H, K, V.shape_of(v_t)[2]


def _step(fn, q_t, k_t, v_t, g_t, beta_t, state, *, gate, erase, scale, cast=True):
    B, H, K, Vd = _check_step_tokens(fn, q_t, k_t, v_t)
    if gate == _GATE_SCALAR:
        V.require_shape(fn, "g_t", g_t, (B, H), "[B,H]")
    elif gate == _GATE_CHANNEL:
        V.require_shape(fn, "g_t", g_t, (B, H, K), "[B,H,K]")
    if g_t is not None:
        V.require_float(fn, "g_t", g_t)
        V.check_log_decay(fn, "g_t", g_t)
    if erase or beta_t is not None:
        V.require_shape(fn, "beta_t", beta_t, (B, H), "[B,H]")
        V.require_float(fn, "beta_t", beta_t)
        V.check_finite(fn, "beta_t", beta_t)
    dt = _compute_dtype(q_t, k_t, v_t, g_t, beta_t)
    if state is None:
        state = jnp.zeros((B, H, K, Vd), dt)
    _single_state(fn, "state", state)
    # shape only: reading the state's values back every decode step would stall an eager loop
    V.require_shape(fn, "state", state, (B, H, K, Vd), "[B,H,K,V]")
    scale = V.resolve_scale(fn, scale, K)
    x = _rule_inputs(q_t, k_t, v_t, g_t, beta_t, gate=gate, scale=scale, dt=dt)
    o, S = core.step(state.astype(dt), x, erase=erase)
    return (o.astype(jnp.result_type(q_t, k_t, v_t)) if cast else o), S


def linear_attention_step(
    q_t: Array,
    k_t: Array,
    v_t: Array,
    state: Optional[LinearState],
    *,
    scale: Optional[float] = None,
    normalize: Optional[bool] = None,
    eps: float = 1e-6,
) -> tuple[Array, LinearState]:
    """One token of :func:`linear_attention`. ``state`` is ``S`` or ``(S, z)``;
    ``normalize`` defaults to whether ``state`` is a pair (``None`` state: no normalizer)."""
    fn = "linear_attention_step"
    paired = isinstance(state, (tuple, list))
    if normalize is None:
        normalize = paired
    _check_normalize(fn, normalize, eps)
    if not normalize:
        if paired:
            raise ValueError(f"{fn}: `state` is an (S, z) pair but `normalize=False`")
        return _step(fn, q_t, k_t, v_t, None, None, state, gate=_GATE_NONE, erase=False, scale=scale)
    B, H, K, Vd = _check_step_tokens(fn, q_t, k_t, v_t)
    S0 = _augmented_state(fn, state, (B, H, K, Vd), _compute_dtype(q_t, k_t, v_t), name="state")
    v_aug = jnp.concatenate([v_t, jnp.ones((*v_t.shape[:-1], 1), v_t.dtype)], axis=-1)
    o_aug, S_aug = _step(fn, q_t, k_t, v_aug, None, None, S0, gate=_GATE_NONE, erase=False, scale=scale, cast=False)
    o = _normalized_read(o_aug, eps).astype(jnp.result_type(q_t, k_t, v_t))
    return o, (S_aug[..., :-1], S_aug[..., -1])


def delta_rule_step(q_t, k_t, v_t, beta_t, state, *, scale=None) -> tuple[Array, Array]:
    """One token of :func:`delta_rule`: ``[B, H, D]`` inputs, ``beta_t [B, H]``."""
    return _step("delta_rule_step", q_t, k_t, v_t, None, beta_t, state, gate=_GATE_NONE, erase=True, scale=scale)


def gated_delta_rule_step(q_t, k_t, v_t, g_t, beta_t, state, *, scale=None) -> tuple[Array, Array]:
    """One token of :func:`gated_delta_rule`: ``g_t, beta_t [B, H]``."""
    return _step("gated_delta_rule_step", q_t, k_t, v_t, g_t, beta_t, state, gate=_GATE_SCALAR, erase=True, scale=scale)


def kda_step(q_t, k_t, v_t, g_t, beta_t, state, *, scale=None) -> tuple[Array, Array]:
    """One token of :func:`kda`: ``g_t [B, H, K]``, ``beta_t [B, H]``."""
    return _step("kda_step", q_t, k_t, v_t, g_t, beta_t, state, gate=_GATE_CHANNEL, erase=True, scale=scale)


# ----------------------------------------------------------------------------
# The update equation with its switches given directly.
# ----------------------------------------------------------------------------
GATES = (_GATE_NONE, _GATE_SCALAR, _GATE_CHANNEL)


def _switches(fn: str, gate: Any, erase: Any, g: Any, beta: Any, g_name: str, beta_name: str) -> bool:
    if gate not in GATES:
        raise ValueError(f"{fn}: `gate` must be one of {GATES}, got {gate!r}")
    erase = V.require_bool(fn, "erase", erase)
    if (g is None) != (gate == _GATE_NONE):
        raise ValueError(f"{fn}: `{g_name}` is given where `gate` is 'none', or missing for gate={gate!r}"
                         if g is not None else f"{fn}: gate={gate!r} needs `{g_name}`")
    if erase and beta is None:
        raise ValueError(f"{fn}: `erase=True` needs `{beta_name}` (the write strength)")
    return erase


def update_rule(q: Array, k: Array, v: Array, *, g: Optional[Array] = None, beta: Optional[Array] = None,
                gate: str = "none", erase: bool = False, scale: Optional[float] = None,
                initial_state: Optional[Array] = None, segment_ids: Optional[Array] = None, mode: str = "chunked",
                chunk_size: Optional[int] = None, backend: Optional[str] = None,
                options: Optional[MemoryOptions] = None) -> tuple[Array, Array]:
    """``S_t = Diag(α_t) S_{t-1} + k_tᵀ β_t (v_t − e · k_t Diag(α_t) S_{t-1})``, ``o_t = q_t S_t``, with the
    equation's switches as arguments: ``gate`` (``"none"``: α = 1; ``"scalar"``: ``g [B, T, H]``, one log-decay
    per head; ``"channel"``: ``g [B, T, H, K]``, one per key channel), ``erase`` (e = 1 or 0) and ``beta``
    (``[B, T, H]``; None: 1, without erasing only). The named rules are settings of it: DeltaNet is
    ``erase=True``, Gated DeltaNet adds ``gate="scalar"``, KDA ``gate="channel"``; unnormalized linear attention
    is the default; ``gate="channel", erase=False`` is GLA (gated linear attention), a rule the library does
    not name. Every mode, chunk size and backend of the named rules applies (the Pallas kernels run the erasing
    rules; the others run XLA's form).

    Returns:
      ``(o [B, T, H, V], S [B, H, K, V])``.
    """
    fn = "update_rule"
    _switches(fn, gate, erase, g, beta, "g", "beta")
    return _run(fn, q, k, v, g, beta, gate=gate, erase=bool(erase), scale=scale, initial_state=initial_state,
                segment_ids=segment_ids, mode=mode, chunk_size=chunk_size, backend=backend, options=options)


def update_rule_step(q_t: Array, k_t: Array, v_t: Array, state: Optional[Array], *, g_t: Optional[Array] = None,
                     beta_t: Optional[Array] = None, gate: str = "none", erase: bool = False,
                     scale: Optional[float] = None) -> tuple[Array, Array]:
    """One token of :func:`update_rule`: ``q_t, k_t [B, H, K]``, ``v_t [B, H, V]``, ``g_t`` ``[B, H]`` (scalar)
    or ``[B, H, K]`` (channel), ``beta_t [B, H]``; ``state`` ``[B, H, K, V]`` (None: zeros)."""
    fn = "update_rule_step"
    _switches(fn, gate, erase, g_t, beta_t, "g_t", "beta_t")
    return _step(fn, q_t, k_t, v_t, g_t, beta_t, state, gate=gate, erase=bool(erase), scale=scale)


# ----------------------------------------------------------------------------
# Linear-attention state helpers.
# ----------------------------------------------------------------------------
def _check_normalize(fn: str, normalize: Any, eps: Any = 0.0) -> None:
    """``normalize`` is a bool; ``eps`` (the normalizer's floor) a finite number >= 0."""
    if not isinstance(normalize, (bool, jnp.bool_)):
        raise ValueError(f"{fn}: `normalize` must be a bool, got {normalize!r}")
    if isinstance(eps, bool) or not isinstance(eps, (int, float, np.number)) or not np.isfinite(eps) or eps < 0:
        raise ValueError(f"{fn}: `eps` must be a finite number >= 0, got {eps!r}")


def _single_state(fn: str, name: str, state: Any) -> None:
    """The delta rules' (and unnormalized linear attention's) state is one array ``S``."""
    if isinstance(state, (tuple, list)):
        raise ValueError(f"{fn}: `{name}` must be one array S [B,H,K,V], got a {type(state).__name__} "
                         "(an (S, z) pair is the state of normalized linear attention)")


def _plain_state(fn: str, state: Any) -> Any:
    if isinstance(state, (tuple, list)):
        raise ValueError(f"{fn}: `initial_state` is an (S, z) pair but `normalize=False`; pass S alone")
    return state


def _augmented_state(fn, state, shape, dtype, name="initial_state"):
    """``(S, z)`` -> ``[B, H, K, V + 1]`` with ``z`` as the last value column."""
    B, H, K, Vd = shape
    if state is None:
        return jnp.zeros((B, H, K, Vd + 1), dtype)
    if not isinstance(state, (tuple, list)) or len(state) != 2:
        raise ValueError(f"{fn}: with `normalize=True`, `{name}` must be a pair (S [B,H,K,V], z [B,H,K])")
    S, z = state
    V.require_shape(fn, f"{name}[0] (S)", S, (B, H, K, Vd), "[B,H,K,V]")
    V.require_shape(fn, f"{name}[1] (z)", z, (B, H, K), "[B,H,K]")
    V.require_float(fn, f"{name}[0] (S)", S)
    V.require_float(fn, f"{name}[1] (z)", z)
    dt = jnp.result_type(dtype, S, z)
    return jnp.concatenate([S.astype(dt), z.astype(dt)[..., None]], axis=-1)


def _normalized_read(o_aug: Array, eps: float) -> Array:
    num, den = o_aug[..., :-1], o_aug[..., -1:]
    return num / (den + eps)


# ----------------------------------------------------------------------------
# The chunk solve, exposed.
# ----------------------------------------------------------------------------
def delta_corrections(
    k: Array,
    v: Array,
    beta: Array,
    *,
    g: Optional[Array] = None,
    initial_state: Optional[Array] = None,
) -> Array:
    """The WY/UT triangular solve over one chunk: every correction at once.

    Returns ``u_t = β_t (v_t − k_t Diag(α_t) S_{t-1})`` for all ``t`` — the deltas the
    sequential rule writes (``S_t = Diag(α_t) S_{t-1} + k_tᵀ u_t``) — computed as
    ``Ũ = T(β V) − T(β K ⊙ e^G) S0`` with ``T = (I + A)⁻¹``, no token loop. The whole
    sequence is one chunk, so keep ``T`` small (it is a ``T × T`` solve).

    Args:
      k: ``[B, T, H, K]``; v: ``[B, T, H, V]``; beta: ``[B, T, H]``.
      g: optional log-decay ``[B, T, H]`` (scalar) or ``[B, T, H, K]`` (per channel); keyword-only, since the
        rules take ``(q, k, v, g, beta)`` and a positional ``g`` here would be read in ``beta``'s place.
      initial_state: ``S0 [B, H, K, V]`` (default zeros).
    Returns:
      ``u [B, T, H, V]``.
    """
    fn = "delta_corrections"
    V.require_rank(fn, "k", k, 4, "[B,T,H,K]")
    B, T, H, K = V.shape_of(k)
    gate = _GATE_NONE if g is None else (_GATE_SCALAR if np.ndim(g) == 3 else _GATE_CHANNEL)
    _, _, _, _, Vd = _check_sequence(fn, k, k, v, g, beta, gate, None, None, "chunked", None, lead="k")
    dt = _compute_dtype(k, v, g, beta)
    to_bh = lambda a: None if a is None else jnp.moveaxis(jnp.asarray(a).astype(dt), 2, 1)  # [B,H,T,...]
    kk_, v_, beta_ = to_bh(k), to_bh(v), to_bh(beta)
    g_ = None if g is None else to_bh(g if gate == _GATE_CHANNEL else jnp.asarray(g)[..., None])
    decay_in = jnp.ones((1, 1, 1, 1), dt) if g_ is None else jnp.exp(core.prefix_sum(g_, axis=-2))
    (overlaps,) = core.decayed_scores((kk_,), kk_, g_)
    U, W = core.ut_transform(overlaps, kk_, v_, beta_, decay_in)
    if initial_state is not None:
        V.require_shape(fn, "initial_state", initial_state, (B, H, K, Vd), "[B,H,K,V]")
        V.require_float(fn, "initial_state", initial_state)
        V.check_finite(fn, "initial_state", initial_state)
        U = U - jnp.einsum("bhtk,bhkv->bhtv", W, initial_state.astype(dt))
    return jnp.moveaxis(U, 1, 2)
