"""Softmax attention and the KV cache."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lineage_jax import memory as M
from tests.memory import naive


attention = jax.jit(M.softmax_attention, static_argnames="causal")  # one program per shape, not per operation


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
        o = attention(q, k, v, causal=causal, segment_ids=segment_ids)
        want = naive.softmax_attention(q, k, v, causal=causal, segment_ids=segment_ids)
        np.testing.assert_allclose(o, want, rtol=2e-5, atol=2e-6)
        # The unfused form too (its whole score matrix at once).
        ref = M.reference_attention(q, k, v, causal=causal, segment_ids=segment_ids)
        np.testing.assert_allclose(ref, want, rtol=2e-5, atol=2e-6)


def test_segments_equal_separate_runs():
    q, k, v = _qkv(1, B=1, T=20)
    seg = np.array([[0] * 8 + [1] * 12])
    o = attention(q, k, v, segment_ids=seg)
    o1 = attention(q[:, :8], k[:, :8], v[:, :8])
    o2 = attention(q[:, 8:], k[:, 8:], v[:, 8:])
    np.testing.assert_allclose(o, np.concatenate([o1, o2], axis=1), rtol=1e-5, atol=1e-6)


def test_prefill_then_decode_equals_full_sequence():
    q, k, v = _qkv(2, T=17)
    P = 9
    o_full = attention(q, k, v)
    o_pre = attention(q[:, :P], k[:, :P], v[:, :P])
    np.testing.assert_allclose(o_pre, o_full[:, :P], rtol=1e-5, atol=1e-6)
    cache = M.kv_cache_from_prefill(jnp.asarray(k[:, :P]), jnp.asarray(v[:, :P]), max_len=32)
    step = jax.jit(M.softmax_attention_step)
    for t in range(P, 17):
        o_t, cache = step(q[:, t], k[:, t], v[:, t], cache)
        np.testing.assert_allclose(o_t, o_full[:, t], rtol=1e-5, atol=1e-6)
    assert np.all(np.asarray(cache.length) == 17)


@pytest.mark.parametrize("Hk", [4, 2, 1])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_decode_reads_agree_and_match_the_full_sequence(Hk, dtype):
    """``read="dot"`` and ``read="reduce"``: same outputs, same caches, every gradient, ragged rows."""
    q, k, v = (jnp.asarray(a) for a in _qkv(6, T=13, Hk=Hk))
    P = np.array([5, 9])  # rows prefilled to different lengths
    cache = M.init_kv_cache(2, 16, Hk, 8, v_head_dim=6, dtype=dtype)

    @jax.jit
    def fill(t, cache):  # row b takes token t while t < P[b]
        stepped = M.softmax_attention_step(q[:, t], k[:, t], v[:, t], cache, read="dot")[1]
        keep = (t < P)[:, None, None, None]
        return M.KVCache(jnp.where(keep, stepped.k, cache.k), jnp.where(keep, stepped.v, cache.v),
                         jnp.where(t < P, stepped.length, cache.length))

    for t in range(int(P.max())):  # fill row b with its first P[b] tokens
        cache = fill(t, cache)
    rows = np.arange(2)
    args = (q[rows, P], k[rows, P], v[rows, P])
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == jnp.float32 else dict(rtol=2e-2, atol=2e-2)
    outs = {r: jax.jit(lambda *a, r=r: M.softmax_attention_step(*a, cache, read=r))(*args) for r in ("dot", "reduce")}
    for r, (o, c) in outs.items():
        for b in rows:  # each row equals the full sequence cut at its own length
            kb = jnp.concatenate([k[b:b + 1, :P[b]], k[b:b + 1, P[b]:P[b] + 1]], 1).astype(dtype)
            vb = jnp.concatenate([v[b:b + 1, :P[b]], v[b:b + 1, P[b]:P[b] + 1]], 1).astype(dtype)
            want = naive.softmax_attention(np.asarray(q[b:b + 1, :P[b] + 1]), np.asarray(kb, np.float32),
                                           np.asarray(vb, np.float32))[:, -1]
            np.testing.assert_allclose(np.asarray(o[b:b + 1], np.float32), want, **tol, err_msg=r)
        np.testing.assert_array_equal(c.length, P + 1)
    (o_d, c_d), (o_r, c_r) = outs["dot"], outs["reduce"]
    np.testing.assert_allclose(np.asarray(o_r, np.float32), np.asarray(o_d, np.float32), **tol)
    np.testing.assert_array_equal(np.asarray(c_r.k, np.float32), np.asarray(c_d.k, np.float32))
    np.testing.assert_array_equal(np.asarray(c_r.v, np.float32), np.asarray(c_d.v, np.float32))

    w = jnp.asarray(np.random.default_rng(7).normal(size=o_d.shape), jnp.float32)

    def loss(read, q_t, k_t, v_t, ck, cv):
        o, c = M.softmax_attention_step(q_t, k_t, v_t, M.KVCache(ck, cv, cache.length), read=read)
        return jnp.sum(o.astype(jnp.float32) * w) + jnp.sum(c.k.astype(jnp.float32) ** 2)

    def ref_loss(q_t, k_t, v_t, ck, cv):
        """The step written out here in float32: the token stored at slot ``length``, whole-row softmax
        over the slots up to it (grouped heads), the same functional as ``loss``."""
        ck = ck.astype(jnp.float32).at[rows, cache.length].set(k_t.astype(dtype).astype(jnp.float32))
        cv = cv.astype(jnp.float32).at[rows, cache.length].set(v_t.astype(dtype).astype(jnp.float32))
        group = q_t.shape[1] // Hk
        s = jnp.einsum("bhk,blhk->bhl", q_t, jnp.repeat(ck, group, axis=2)) * q_t.shape[-1] ** -0.5
        seen = np.arange(ck.shape[1])[None, None, :] <= np.asarray(cache.length)[:, None, None]
        o = jnp.einsum("bhl,blhv->bhv", jax.nn.softmax(jnp.where(seen, s, -jnp.inf), -1), jnp.repeat(cv, group, 2))
        return jnp.sum(o * w) + jnp.sum(ck ** 2)

    grads = {r: jax.jit(jax.grad(lambda *a, r=r: loss(r, *a), argnums=tuple(range(5))))(*args, cache.k, cache.v)
             for r in ("dot", "reduce")}
    want = jax.jit(jax.grad(ref_loss, argnums=tuple(range(5))))(*args, cache.k, cache.v)
    for name, gd, gr, gw in zip(("q_t", "k_t", "v_t", "cache.k", "cache.v"), grads["dot"], grads["reduce"], want):
        assert np.all(np.isfinite(np.asarray(gr, np.float32))), name
        np.testing.assert_allclose(np.asarray(gr, np.float32), np.asarray(gd, np.float32), **tol, err_msg=name)
        # Both reads against the written-out step (bf16: the cotangents are rounded to bf16).
        for r, g in (("dot", gd), ("reduce", gr)):
            np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(gw, np.float32), **tol,
                                       err_msg=f"{r} {name}")


@pytest.mark.parametrize("spec,xs,cs", [
    ("bhc,blc->bhl", (2, 4, 8), (2, 7, 8)),        # MLA's latent scores (reuse 4)
    ("bhl,blc->bhc", (2, 4, 7), (2, 7, 8)),        # MLA's latent read
    ("bhgk,blhk->bhgl", (2, 3, 1, 5), (2, 7, 3, 5)),  # MHA scores
    ("bhgl,blhv->bhgv", (2, 3, 2, 7), (2, 7, 3, 4)),  # GQA values
    ("bhl,blc->cbh", (2, 4, 7), (2, 7, 8)),        # output in another order
    ("hbcz,blc->lb", (4, 2, 8, 3), (2, 7, 8)),     # x permuted; z only in x, summed away
])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_cache_read_forms_equal_the_einsum(spec, xs, cs, dtype):
    r = np.random.default_rng(9)
    x, c = jnp.asarray(r.normal(size=xs), jnp.float32), jnp.asarray(r.normal(size=cs), dtype)
    want = np.einsum(spec, np.asarray(x.astype(dtype), np.float64), np.asarray(c, np.float64))
    for read in ("dot", "reduce"):
        got = M.cache_read(spec, x, c, read=read)
        assert got.dtype == jnp.float32 and got.shape == want.shape, read
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=read)


def test_cache_read_checks_its_spec():
    x, c = jnp.ones((2, 4, 8)), jnp.ones((2, 7, 8))
    for bad in ("bhc->bhl", "bhc,blc,bz->bhl", "bhc,blc->bhz", "bhh,blc->bhl", "b1c,blc->bhl"):
        with pytest.raises(ValueError, match="`spec`"):
            M.cache_read(bad, x, c)
    with pytest.raises(ValueError, match="`cached` has shape"):
        M.cache_read("bhc,bc->bh", x, c)
    with pytest.raises(ValueError, match="axis 'c'"):
        M.cache_read("bhc,blc->bhl", x, jnp.ones((2, 7, 5)))
    with pytest.raises(ValueError, match="`read`"):
        M.cache_read("bhc,blc->bhl", x, c, read="fast")
    with pytest.raises(ValueError, match="`cached` must be a floating"):
        M.cache_read("bhc,blc->bhl", x, c.astype(jnp.int8))


def test_reduce_read_has_no_dot_general():
    """The point of ``read="reduce"``: no ``dot_general`` over the cache (XLA:GPU copied the cache
    to feed one, every step); ``"dot"`` has them."""
    q, k, v = _qkv(10, T=1)
    cache = M.init_kv_cache(2, 8, 2, 8, v_head_dim=6, dtype=jnp.bfloat16)
    for read, n in (("reduce", 0), ("dot", 2)):
        jaxpr = str(jax.make_jaxpr(lambda *a: M.softmax_attention_step(*a, cache, read=read))(q[:, 0], k[:, 0], v[:, 0]))
        assert jaxpr.count("dot_general") == n, read


def test_decode_read_is_checked_and_auto_follows_the_backend():
    q, k, v = _qkv(8, T=2)
    cache = M.init_kv_cache(2, 4, 2, 8, v_head_dim=6)
    with pytest.raises(ValueError, match="`read`"):
        M.softmax_attention_step(q[:, 0], k[:, 0], v[:, 0], cache, read="einsum")
    gpu = jax.default_backend() == "gpu"
    assert M.resolve_read("f", "auto") == ("reduce" if gpu else "dot")
    assert M.resolve_read("f", "auto", reuse=16) == "dot"  # a read with reuse is a matmul (MLA's latent)
    assert M.resolve_read("f", "dot") == "dot" and M.resolve_read("f", "reduce") == "reduce"
    with pytest.raises(ValueError, match="`reuse`"):
        M.resolve_read("f", "auto", reuse=0)
    full = M.init_kv_cache(2, 1, 2, 8, v_head_dim=6)
    full = M.softmax_attention_step(q[:, 0], k[:, 0], v[:, 0], full, read="reduce")[1]
    with pytest.raises(ValueError, match="full"):
        M.softmax_attention_step(q[:, 1], k[:, 1], v[:, 1], full, read="reduce")
    # Under jit the length is traced and unchecked: both forms overwrite the last slot alike.
    outs = {r: jax.jit(lambda *a, r=r: M.softmax_attention_step(*a, read=r))(q[:, 1], k[:, 1], v[:, 1], full)
            for r in ("dot", "reduce")}
    np.testing.assert_allclose(outs["reduce"][0], outs["dot"][0], rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(outs["reduce"][1].v, outs["dot"][1].v)
    np.testing.assert_array_equal(outs["dot"][1].v[:, 0], v[:, 1])


def test_decode_from_empty_cache_and_full_cache_error():
    q, k, v = _qkv(3, T=5)
    cache = M.init_kv_cache(2, 5, 2, 8, v_head_dim=6)
    o_full = attention(q, k, v)
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
    g1 = jax.jit(jax.grad(lambda *a: jnp.sum(M.softmax_attention(*a, segment_ids=seg) * w), argnums=(0, 1, 2)))(q, k, v)
    g2 = jax.jit(jax.grad(lambda *a: jnp.sum(plain(*a) * w), argnums=(0, 1, 2)))(q, k, v)
    for a, b in zip(g1, g2):
        assert np.all(np.isfinite(a))
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_extend_in_pieces_with_segments_equals_full():
    q, k, v = _qkv(6, T=16)
    seg = np.array([[0] * 5 + [1] * 11, [2] * 9 + [4] * 7])
    o_full = attention(q, k, v, segment_ids=seg)
    cache = M.init_kv_cache(2, 20, 2, 8, v_head_dim=6)
    extend = jax.jit(M.softmax_attention_extend)
    o1, cache = extend(q[:, :3], k[:, :3], v[:, :3], cache, segment_ids=seg[:, :3])
    o2, cache = extend(q[:, 3:], k[:, 3:], v[:, 3:], cache, segment_ids=seg[:, 3:])
    np.testing.assert_allclose(np.concatenate([o1, o2], 1), o_full, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="cache"):
        M.softmax_attention_extend(q[:, :5], k[:, :5], v[:, :5], cache)
