"""The kernels' public entry points (``chunk_delta_rule``, ``chunk_gated_delta_rule``, ``chunk_kda``)
refuse bad arrays with a ValueError naming the function and the argument, before any kernel runs;
traced values are not read."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels.delta import api as kd

B, T, H, D = 1, 8, 2, 4
r = np.random.default_rng(0)
q = jnp.asarray(r.normal(size=(B, T, H, D)), jnp.float32)
k = jnp.asarray(r.normal(size=(B, T, H, D)), jnp.float32)
v = jnp.asarray(r.normal(size=(B, T, H, D)), jnp.float32)
beta = jnp.full((B, T, H), 0.5)
g_s = jnp.full((B, T, H), -0.1)
g_c = jnp.full((B, T, H, D), -0.1)
nan = float("nan")


@pytest.mark.parametrize("call, match", [
    (lambda: kd.chunk_delta_rule(q[0], k, v, beta), r"chunk_delta_rule: `q` must be \[B, T, H, K\]"),
    (lambda: kd.chunk_delta_rule(q, jnp.zeros((B, T, 3, D)), v, beta), r"chunk_delta_rule: `k` must have shape"),
    (lambda: kd.chunk_delta_rule(q, jnp.zeros((B, T, H, 5)), v, beta), r"chunk_delta_rule: `k` must have shape"),
    (lambda: kd.chunk_delta_rule(q, k, jnp.zeros((B, 7, H, D)), beta), r"chunk_delta_rule: `v` must be"),
    (lambda: kd.chunk_delta_rule(q, k, v, None), r"chunk_delta_rule: `beta` is required"),
    (lambda: kd.chunk_delta_rule(q, k, v, beta[..., None]), r"chunk_delta_rule: `beta` must have shape"),
    (lambda: kd.chunk_delta_rule(q, k, v, beta, initial_state=jnp.zeros((B, H, 2, 2))),
     r"chunk_delta_rule: `initial_state` must have shape"),
    (lambda: kd.chunk_delta_rule(q, k, v, beta, initial_state=jnp.zeros((B, H, 8, 8))),
     r"chunk_delta_rule: `initial_state` must have shape"),
    (lambda: kd.chunk_delta_rule(q, k, v, beta, segment_ids=jnp.zeros((B, T + 1), jnp.int32)),
     r"chunk_delta_rule: `segment_ids` must have shape"),
    (lambda: kd.chunk_delta_rule(q, k, v, beta, segment_ids=jnp.zeros((B, T))),
     r"chunk_delta_rule: `segment_ids` must be an integer array"),
    (lambda: kd.chunk_gated_delta_rule(q, k, v, g_c, beta), r"chunk_gated_delta_rule: `g` must have shape"),
    (lambda: kd.chunk_gated_delta_rule(q, k, v, None, beta), r"chunk_gated_delta_rule: `g` is required"),
    (lambda: kd.chunk_kda(q, k, v, g_s, beta), r"chunk_kda: `g` must have shape \[B, T, H, K\]"),
    (lambda: kd.chunk_delta_rule(q[:, :0], k[:, :0], v[:, :0], beta[:, :0]), r"chunk_delta_rule: `q` has T = 0 tokens"),
    (lambda: kd.chunk_kda(q, k, v, g_c, beta, scale=nan), r"chunk_kda: `scale` must be a finite real number"),
    (lambda: kd.chunk_gated_delta_rule(q, k, v, g_s, beta, scale="x"), r"chunk_gated_delta_rule: `scale` must be"),
    (lambda: kd.chunk_delta_rule(q, k, v, beta, scale=jnp.ones(2)), r"chunk_delta_rule: `scale` must be"),
    (lambda: jax.jit(lambda s: kd.chunk_delta_rule(q, k, v, beta, scale=s))(0.5),
     r"chunk_delta_rule: `scale` must be a concrete number"),
    # dtypes
    (lambda: kd.chunk_delta_rule(q.astype(jnp.int32), k, v, beta), r"chunk_delta_rule: `q` must be a floating-point"),
    (lambda: kd.chunk_delta_rule(q, k, v.astype(jnp.complex64), beta), r"chunk_delta_rule: `v` must be a floating"),
    (lambda: kd.chunk_delta_rule(q, k, v, beta > 0), r"chunk_delta_rule: `beta` must be a floating-point"),
    (lambda: kd.chunk_gated_delta_rule(q, k, v, jnp.zeros((B, T, H), jnp.int32), beta),
     r"chunk_gated_delta_rule: `g` must be a floating-point"),
    (lambda: kd.chunk_kda(q, k, v, g_c, beta, initial_state=jnp.zeros((B, H, D, D), jnp.int32)),
     r"chunk_kda: `initial_state` must be a floating-point"),
    # launch knobs
    (lambda: kd.chunk_delta_rule(q, k, v, beta, bv=32), r"`bv` must be a power of two dividing the padded value dim"),
    (lambda: kd.chunk_delta_rule(q, k, v, beta, bv=3), r"`bv` must be a power of two"),
    (lambda: kd.chunk_kda(q, k, v, g_c, beta, bv=0), r"`bv` must be a power of two"),
    (lambda: kd.chunk_delta_rule(q, k, v, beta, target="gpu", bv=8), r"`bv` must be .* >= 16 on GPUs"),
    (lambda: kd.chunk_delta_rule(q, k, v, beta, num_stages_state="x"), r"`num_stages_state` must be a positive int"),
    (lambda: kd.chunk_delta_rule(q, k, v, beta, state_dtype="bogus"), r"`state_dtype` must be bfloat16, float16"),
    (lambda: kd.chunk_delta_rule(q, k, v, beta, state_dtype=jnp.int32), r"`state_dtype` must be"),
    # values, on concrete arrays
    (lambda: kd.chunk_gated_delta_rule(q, k, v, -g_s, beta), r"chunk_gated_delta_rule: `g` \(log-decay\) must be <= 0"),
    (lambda: kd.chunk_kda(q, k, v, g_c.at[0, 0, 0, 0].set(nan), beta), r"chunk_kda: `g` has 1 non-finite"),
    (lambda: kd.chunk_delta_rule(q, k, v, beta.at[0, 1, 1].set(nan)), r"chunk_delta_rule: `beta` has 1 non-finite"),
    (lambda: kd.chunk_kda(q, k, v, g_c, beta, initial_state=jnp.full((B, H, D, D), jnp.inf)),
     r"chunk_kda: `initial_state` has 32 non-finite"),
])
def test_entry_points_name_the_argument(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_traced_values_are_not_read(monkeypatch):
    """Under tracing the shape checks run and the values are left alone (the kernels are stubbed out:
    only the entry point's checks are traced)."""
    monkeypatch.setattr(kd, "_delta", lambda q, k, v, g, beta, **kw: (v, None))
    out = jax.eval_shape(lambda g: kd.chunk_kda(q, k, v, g, beta), g_c.at[0, 0, 0, 0].set(nan))
    assert out[0].shape == (B, T, H, D)
    with pytest.raises(ValueError, match=r"chunk_kda: `g` must have shape"):
        jax.eval_shape(lambda g: kd.chunk_kda(q, k, v, g, beta), g_s)


@pytest.mark.parametrize("bound", [-0.3, -1.1])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_gates_at_the_bound_are_accepted(bound, dtype, monkeypatch):
    """The bounded-gate check compares in the gates' own dtype (as the library's does): a gate at a bound that
    dtype cannot hold passes; a gate below it is refused naming the entry point."""
    monkeypatch.setattr(kd, "_delta", lambda q, k, v, g, beta, **kw: (v, None))
    kd.chunk_kda(q, k, v, jnp.full((B, T, H, D), bound, dtype), beta, gate_lower_bound=bound)
    with pytest.raises(ValueError, match=r"chunk_kda: `gate_lower_bound=.*` is set but the gates reach"):
        kd.chunk_kda(q, k, v, jnp.full((B, T, H, D), bound * 1.02, dtype), beta, gate_lower_bound=bound)


def test_scale_takes_any_finite_real_number():
    """A NumPy scalar or a concrete 0-d array is a scale; negative and zero scales compute what the reference
    does (the library's XLA form takes them too)."""
    from kernels.delta import reference as kref
    o1, _ = kd.chunk_delta_rule(q, k, v, beta, scale=jnp.float32(0.5))
    o2, _ = kd.chunk_delta_rule(q, k, v, beta, scale=np.float64(0.5))
    np.testing.assert_array_equal(np.asarray(o1), np.asarray(o2))
    for scale in (-0.7, 0.0):
        o, S = kd.chunk_gated_delta_rule(q, k, v, g_s, beta, scale=scale)
        o_ref, S_ref = kref.recurrent(q, k, v, beta, g_s, scale=scale)
        np.testing.assert_allclose(np.asarray(o), np.asarray(o_ref), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(np.asarray(S), np.asarray(S_ref), rtol=1e-5, atol=1e-6)


def test_a_misspelt_knob_is_named_by_the_entry_point():
    with pytest.raises(TypeError, match=r"chunk_kda: unknown keyword 'mode'; the launch knobs are .*num_warps"):
        kd.chunk_kda(q, k, v, g_c, beta, mode="chunked")
    with pytest.raises(TypeError, match=r"chunk_delta_rule: unknown keyword 'num_warp'"):
        kd.chunk_delta_rule(q, k, v, beta, num_warp=4)
    with pytest.raises(ValueError, match=r"per-channel"):  # KDA's alone, refused with its own message
        kd.chunk_gated_delta_rule(q, k, v, g_s, beta, gate_lower_bound=-5.0)


def test_a_numpy_chunk_size_is_a_chunk_size():
    o, _ = kd.chunk_delta_rule(q, k, v, beta, chunk_size=np.int64(16))
    ref, _ = kd.chunk_delta_rule(q, k, v, beta, chunk_size=16)
    np.testing.assert_array_equal(np.asarray(o), np.asarray(ref))


def test_an_empty_batch_reaches_the_kernels(monkeypatch):
    monkeypatch.setattr(kd, "_delta", lambda q, k, v, g, beta, **kw: (v, None))
    z = jnp.zeros((0, T, H, D))
    assert kd.chunk_kda(z, z, z, z, jnp.zeros((0, T, H)))[0].shape == (0, T, H, D)
