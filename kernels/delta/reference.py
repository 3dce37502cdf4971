"""The token-by-token reference of the kernels' rule, in plain ``jax.numpy`` (no Pallas, nothing
from ``lineage_jax``): what :mod:`kernels.delta`'s tests compare the kernels against.

Row-vector convention, state ``S [K, V]`` per (batch, head)::

    S_t = Diag(α_t) S_{t-1} + k_tᵀ u_t,   u_t = β_t (v_t − k_t Diag(α_t) S_{t-1}),   o_t = scale · q_t S_t

with ``α_t = exp(g_t)`` — ``g`` absent (DeltaNet), one scalar per head (Gated DeltaNet,
``g [B, T, H]``) or one per key channel (KDA, ``g [B, T, H, K]``). Where ``segment_ids`` changes
between ``t − 1`` and ``t``, ``S_{t-1}`` is zero (a new document). All arithmetic is float32
with float32 products (``Precision.HIGHEST``), as a ``lax.scan`` over tokens.
"""

from __future__ import annotations

from typing import Optional

import jax.numpy as jnp
from jax import lax

_HI = lax.Precision.HIGHEST


def recurrent(q, k, v, beta, g=None, *, scale: Optional[float] = None, initial_state=None, segment_ids=None):
    """``(o [B, T, H, V] float32, S [B, H, K, V] float32)`` of the rule above, token by token.

    Args:
      q, k: ``[B, T, H, K]``; v: ``[B, T, H, V]``; beta: ``[B, T, H]``.
      g: ``None``, ``[B, T, H]`` (per head) or ``[B, T, H, K]`` (per key channel) log-decays.
      scale: the read's scale (default ``K ** -0.5``).
      initial_state: ``[B, H, K, V]`` (default zeros).
      segment_ids: ``[B, T]`` document ids; the state resets where they change.
    """
    f32 = jnp.float32
    q, k, v, beta = (jnp.asarray(a, f32) for a in (q, k, v, beta))
    B, T, H, K = q.shape
    V = v.shape[-1]
    scale = K ** -0.5 if scale is None else scale
    if g is None:
        g = jnp.zeros((B, T, H, 1), f32)
    else:
        g = jnp.asarray(g, f32)
        g = g[..., None] if g.ndim == 3 else g
    S0 = jnp.zeros((B, H, K, V), f32) if initial_state is None else jnp.asarray(initial_state, f32)
    if segment_ids is None:
        keep = jnp.ones((B, T), f32)
    else:
        seg = jnp.asarray(segment_ids)
        keep = jnp.concatenate([jnp.ones((B, 1), f32), (seg[:, 1:] == seg[:, :-1]).astype(f32)], axis=1)

    def step(S, x):
        q_t, k_t, v_t, b_t, g_t, keep_t = x  # [B, H, K], [B, H, K], [B, H, V], [B, H], [B, H, Kg], [B]
        S = S * keep_t[:, None, None, None] * jnp.exp(g_t)[..., None]         # reset, then decay
        u = b_t[..., None] * (v_t - jnp.einsum("bhk,bhkv->bhv", k_t, S, precision=_HI))
        S = S + jnp.einsum("bhk,bhv->bhkv", k_t, u, precision=_HI)
        return S, scale * jnp.einsum("bhk,bhkv->bhv", q_t, S, precision=_HI)

    tm = lambda a: jnp.moveaxis(a, 1, 0)
    S, o = lax.scan(step, S0, (tm(q), tm(k), tm(v), tm(beta), tm(g), tm(keep)))
    return tm(o), S
