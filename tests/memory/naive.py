"""Independent float64 NumPy references, written straight from the equations.

They share no code with lineage_jax: a token loop per rule, nothing clever.
Layout [B, T, H, D]; state [B, H, K, V]; q is scaled here, like the library.
"""

import numpy as np


def _resets(segment_ids, B, T):
    if segment_ids is None:
        return np.zeros((B, T), bool)
    seg = np.asarray(segment_ids)
    r = np.zeros((B, T), bool)
    r[:, 1:] = seg[:, 1:] != seg[:, :-1]
    return r


def delta_family(q, k, v, beta=None, g=None, *, erase=True, scale=None, initial_state=None, segment_ids=None):
    """S_t = (I - b k^T k) Diag(exp g) S + b k^T v  (erase) or  Diag(exp g) S + b k^T v (no erase).

    g: None, [B,T,H] (scalar) or [B,T,H,K] (per channel).
    """
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    B, T, H, K = q.shape
    V = v.shape[-1]
    scale = K ** -0.5 if scale is None else scale
    S = np.zeros((B, H, K, V)) if initial_state is None else np.array(initial_state, np.float64)
    beta = np.ones((B, T, H)) if beta is None else np.asarray(beta, np.float64)
    if g is None:
        alpha = np.ones((B, T, H, K))
    else:
        g = np.asarray(g, np.float64)
        alpha = np.exp(g if g.ndim == 4 else np.repeat(g[..., None], K, -1))
    resets = _resets(segment_ids, B, T)
    o = np.zeros((B, T, H, V))
    for b in range(B):
        for t in range(T):
            if resets[b, t]:
                S[b] = 0.0
            for h in range(H):
                St = alpha[b, t, h][:, None] * S[b, h]
                kk, vv = k[b, t, h], v[b, t, h]
                u = vv - kk @ St if erase else vv
                St = St + np.outer(kk, beta[b, t, h] * u)
                S[b, h] = St
                o[b, t, h] = (q[b, t, h] * scale) @ St
    return o, S


def softmax_attention(q, k, v, *, scale=None, causal=True, segment_ids=None):
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    B, T, H, K = q.shape
    S, Hk = k.shape[1], k.shape[2]
    group = H // Hk
    scale = K ** -0.5 if scale is None else scale
    resets = _resets(segment_ids, B, T)
    doc = np.cumsum(resets, axis=1)
    o = np.zeros((B, T, H, v.shape[-1]))
    for b in range(B):
        for h in range(H):
            for t in range(T):
                s = (q[b, t, h] * scale) @ k[b, :, h // group].T
                visible = np.ones(S, bool)
                if causal:
                    visible &= np.arange(S) <= t
                if segment_ids is not None:
                    visible &= doc[b] == doc[b, t]
                s = np.where(visible, s, -np.inf)
                p = np.exp(s - s.max())
                p /= p.sum()
                o[b, t, h] = p @ v[b, :, h // group]
    return o
