"""FFNs: SiTU's bound, the gated activations, and MLP shapes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings, strategies as st

from lineage_jax.layers.ffn import MLP, glu, situ


@settings(max_examples=50, deadline=None)
@given(st.floats(-1e6, 1e6), st.floats(-1e6, 1e6))
def test_situ_is_bounded_by_beta1_beta2(g, u):
    out = float(situ(jnp.float32(g), jnp.float32(u)))
    assert np.isfinite(out) and abs(out) <= 4.0 * 25.0


def test_situ_formula_and_limits():
    g = jnp.linspace(-30, 30, 101)
    u = jnp.linspace(-200, 200, 101)
    want = (4 * np.tanh(np.asarray(g) / 4) / (1 + np.exp(-np.asarray(g)))) * (25 * np.tanh(np.asarray(u) / 25))
    np.testing.assert_allclose(situ(g, u), want, rtol=1e-5, atol=1e-5)
    assert float(jnp.max(jnp.abs(situ(jnp.full(3, 1e4), jnp.full(3, 1e4))))) == pytest.approx(100.0, rel=1e-5)
    # bf16 in, bf16 out, computed in float32 inside.
    assert situ(g.astype(jnp.bfloat16), u.astype(jnp.bfloat16)).dtype == jnp.bfloat16


def test_swiglu():
    g, u = jnp.asarray([-1.0, 0.0, 2.0]), jnp.asarray([3.0, 1.0, -1.0])
    np.testing.assert_allclose(glu("swiglu", g, u), jax.nn.silu(g) * u, rtol=1e-6)
    with pytest.raises(ValueError, match="kind"):
        glu("relu", g, u)


def _mlp_reference(kind, w, x):
    """float64 NumPy MLP from the parameters ``w`` ({"up/kernel": ...}): tanh-approximate GELU,
    SiLU and SiTU written out."""
    sig = lambda z: 1 / (1 + np.exp(-z))  # noqa: E731
    lin = lambda name, z: z @ w[f"{name}/kernel"] + w.get(f"{name}/bias", 0.0)  # noqa: E731
    if kind == "gelu":
        u = lin("up", x)
        return lin("down", 0.5 * u * (1 + np.tanh(np.sqrt(2 / np.pi) * (u + 0.044715 * u ** 3))))
    g, u = lin("gate", x), lin("up", x)
    h = g * sig(g) * u if kind == "swiglu" else 4 * np.tanh(g / 4) * sig(g) * 25 * np.tanh(u / 25)
    return lin("down", h)


@pytest.mark.parametrize("kind", ["gelu", "swiglu", "situ"])
def test_mlp(kind):
    m = MLP(8, 16, kind=kind, rngs=nnx.Rngs(0))
    # Random parameters of unit scale (biases included, zero at init), so every activation works
    # outside its near-linear range and the biases count.
    r = np.random.default_rng(1)
    w = {}
    for path, v in nnx.to_flat_state(nnx.state(m, nnx.Param)):
        v[...] = jnp.asarray(r.normal(size=v[...].shape) * (2.0 if path[-1] == "bias" else 1.0), jnp.float32)
        w["/".join(map(str, path))] = np.asarray(v[...], np.float64)
    x = r.normal(size=(2, 3, 8))
    y = m(jnp.asarray(x, jnp.float32))
    assert y.shape == (2, 3, 8)
    want = _mlp_reference(kind, w, x)
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5 * np.max(np.abs(want)))
    n = sum(int(np.prod(p.shape)) for p in jax.tree.leaves(nnx.state(m, nnx.Param)))
    assert n == (8 * 16 + 16 + 16 * 8 + 8 if kind == "gelu" else 3 * 8 * 16)
    with pytest.raises(ValueError, match="kind"):
        MLP(8, 16, kind="relu", rngs=nnx.Rngs(0))
