"""The "dots" remat policy keeps the forward outputs of cuDNN's fused attention, so the backward
pass does not rerun it. cuDNN does not run on the CPU: a stand-in primitive with the name and
structure of JAX's (a ``custom_vjp`` whose forward rule binds one primitive returning the output
and the softmax statistics, both read by the backward rule) is counted in the differentiated
program instead; on a GPU the same count is taken on ``jax.nn.dot_product_attention`` itself."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend import core as jex_core

from lineage_jax.models.decoder import CUDNN_ATTENTION_FWD, remat_policy
from tests._jaxpr import live_calls

_fwd_p = jex_core.Primitive(CUDNN_ATTENTION_FWD[0])
_fwd_p.multiple_results = True


def _fwd_impl(q, k, v):
    s = jnp.einsum("td,sd->ts", q, k)
    lse = jax.nn.logsumexp(s, axis=-1)
    return jnp.exp(s - lse[:, None]) @ v, lse


_fwd_p.def_impl(_fwd_impl)
_fwd_p.def_abstract_eval(lambda q, k, v: (jax.core.ShapedArray(q.shape[:1] + v.shape[1:], v.dtype),
                                          jax.core.ShapedArray(q.shape[:1], q.dtype)))


@jax.custom_vjp
def attention(q, k, v):
    return _fwd_p.bind(q, k, v)[0]


def _attention_fwd(q, k, v):
    out, lse = _fwd_p.bind(q, k, v)
    return out, (q, k, v, out, lse)


def _attention_bwd(res, g):
    q, k, v, out, lse = res
    p = jnp.exp(jnp.einsum("td,sd->ts", q, k) - lse[:, None])
    dv = p.T @ g
    dp = g @ v.T
    ds = p * (dp - jnp.sum(g * out, axis=-1, keepdims=True))
    return ds @ k, ds.T @ q, dv


attention.defvjp(_attention_fwd, _attention_bwd)


def _layer(w, x, attn):
    h = jnp.tanh(x @ w)
    return jnp.sum(jnp.sin(attn(h, h * 0.5, h + 1.0)))


@pytest.mark.parametrize("policy,runs", [("dots", 1), ("full", 2)])
def test_dots_keeps_the_attention_forward(policy, runs):
    """Under "dots" the attention forward runs once in a training step's program (value and
    gradient; its outputs saved); under "full" the backward pass reruns it. The gradient is the
    same either way."""
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.normal(size=(8, 8)) / 3, jnp.float32)
    x = jnp.asarray(rng.normal(size=(6, 8)), jnp.float32)
    f = jax.checkpoint(lambda w: _layer(w, x, attention), policy=remat_policy(policy))
    jaxpr = jax.make_jaxpr(jax.value_and_grad(f))(w).jaxpr
    assert live_calls(jaxpr, CUDNN_ATTENTION_FWD) == runs
    want = jax.grad(lambda w: _layer(w, x, lambda q, k, v: _fwd_impl(q, k, v)[0]))(w)
    np.testing.assert_allclose(jax.grad(f)(w), want, rtol=1e-5, atol=1e-6)


def test_dots_keeps_cudnn_attention_forward_on_a_gpu():
    """The same count on ``jax.nn.dot_product_attention(implementation="cudnn")``: one forward
    launch in the gradient program under "dots"."""
    if jax.default_backend() != "gpu":
        pytest.skip("cuDNN attention needs a GPU")
    q = jnp.zeros((1, 64, 2, 64), jnp.bfloat16)
    attn = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
    f = jax.checkpoint(lambda q: jnp.sum(attn(q * 2, q, q).astype(jnp.float32)), policy=remat_policy("dots"))
    jaxpr = jax.make_jaxpr(jax.value_and_grad(f))(q).jaxpr
    assert live_calls(jaxpr, CUDNN_ATTENTION_FWD) == 1
