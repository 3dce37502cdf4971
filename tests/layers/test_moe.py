"""Tests of the sigmoid-routed MoE: routing, both dispatch paths against a naive
dense reference, capacity drops, the non-trainable router bias and its update rules."""

import math
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lineage_jax.layers import moe as M
from tests._numerics import fp32_matmuls, rel_err

D, E, K, H = 16, 8, 2, 12
B, T = 2, 24


pytestmark = pytest.mark.usefixtures(fp32_matmuls.__name__)


def make(seed=0, **kw):
    cfg = dict(num_experts=E, top_k=K, expert_hidden=H)
    cfg.update(kw)
    return M.MoE(D, rngs=nnx.Rngs(seed), **cfg)


def inputs(seed, b=B, t=T, d=D, shift=None):
    x = np.random.default_rng(seed).normal(size=(b, t, d)).astype(np.float32)
    if shift is not None:
        x = x + shift
    return jnp.asarray(x)


def no_drop_factor():
    """capacity_factor making C = N (no expert can overflow)."""
    return E / K


# ------------------------------------------------------------------- naive NumPy reference
def _np(v):
    return np.asarray(v[...], np.float64)


def _glu(kind, g, u):
    if kind == "swiglu":
        return g / (1 + np.exp(-g)) * u
    return (4 * np.tanh(g / 4) / (1 + np.exp(-g))) * (25 * np.tanh(u / 25))


def _gated(kind, x, w_gate, w_up, w_down):
    return _glu(kind, x @ w_gate, x @ w_up) @ w_down


def naive_moe(model, x, drop_mask=None):
    """float64 reference: every expert on every token, masked by the selection.

    ``drop_mask [N, E]`` (optional) zeroes dropped (token, expert) assignments.
    """
    xf = np.asarray(x, np.float64).reshape(-1, D)
    n = xf.shape[0]
    scores = 1 / (1 + np.exp(-(xf @ _np(model.router))))
    idx = np.argsort(-(scores + _np(model.router_bias)), axis=-1, kind="stable")[:, :model.top_k]
    chosen = np.take_along_axis(scores, idx, axis=-1)
    w = chosen / chosen.sum(-1, keepdims=True) * model.routed_scaling_factor
    gate_w = np.zeros((n, model.num_experts))
    np.put_along_axis(gate_w, idx, w, axis=-1)
    if drop_mask is not None:
        gate_w = gate_w * (1 - drop_mask)

    z = xf if model.down_proj is None else xf @ _np(model.down_proj.kernel)
    routed = np.zeros_like(z)
    for e in range(model.num_experts):
        out = _gated(model.activation, z, _np(model.w_gate)[e], _np(model.w_up)[e], _np(model.w_down)[e])
        routed += gate_w[:, e:e + 1] * out
    if model.up_proj is None:
        y = routed
    else:
        normed = routed / np.sqrt(np.mean(routed ** 2, -1, keepdims=True) + 1e-6) * _np(model.latent_norm.scale)
        y = normed @ _np(model.up_proj.kernel)
    if model.shared is not None:
        s = model.shared
        y = y + _gated(model.activation, xf, _np(s.gate.kernel), _np(s.up.kernel), _np(s.down.kernel))
    return y.reshape(x.shape), idx


# -------------------------------------------------------------------------------- routing
def test_weights_renormalized_and_use_uncorrected_scores():
    model = make(routed_scaling_factor=2.5)
    model.router_bias[...] = jnp.linspace(-0.3, 0.3, E)
    idx, w, scores = model.route(inputs(1))
    chex.assert_shape(idx, (B * T, K))
    chex.assert_shape(w, (B * T, K))
    chex.assert_shape(scores, (B * T, E))
    assert w.dtype == jnp.float32 and scores.dtype == jnp.float32
    np.testing.assert_allclose(np.sum(w, -1), 2.5, rtol=1e-6)
    chosen = np.take_along_axis(np.asarray(scores), np.asarray(idx), -1)
    np.testing.assert_allclose(w, chosen / chosen.sum(-1, keepdims=True) * 2.5, rtol=1e-6)


