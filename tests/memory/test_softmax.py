"""Softmax attention and the KV cache."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lineage_jax import memory as M
from tests.memory import naive


def _qkv(seed, B=2, T=19, H=4, Hk=2, K=8, V=6):
    r = np.random.default_rng(seed)
    return (r.normal(size=(B, T, H, K)).astype(np.float32),
            r.normal(size=(B, T, Hk, K)).astype(np.float32),
            r.normal(size=(B, T, Hk, V)).astype(np.float32))


@pytest.mark.parametrize("Hk", [4, 2, 1])
@pytest.mark.parametrize("causal", [True, False])
def test_matches_float64_reference(Hk, causal):
    q, k, v = _qkv(0, Hk=Hk)
    seg = np.repeat(np.array([[0] * 7 + [1] * 12, [3] * 19]), 1, axis=0)
    for segment_ids in (None, seg):
        o = M.softmax_attention(q, k, v, causal=causal, segment_ids=segment_ids)
        want = naive.softmax_attention(q, k, v, causal=causal, segment_ids=segment_ids)
        np.testing.assert_allclose(o, want, rtol=2e-5, atol=2e-6)


def test_segments_equal_separate_runs():
    q, k, v = _qkv(1, B=1, T=20)
    seg = np.array([[0] * 8 + [1] * 12])
    o = M.softmax_attention(q, k, v, segment_ids=seg)
    o1 = M.softmax_attention(q[:, :8], k[:, :8], v[:, :8])
    o2 = M.softmax_attention(q[:, 8:], k[:, 8:], v[:, 8:])
    np.testing.assert_allclose(o, np.concatenate([o1, o2], axis=1), rtol=1e-5, atol=1e-6)


def test_prefill_then_decode_equals_full_sequence():
    q, k, v = _qkv(2, T=17)
    P = 9
    o_full = M.softmax_attention(q, k, v)
    o_pre = M.softmax_attention(q[:, :P], k[:, :P], v[:, :P])
    np.testing.assert_allclose(o_pre, o_full[:, :P], rtol=1e-5, atol=1e-6)
    cache = M.kv_cache_from_prefill(jnp.asarray(k[:, :P]), jnp.asarray(v[:, :P]), max_len=32)
    step = jax.jit(M.softmax_attention_step)
    for t in range(P, 17):
        o_t, cache = step(q[:, t], k[:, t], v[:, t], cache)
        np.testing.assert_allclose(o_t, o_full[:, t], rtol=1e-5, atol=1e-6)
    assert np.all(np.asarray(cache.length) == 17)


def test_decode_from_empty_cache_and_full_cache_error():
    q, k, v = _qkv(3, T=5)
    cache = M.init_kv_cache(2, 5, 2, 8, v_head_dim=6)
    o_full = M.softmax_attention(q, k, v)
    for t in range(5):
        o_t, cache = M.softmax_attention_step(q[:, t], k[:, t], v[:, t], cache)
        np.testing.assert_allclose(o_t, o_full[:, t], rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="cache"):
        M.softmax_attention_step(q[:, 0], k[:, 0], v[:, 0], cache)


def test_gradients_match_reference_autodiff():
    """Gradients through the masked softmax are finite and match a plain jnp formula."""
    q, k, v = (jnp.asarray(a) for a in _qkv(4, Hk=4))
    seg = jnp.asarray(np.array([[0] * 10 + [1] * 9] * 2))

    def plain(q, k, v):
        s = jnp.einsum("bqhk,bshk->bhqs", q * 8 ** -0.5, k)
        doc = jnp.cumsum(jnp.concatenate([jnp.zeros((2, 1), int), (seg[:, 1:] != seg[:, :-1]).astype(int)], 1), 1)
        mask = jnp.tril(jnp.ones((19, 19), bool)) & (doc[:, None, :, None] == doc[:, None, None, :])
        p = jax.nn.softmax(jnp.where(mask, s, -1e30), -1)
        return jnp.einsum("bhqs,bshv->bqhv", p, v)

    w = jnp.asarray(np.random.default_rng(5).normal(size=(2, 19, 4, 6)), jnp.float32)
    g1 = jax.grad(lambda *a: jnp.sum(M.softmax_attention(*a, segment_ids=seg) * w), argnums=(0, 1, 2))(q, k, v)
    g2 = jax.grad(lambda *a: jnp.sum(plain(*a) * w), argnums=(0, 1, 2))(q, k, v)
    for a, b in zip(g1, g2):
        assert np.all(np.isfinite(a))
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_extend_in_pieces_with_segments_equals_full():
    q, k, v = _qkv(6, T=16)
    seg = np.array([[0] * 5 + [1] * 11, [2] * 9 + [4] * 7])
    o_full = M.softmax_attention(q, k, v, segment_ids=seg)
    cache = M.init_kv_cache(2, 20, 2, 8, v_head_dim=6)
    o1, cache = M.softmax_attention_extend(q[:, :3], k[:, :3], v[:, :3], cache, segment_ids=seg[:, :3])
    o2, cache = M.softmax_attention_extend(q[:, 3:], k[:, 3:], v[:, 3:], cache, segment_ids=seg[:, 3:])
    np.testing.assert_allclose(np.concatenate([o1, o2], 1), o_full, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="cache"):
        M.softmax_attention_extend(q[:, :5], k[:, :5], v[:, :5], cache)
