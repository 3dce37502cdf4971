"""Multi-head Latent Attention: expanded vs absorbed paths, cache, segments, RoPE, errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lineage_jax.layers.common import logical_axes
from lineage_jax.layers.mla import MLA, MLACache, apply_rope, mla_cache_values_per_token

D, H, KV_LORA, NOPE, ROPE, VDIM, Q_LORA = 32, 4, 16, 8, 4, 8, 12
TOL = dict(rtol=1e-5, atol=1e-6)


@pytest.fixture(autouse=True)
def _full_float32_matmuls():
    """GPUs run float32 matmuls in TF32 by default; the 1e-5 equalities need full float32."""
    with jax.default_matmul_precision("highest"):
        yield


# Jitted entry points: one compile per config and shape, much cheaper than op-by-op eager
# dispatch. The float64 reference test and the error tests run the eager paths.
call = nnx.jit(lambda m, x, seg=None: m(x, segment_ids=seg))
prefill = nnx.jit(lambda m, x, cache, seg=None: m.prefill(x, cache, segment_ids=seg))
decode = nnx.jit(lambda m, x_t, cache: m.decode(x_t, cache))


def _model(use_rope=False, q_lora=None, gate=False, seed=0, decode_read="auto"):
    return MLA(D, num_heads=H, q_lora_rank=q_lora, kv_lora_rank=KV_LORA, qk_nope_head_dim=NOPE,
               qk_rope_head_dim=ROPE, v_head_dim=VDIM, use_rope=use_rope, output_gate=gate,
               rngs=nnx.Rngs(seed), decode_read=decode_read)


def _x(seed, B=2, T=11):
    return jnp.asarray(np.random.default_rng(seed).normal(size=(B, T, D)).astype(np.float32))


CONFIGS = [dict(use_rope=rope, q_lora=q, gate=g)
           for rope in (False, True) for q in (None, Q_LORA) for g in (False, True)]


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"rope={c['use_rope']}-qlora={c['q_lora']}-gate={c['gate']}")
def test_prefill_then_absorbed_decode_equals_full(cfg):
    model = _model(**cfg)
    x = _x(0)
    T = x.shape[1]
    full = call(model, x)
    for P in (0, 6):  # P = 0: decode everything from an empty cache
        cache = model.init_cache(2, 16)
        if P:
            y, cache = prefill(model, x[:, :P], cache)
            np.testing.assert_allclose(y, full[:, :P], **TOL)
        for t in range(P, T):
            y_t, cache = decode(model, x[:, t], cache)
            np.testing.assert_allclose(y_t, full[:, t], **TOL)
        np.testing.assert_array_equal(cache.length, [T, T])


@pytest.mark.parametrize("read", ["dot", "reduce"])
def test_rows_with_different_cache_lengths(read):
    model = _model(use_rope=True, q_lora=Q_LORA, decode_read=read)
    x = _x(2)
    caches = [prefill(model, x[b:b + 1, :p], model.init_cache(1, 16))[1] for b, p in ((0, 3), (1, 6))]
    cache = jax.tree.map(lambda *a: jnp.concatenate(a), *caches)
    full = call(model, x)
    for _ in range(4):
        pos = np.asarray(cache.length)
        y_t, cache = decode(model, x[np.arange(2), pos], cache)
        np.testing.assert_allclose(y_t, full[np.arange(2), pos], **TOL)


@pytest.mark.parametrize("use_rope", [False, True])
def test_two_piece_prefill_equals_one_prefill(use_rope):
    model = _model(use_rope=use_rope, q_lora=Q_LORA, gate=True)
    x = _x(3)[:, :9]
    y_one, c_one = prefill(model, x, model.init_cache(2, 16))
    y_a, c_two = prefill(model, x[:, :5], model.init_cache(2, 16))
    y_b, c_two = prefill(model, x[:, 5:9], c_two)
    np.testing.assert_allclose(jnp.concatenate([y_a, y_b], axis=1), y_one, **TOL)
    for a, b in zip(c_one, c_two):
        np.testing.assert_allclose(a, b, **TOL)


def _flat(state):
    """``{"a/b": leaf}`` for an NNX state."""
    return {"/".join(map(str, path)): leaf for path, leaf in nnx.to_flat_state(state)}


def _rope64(x, pos, theta=10000.0):
    half = x.shape[-1] // 2
    ang = np.asarray(pos, np.float64)[..., None] * theta ** (-np.arange(half) / half)
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * np.cos(ang) - x2 * np.sin(ang), x2 * np.cos(ang) + x1 * np.sin(ang)], -1)


def _reference_last_token(model, x):
    """float64 NumPy MLA (q LoRA, RoPE, output gate) with explicitly expanded per-head keys
    and values: the output for the last token of ``x [B, T, D]``, and all latents / rope keys."""
    w = {k: np.asarray(v[...], np.float64) for k, v in _flat(nnx.state(model, nnx.Param)).items()}
    x = np.asarray(x, np.float64)
    T = x.shape[1]
    rms = lambda z, s: z / np.sqrt(np.mean(z * z, -1, keepdims=True) + 1e-6) * s
    q_lat = rms(x @ w["wq_down/kernel"], w["q_norm/scale"])
    q = np.einsum("btc,chk->bthk", q_lat, w["wq_up/kernel"])
    q_nope, q_rope = q[..., :NOPE], _rope64(q[..., NOPE:], np.arange(T)[:, None])
    c = rms(x @ w["wkv_down/kernel"], w["kv_norm/scale"])
    k_rope = _rope64(x @ w["wk_rope/kernel"], np.arange(T))
    k_nope = np.einsum("btc,chn->bthn", c, w["wk_up/kernel"])
    v = np.einsum("btc,chv->bthv", c, w["wv_up/kernel"])
    k = np.concatenate([k_nope, np.broadcast_to(k_rope[:, :, None], k_nope.shape[:3] + (ROPE,))], -1)
    qt = np.concatenate([q_nope, q_rope], -1)[:, -1]                              # [B, H, n+r]
    s = np.einsum("bhk,bshk->bhs", qt, k) / np.sqrt(NOPE + ROPE)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    o = np.einsum("bhs,bshv->bhv", p, v)
    o = o / (1 + np.exp(-np.einsum("bd,dhv->bhv", x[:, -1], w["w_gate/kernel"])))
    return np.einsum("bhv,hvd->bd", o, w["w_out"]), c, k_rope


def test_absorbed_decode_matches_float64_expanded_reference():
    model = _model(use_rope=True, q_lora=Q_LORA, gate=True)
    x = _x(4, T=7)
    _, cache = model.prefill(x[:, :6], model.init_cache(2, 10))
    y_t, cache = model.decode(x[:, 6], cache)
    want, c, k_rope = _reference_last_token(model, x)
    np.testing.assert_allclose(y_t, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(cache.latent[:, :7], c, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(cache.k_rope[:, :7], k_rope, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(cache.latent[:, 7:], 0.0)


def test_cache_holds_latent_plus_rope_key_per_token():
    model = _model(q_lora=Q_LORA)
    cache = model.init_cache(3, 20, dtype=jnp.bfloat16)
    assert isinstance(cache, MLACache) and cache.capacity == 20
    shapes = [leaf.shape for leaf in jax.tree.leaves(cache)]
    assert shapes == [(3, 20, KV_LORA), (3, 20, ROPE), (3,)]
    per_token = sum(s[-1] for s in shapes if len(s) == 3)
    assert per_token == KV_LORA + ROPE == mla_cache_values_per_token(KV_LORA, ROPE)
    assert cache.latent.dtype == jnp.bfloat16 and cache.length.dtype == jnp.int32


@pytest.mark.parametrize("use_rope", [False, True])
def test_segments_equal_separate_runs(use_rope):
    model = _model(use_rope=use_rope, q_lora=Q_LORA, gate=True)
    x = _x(5)
    seg = jnp.asarray([[3] * 5 + [7] * 6, [1] * 5 + [0] * 6])
    y = call(model, x, seg)
    want = jnp.concatenate([call(model, x[:, :5]), call(model, x[:, 5:])], axis=1)
    np.testing.assert_allclose(y, want, **TOL)
    y_pre, _ = prefill(model, x, model.init_cache(2, 16), seg)
    np.testing.assert_allclose(y_pre, y, **TOL)


def test_rope_depends_only_on_relative_position():
    # Scores: rotating q at m + s and k at n + s gives the same dot product as at m, n.
    r = np.random.default_rng(6)
    q, k = (jnp.asarray(r.normal(size=(ROPE,)).astype(np.float32)) for _ in range(2))
    dot = lambda m, n: float(apply_rope(q, jnp.asarray(m), theta=1e4) @ apply_rope(k, jnp.asarray(n), theta=1e4))
    assert dot(9, 4) == pytest.approx(dot(5, 0), rel=1e-5)
    assert dot(9, 4) != pytest.approx(dot(9, 0), rel=1e-3)

    # Whole layer: the same tokens placed 7 positions later (after a segment of 7 other
    # tokens that they cannot see) give the same outputs.
    rope, nope = _model(use_rope=True, q_lora=Q_LORA), _model(use_rope=False, q_lora=Q_LORA)
    x, junk = _x(7)[:, :4], _x(8)[:, :7]
    want = call(rope, x)
    assert not np.allclose(want, call(nope, x), atol=1e-3)  # the rotation is really applied
    seg = jnp.asarray([[0] * 7 + [1] * 4] * 2)
    y, _ = prefill(rope, jnp.concatenate([junk, x], axis=1), rope.init_cache(2, 16), seg)
    np.testing.assert_allclose(y[:, 7:], want, **TOL)


def test_gradients_finite_for_all_params():
    model = _model(use_rope=True, q_lora=Q_LORA, gate=True)
    x = _x(9)
    seg = jnp.asarray([[0] * 3 + [1] * 8, [0] * 11])
    grads = nnx.jit(nnx.grad(lambda m: jnp.sum(m(x, segment_ids=seg) ** 2)))(model)
    flat = _flat(grads)
    assert len(flat) == 10
    for path, g in flat.items():
        g = np.asarray(g[...])
        assert np.all(np.isfinite(g)), path
        assert np.any(g != 0), path


@pytest.mark.parametrize("cfg", [dict(use_rope=True, q_lora=Q_LORA, gate=True), dict(use_rope=False, q_lora=None)],
                         ids=["rope-qlora-gate", "nope"])
def test_gradients_match_finite_differences(cfg):
    """Every parameter's gradient and the input's against central differences of the layer along random
    directions (``tests.layers.test_mixers.check_gradients``)."""
    from tests.layers.test_mixers import check_gradients
    # Measured (float32, step 1e-3): worst error 1.1e-3 over both configs.
    check_gradients(_model(**cfg, seed=3), _x(10, T=9), tol=1e-2)


def test_logical_axes_and_bf16_activations():
    axes = _flat(logical_axes(_model(q_lora=Q_LORA, gate=True)))
    assert axes == {
        "wq_down/kernel": ("embed", "q_lora"), "q_norm/scale": ("norm",),
        "wq_up/kernel": ("q_lora", "heads", "head_dim"), "wkv_down/kernel": ("embed", "kv_lora"),
        "kv_norm/scale": ("norm",), "wk_rope/kernel": ("embed", "rope"),
        "wk_up/kernel": ("kv_lora", "heads", "head_dim"), "wv_up/kernel": ("kv_lora", "heads", "head_dim"),
        "w_gate/kernel": ("embed", "heads", "head_dim"), "w_out": ("heads", "head_dim", "embed"),
    }
    assert _flat(logical_axes(_model()))["wq/kernel"] == ("embed", "heads", "head_dim")
    model = _model(use_rope=True)
    x = _x(10).astype(jnp.bfloat16)
    y = call(model, x)
    y_t, _ = decode(model, x[:, 0], model.init_cache(2, 16, dtype=jnp.bfloat16))
    assert y.dtype == y_t.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(y_t, np.float32), np.asarray(y[:, 0], np.float32), rtol=5e-2, atol=5e-2)


@pytest.mark.parametrize("field, value", [
    ("d_model", 0), ("num_heads", 0), ("num_heads", -2), ("q_lora_rank", 0), ("kv_lora_rank", 0),
    ("qk_nope_head_dim", -1), ("qk_rope_head_dim", 0), ("v_head_dim", 0), ("kv_lora_rank", 4.0),
])
def test_bad_config_names_the_field(field, value):
    kwargs = dict(d_model=D, num_heads=H, q_lora_rank=Q_LORA, kv_lora_rank=KV_LORA,
                  qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE, v_head_dim=VDIM)
    kwargs[field] = value
    with pytest.raises(ValueError, match=f"`{field}`"):
        MLA(kwargs.pop("d_model"), **kwargs, rngs=nnx.Rngs(0))


def test_bad_rope_config_and_cache_helpers():
    kwargs = dict(num_heads=H, kv_lora_rank=KV_LORA, qk_nope_head_dim=NOPE, v_head_dim=VDIM, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="qk_rope_head_dim"):
        MLA(D, qk_rope_head_dim=3, use_rope=True, **kwargs)
    with pytest.raises(ValueError, match="rope_theta"):
        MLA(D, qk_rope_head_dim=4, use_rope=True, rope_theta=0.0, **kwargs)
    MLA(D, qk_rope_head_dim=3, use_rope=False, **kwargs)  # odd rope width is fine without rotation
    with pytest.raises(ValueError, match="max_len"):
        _model().init_cache(2, 0)
    with pytest.raises(ValueError, match="kv_lora_rank"):
        mla_cache_values_per_token(0, ROPE)


def test_bad_inputs_and_full_cache():
    model = _model(use_rope=True)
    x = _x(11, T=4)
    with pytest.raises(ValueError, match="`x`"):
        model(x[0])
    with pytest.raises(ValueError, match="`x`"):
        model(x[..., :D - 1])
    with pytest.raises(ValueError, match="segment_ids"):
        model(x, segment_ids=jnp.zeros((2, 3), jnp.int32))
    with pytest.raises(ValueError, match="`x_t`"):
        model.decode(x, model.init_cache(2, 8))
    with pytest.raises(ValueError, match="cache"):
        model.decode(x[:, 0], model.init_cache(3, 8))
    with pytest.raises(ValueError, match="cache"):
        model.prefill(x, model.init_cache(2, 3))
    full = model.init_cache(2, 4)._replace(length=jnp.asarray([2, 4], jnp.int32))
    with pytest.raises(ValueError, match="cache"):
        model.decode(x[:, 0], full)


def test_decode_reads_a_bf16_cache_without_a_float32_copy():
    """The decode step reads a bf16 cache in bf16 (float32 accumulation): the lowered program has
    no float32 tensor of the cache's shape. (An H200 run at 1M tokens found the step's workspace
    at 1.5x its cache; a float32 copy of the latent cache was one cause. XLA:CPU upcasts bf16
    dots itself, so the check is on the program JAX emits, not on CPU memory.)"""
    model = _model(use_rope=True, decode_read="dot")  # "reduce" converts inside its fusion (by design)
    graphdef, state = nnx.split(model)
    step = jax.jit(lambda st, x_t, c: nnx.merge(graphdef, st).decode(x_t, c), donate_argnums=2)
    L = 4096
    cache = jax.eval_shape(lambda: model.init_cache(2, L, dtype=jnp.bfloat16))
    text = step.lower(state, jax.ShapeDtypeStruct((2, D), jnp.bfloat16), cache).as_text()
    assert f"tensor<2x{L}x{KV_LORA}xbf16>" in text  # the check looks at the right shapes
    for width in (KV_LORA, ROPE):
        assert f"tensor<2x{L}x{width}xf32>" not in text, f"a float32 copy of a [2, {L}, {width}] cache leaf"


def test_decode_reads_agree_on_a_bf16_cache_and_are_checked():
    """``decode_read="reduce"`` (multiply-and-reduce) and ``"dot"`` (einsum) decode the same tokens."""
    x = _x(5).astype(jnp.bfloat16)
    outs = []
    for read in ("dot", "reduce"):
        model = _model(use_rope=True, gate=True, decode_read=read)
        y, cache = prefill(model, x[:, :5], model.init_cache(2, 16, dtype=jnp.bfloat16))
        ys = []
        for t in range(5, 8):
            y_t, cache = decode(model, x[:, t], cache)
            ys.append(y_t)
        outs.append((np.asarray(jnp.stack(ys), np.float32), cache))
    (y_d, _), (y_r, _) = outs
    np.testing.assert_allclose(y_r, y_d, rtol=2e-2, atol=2e-2)
    with pytest.raises(ValueError, match="decode_read"):
        _model(decode_read="fast")