def test_exact_top_k_with_bias_changing_selection():
    model = make()
    x = inputs(2)
    idx0, _, scores = model.route(x)
    scores = np.asarray(scores)
    # A bias that promotes the least-chosen expert and demotes the most-chosen one.
    counts = np.bincount(np.asarray(idx0).ravel(), minlength=E)
    bias = np.zeros(E, np.float32)
    bias[np.argmin(counts)] = 0.4
    bias[np.argmax(counts)] = -0.4
    model.router_bias[...] = jnp.asarray(bias)
    idx, w, scores_b = model.route(x)
    np.testing.assert_array_equal(scores_b, scores)      # scores do not include the bias
    expected = np.argsort(-(scores + bias), axis=-1, kind="stable")[:, :K]
    np.testing.assert_array_equal(idx, expected)          # same experts, decreasing corrected score
    assert not np.array_equal(np.sort(np.asarray(idx0), -1), np.sort(expected, -1))
    chosen = np.take_along_axis(scores, np.asarray(idx), -1)
    np.testing.assert_allclose(w, chosen / chosen.sum(-1, keepdims=True), rtol=1e-6)


# --------------------------------------------------------------- dispatch vs reference
CONFIGS = {
    "plain": dict(),
    "plain_shared_situ": dict(num_shared_experts=2, activation="situ", routed_scaling_factor=2.0),
    "latent_shared": dict(latent_dim=10, num_shared_experts=1, shared_hidden=20),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_dispatch_paths_match_naive_reference(name):
    cfg = CONFIGS[name]
    ragged = make(3, **cfg)
    capacity = make(3, dispatch="capacity", capacity_factor=no_drop_factor(), **cfg)
    bias = jnp.asarray(np.random.default_rng(4).normal(scale=0.1, size=E), jnp.float32)
    ragged.router_bias[...] = bias
    capacity.router_bias[...] = bias
    x = inputs(5)
    y_r, st_r = ragged(x)
    y_c, st_c = capacity(x)
    chex.assert_shape(y_r, x.shape)
    assert y_r.dtype == x.dtype and y_c.dtype == x.dtype
    assert rel_err(y_c, y_r) <= 1e-5
    ref, idx = naive_moe(ragged, x)
    assert rel_err(y_r, ref) <= 1e-5
    assert rel_err(y_c, ref) <= 1e-5
    counts = np.bincount(idx.ravel(), minlength=E)
    for st in (st_r, st_c):
        np.testing.assert_array_equal(st.expert_counts, counts)
        assert st.expert_counts.dtype == jnp.int32
        np.testing.assert_allclose(st.load, counts / (B * T * K), rtol=1e-6)
        assert int(st.tokens_dropped) == 0
        chex.assert_shape(st.scores, (B * T, E))


def test_bfloat16_input_gives_bfloat16_output():
    model = make(num_shared_experts=1, latent_dim=8)
    x = inputs(6)
    y32, _ = model(x)
    y16, _ = model(x.astype(jnp.bfloat16))
    assert y16.dtype == jnp.bfloat16
    assert rel_err(y16, y32) < 5e-2


def test_capacity_drops_are_counted_and_zeroed():
    factor = 0.5
    model = make(7, dispatch="capacity", capacity_factor=factor, num_shared_experts=1)
    x = inputs(8)
    y, st = model(x)
    n = B * T
    cap = math.ceil(factor * n * K / E)
    idx, _, _ = model.route(x)
    idx = np.asarray(idx)
    counts = np.bincount(idx.ravel(), minlength=E)
    expected = int(np.sum(np.maximum(counts - cap, 0)))
    assert expected > 0
    assert int(st.tokens_dropped) == expected
    np.testing.assert_array_equal(st.expert_counts, counts)   # counted before drops
    # Which assignments drop: slots are filled choice-major (all 1st choices first).
    drop = np.zeros((n, E))
    used = np.zeros(E, int)
    for j in range(K):
        for t in range(n):
            e = idx[t, j]
            if used[e] >= cap:
                drop[t, e] = 1
            used[e] += 1
    assert drop.sum() == expected
    ref, _ = naive_moe(model, x, drop_mask=drop)
    assert rel_err(y, ref) <= 1e-5


# ------------------------------------------------------------------------- router bias
def test_bias_is_not_a_param_and_gets_no_gradient():
    model = make(num_shared_experts=1)
    model.router_bias[...] = jnp.linspace(-0.2, 0.2, E)
    x = inputs(9)

    def loss(m):
        y, _ = m(x)
        return jnp.sum(y ** 2)

    grads = nnx.grad(loss)(model)
    paths = [".".join(str(p) for p in path) for path, _ in nnx.to_flat_state(grads)]
    assert paths and not any("router_bias" in p for p in paths)
    assert not nnx.state(model, nnx.Param).filter(M.RouterBias)

    bias_grad = nnx.grad(loss, argnums=nnx.DiffState(0, M.RouterBias))(model)
    leaves = jax.tree.leaves(bias_grad)
    assert len(leaves) == 1
    np.testing.assert_array_equal(leaves[0], np.zeros(E))


def test_sign_update_direction():
    bias = jnp.zeros(E)
    counts = jnp.array([10, 2, 6, 6, 0, 12, 6, 6], jnp.int32)     # mean 6
    new = M.sign_bias_update(bias, counts, rate=0.01)
    np.testing.assert_allclose(new, [-0.01, 0.01, 0, 0, 0.01, -0.01, 0, 0], atol=1e-7)

    model = make()
    _, st = model(inputs(10))
    expected = M.sign_bias_update(model.router_bias[...], st.expert_counts, 0.01)
    model.update_bias(st, rule="sign", rate=0.01)
    np.testing.assert_array_equal(model.router_bias[...], expected)
    under = np.asarray(st.expert_counts) < np.mean(np.asarray(st.expert_counts))
    assert np.all(np.asarray(model.router_bias[...])[under] > 0)
    assert np.all(np.asarray(model.router_bias[...])[~under] <= 0)


def test_quantile_update_balances_skewed_router():
    model = make(11)
    shift = np.random.default_rng(12).normal(size=D).astype(np.float32) * 1.5   # skews logits per expert
    big = dict(b=8, t=64, shift=shift)
    _, before = model(inputs(13, **big))
    model.update_bias(before, rule="quantile", rate=1.0)
    _, before_fresh = make(11)(inputs(14, **big))
    _, after = model(inputs(14, **big))
    std_before, std_after = float(np.std(before_fresh.load)), float(np.std(after.load))
    assert std_before > 0.05                           # genuinely skewed
    assert std_after < 0.5 * std_before

    # Pure-function definition: target b* = mean(q) - q, relaxed by rate.
    scores = np.asarray(before.scores)
    q = np.quantile(scores, 1 - K / E, axis=0)
    bias0 = np.full(E, 0.1, np.float32)
    new = M.quantile_bias_update(jnp.asarray(bias0), before.scores, K, rate=0.25)
    np.testing.assert_allclose(new, bias0 + 0.25 * ((q.mean() - q) - bias0), atol=1e-6)


# --------------------------------------------------------------------------- gradients
@pytest.mark.parametrize("dispatch", ["ragged", "capacity"])
@pytest.mark.parametrize("latent", [None, 10])
def test_gradients_flow(dispatch, latent):
    model = make(15, dispatch=dispatch, latent_dim=latent, num_shared_experts=1)
    x = inputs(16)
    target = inputs(17)

    def loss(m):
        y, _ = m(x)
        return jnp.sum(y * target)

    grads = nnx.grad(loss)(model)
    for path, g in nnx.to_flat_state(grads):
        g = np.asarray(g[...])
        assert np.all(np.isfinite(g)), path
        assert np.any(g != 0), path
    names = {".".join(str(p) for p in path) for path, _ in nnx.to_flat_state(grads)}
    assert {"router", "w_gate", "w_up", "w_down"} <= names
    assert any(n.startswith("shared.") for n in names)


def test_ragged_dispatch_gradients_equal_the_dropless_capacity_ones():
    """The dropless (sorted, grouped-matmul) dispatch and a capacity dispatch that drops nothing compute
    the same function: equal gradients for the input and every parameter."""
    x, target = inputs(18), inputs(19)

    def grads(dispatch):
        model = make(16, dispatch=dispatch, capacity_factor=no_drop_factor())
        loss = lambda m, x: jnp.sum(m(x)[0] * target)
        return nnx.grad(loss, argnums=(0, 1))(model, x)

    (gm_r, gx_r), (gm_c, gx_c) = grads("ragged"), grads("capacity")
    assert rel_err(gx_r, gx_c) < 1e-5
    flat_c = dict(nnx.to_flat_state(gm_c))
    for path, g in nnx.to_flat_state(gm_r):
        assert rel_err(g[...], flat_c[path][...]) < 1e-5, path


def _jnp_moe(p, x, bias, model):
    """A differentiable jnp reference of the layer (float64 under ``jax.enable_x64``), written out here: every
    expert on every token, weighted by the renormalised sigmoid scores of the top-k selection (the
    selection itself, by ``scores + bias``, carries no gradient). ``p``: ``"/"``-joined parameter paths."""
    xf = x.reshape(-1, x.shape[-1])
    scores = 1 / (1 + jnp.exp(-(xf @ p["router"])))
    _, idx = jax.lax.top_k(jax.lax.stop_gradient(scores) + bias, model.top_k)
    selected = jnp.sum(jax.nn.one_hot(idx, model.num_experts, dtype=scores.dtype), axis=1)     # [N, E] 0/1
    chosen = scores * selected
    gate_w = chosen / jnp.sum(chosen, -1, keepdims=True) * model.routed_scaling_factor

    def gated(z, w_gate, w_up, w_down):
        g, u = z @ w_gate, z @ w_up
        if model.activation == "swiglu":
            h = g / (1 + jnp.exp(-g)) * u
        else:
            h = 4 * jnp.tanh(g / 4) / (1 + jnp.exp(-g)) * (25 * jnp.tanh(u / 25))
        return h @ w_down

    z = xf @ p["down_proj/kernel"] if "down_proj/kernel" in p else xf
    routed = sum(gate_w[:, e:e + 1] * gated(z, p["w_gate"][e], p["w_up"][e], p["w_down"][e])
                 for e in range(model.num_experts))
    if "up_proj/kernel" in p:
        normed = routed / jnp.sqrt(jnp.mean(routed ** 2, -1, keepdims=True) + 1e-6) * p["latent_norm/scale"]
        y = normed @ p["up_proj/kernel"]
    else:
        y = routed
    if "shared/gate/kernel" in p:
        y = y + gated(xf, p["shared/gate/kernel"], p["shared/up/kernel"], p["shared/down/kernel"])
    return y.reshape(x.shape)


@pytest.mark.parametrize("dispatch", ["ragged", "capacity"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_gradients_match_a_differentiable_reference(name, dispatch):
    """The gradients of the input and of every parameter (the router's through the renormalised
    weights included) against a float64 jnp re-derivation of the layer, with a nonzero router bias."""
    model = make(23, dispatch=dispatch, capacity_factor=no_drop_factor(), **CONFIGS[name])
    model.router_bias[...] = jnp.asarray(np.random.default_rng(24).normal(scale=0.1, size=E), jnp.float32)
    x, target = inputs(25), inputs(26)
    gm, gx = nnx.jit(nnx.grad(lambda m, x: jnp.sum(m(x)[0] * target), argnums=(0, 1)))(model, x)
    got = {"/".join(map(str, path)): np.asarray(g[...]) for path, g in nnx.to_flat_state(gm)}
    params = {"/".join(map(str, path)): np.asarray(v[...], np.float64)
              for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    assert set(got) == set(params) and "router" in params
    with jax.enable_x64(True):
        bias = jnp.asarray(np.asarray(model.router_bias[...], np.float64))
        t64 = jnp.asarray(np.asarray(target, np.float64))
        loss = lambda p, x: jnp.sum(_jnp_moe(p, x, bias, model) * t64)
        want, want_x = jax.jit(jax.grad(loss, argnums=(0, 1)))({k: jnp.asarray(v) for k, v in params.items()},
                                                               jnp.asarray(np.asarray(x, np.float64)))
        want, want_x = {k: np.asarray(v) for k, v in want.items()}, np.asarray(want_x)
    # Measured (float32 layer against the float64 reference, max error over the largest entry): the input's
    # at most 4.1e-7, the parameters' at most 6.0e-7.
    assert rel_err(gx, want_x) < 2e-6
    for k in params:
        assert np.any(want[k] != 0), k
        assert rel_err(got[k], want[k]) < 2e-6, (k, rel_err(got[k], want[k]))


def test_permute_rows_gradient_is_a_gather():
    """``permute_rows``'s gradient equals that of ``a[perm]`` on random permutations, and its backward
    is a gather (autodiff of indexing would scatter-add)."""
    rng = np.random.default_rng(0)
    for n in (1, 7, 64):
        a = jnp.asarray(rng.normal(size=(n, 5)), jnp.float32)
        w = jnp.asarray(rng.normal(size=(n, 5)), jnp.float32)
        perm = jnp.asarray(rng.permutation(n), jnp.int32)
        inv = jnp.zeros_like(perm).at[perm].set(jnp.arange(n, dtype=jnp.int32))
        f = lambda a: jnp.sum(jnp.sin(M.permute_rows(a, perm, inv)) * w)
        g = lambda a: jnp.sum(jnp.sin(a[perm]) * w)
        np.testing.assert_array_equal(M.permute_rows(a, perm, inv), a[perm])
        np.testing.assert_allclose(jax.grad(f)(a), jax.grad(g)(a), rtol=1e-6, atol=1e-7)
        assert "scatter-add" not in str(jax.make_jaxpr(jax.grad(f))(a))
    # In a MoE layer's backward the only scatter-adds left are the router's ([N, E] scores) and
    # bincounts: none of model width D or expert width H (the dispatch of the token rows).
    graphdef, state = nnx.split(make(17))
    loss = lambda state, x: jnp.sum(nnx.merge(graphdef, state)(x)[0])
    text = str(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(state, inputs(20)))
    widths = [int(w) for w in re.findall(r"f32\[\d+,(\d+)\] = scatter-add", text)]
    assert widths and not set(widths) & {D, H}, widths


# ------------------------------------------------------------------------ bad configs
@pytest.mark.parametrize("kw, field", [
    (dict(top_k=E + 1), "top_k"),
    (dict(top_k=0), "top_k"),
    (dict(num_experts=0), "num_experts"),
    (dict(expert_hidden=0), "expert_hidden"),
    (dict(activation="gelu"), "activation"),
    (dict(dispatch="dense"), "dispatch"),
    (dict(capacity_factor=0.0), "capacity_factor"),
    (dict(latent_dim=0), "latent_dim"),
    (dict(num_shared_experts=-1), "num_shared_experts"),
    (dict(shared_hidden=8), "shared_hidden"),
])
def test_bad_config_raises(kw, field):
    with pytest.raises(ValueError, match=field):
        make(**kw)


def test_bad_input_raises():
    model = make()
    with pytest.raises(ValueError, match="`x`"):
        model(jnp.zeros((B * T, D)))
    with pytest.raises(ValueError, match="d_model"):
        model(jnp.zeros((B, T, D + 1)))
    with pytest.raises(ValueError, match="rule"):
        model.update_bias(model(inputs(0))[1], rule="nope", rate=0.1)


@pytest.mark.parametrize("latent", [None, 10], ids=["plain", "latent"])
def test_pallas_experts_equal_ragged_dot(latent):
    """``matmul_impl="pallas"`` (the kernels' padded layout from dispatch to combine) computes the same
    layer as ``"ragged_dot"`` (sorted rows): output, router statistics and the gradients of the input
    and every parameter, on fresh random inputs."""
    x, target = inputs(20), inputs(21)
    models = {impl: make(22, latent_dim=latent, num_shared_experts=1, matmul_impl=impl)
              for impl in ("pallas", "ragged_dot")}
    outs = {impl: m(x) for impl, m in models.items()}
    assert rel_err(outs["pallas"][0], outs["ragged_dot"][0]) < 1e-5
    np.testing.assert_array_equal(outs["pallas"][1].expert_counts, outs["ragged_dot"][1].expert_counts)
    loss = lambda m, x: jnp.sum(m(x)[0] * target)
    (gm_p, gx_p), (gm_r, gx_r) = (nnx.grad(loss, argnums=(0, 1))(models[i], x) for i in ("pallas", "ragged_dot"))
    assert rel_err(gx_p, gx_r) < 1e-5
    flat_r = dict(nnx.to_flat_state(gm_r))
    for path, g in nnx.to_flat_state(gm_p):
        assert rel_err(g[...], flat_r[path][...]) < 1e-5, path
