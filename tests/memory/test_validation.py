"""Bad input gets a ValueError that names the argument."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lineage_jax import memory as M

B, T, H, K, V = 2, 10, 2, 8, 4
r = np.random.default_rng(0)
q = jnp.asarray(r.normal(size=(B, T, H, K)), jnp.float32)
k = jnp.asarray(r.normal(size=(B, T, H, K)), jnp.float32)
v = jnp.asarray(r.normal(size=(B, T, H, V)), jnp.float32)
beta = jnp.full((B, T, H), 0.5)
g_s = jnp.full((B, T, H), -0.1)
g_c = jnp.full((B, T, H, K), -0.1)


@pytest.mark.parametrize("call, arg", [
    (lambda: M.delta_rule(q[0], k, v, beta), "`q`"),
    (lambda: M.delta_rule(q, k[:, :5], v, beta), "`k`"),
    (lambda: M.delta_rule(q, k, v[:, :, :1], beta), "`v`"),
    (lambda: M.delta_rule(q, k, v, beta[..., None]), "`beta`"),
    (lambda: M.gated_delta_rule(q, k, v, g_c, beta), "`g`"),
    (lambda: M.kda(q, k, v, g_s, beta), "`g`"),
    (lambda: M.kda(q, k, v, g_c, beta, initial_state=jnp.zeros((B, H, V, K))), "`initial_state`"),
    (lambda: M.kda(q, k, v, g_c, beta, segment_ids=jnp.zeros((B, T + 1), jnp.int32)), "`segment_ids`"),
    (lambda: M.kda(q, k, v, g_c, beta, segment_ids=jnp.zeros((B, T))), "`segment_ids`"),
    (lambda: M.delta_rule(q, k, v, beta, chunk_size=0), "`chunk_size`"),
    (lambda: M.delta_rule(q, k, v, beta, chunk_size=-4), "`chunk_size`"),
    (lambda: M.delta_rule(q, k, v, beta, chunk_size=16.0), "`chunk_size`"),
    (lambda: M.linear_attention(q, k, v, mode="parallel"), "`mode`"),
    (lambda: M.gated_delta_rule(q, k, v, -g_s, beta), "`g`"),
    (lambda: M.kda(q, k, v, g_c.at[0, 3, 1, 2].set(0.5), beta), "`g`"),
    (lambda: M.kda(q, k, v, g_c.at[0, 3, 1, 2].set(jnp.nan), beta), "`g`"),
    (lambda: M.gated_delta_rule(q, k, v, g_s.at[1, 1, 1].set(-jnp.inf), beta), "`g`"),
    (lambda: M.linear_attention(q, k, v, initial_state=(jnp.zeros((B, H, K, V)), jnp.zeros((B, H, K)))), "`initial_state`"),
    (lambda: M.linear_attention(q, k, v, normalize=True, initial_state=jnp.zeros((B, H, K, V))), "`initial_state`"),
    (lambda: M.delta_rule(q, k, v, beta, scale="big"), "`scale`"),
    (lambda: M.kda_step(q[:, 0], k[:, 0], v[:, 0], g_c[:, 0, :, :3], beta[:, 0], None), "`g_t`"),
    (lambda: M.kda_step(q[:, 0], k[:, 0], v[:, 0], -g_c[:, 0], beta[:, 0], None), "`g_t`"),
    (lambda: M.delta_rule_step(q[:, 0], k[:, 0], v[:, 0], beta[:, 0], jnp.zeros((B, H, K, K))), "`state`"),
    (lambda: M.delta_rule_step(q[:, 0], k[:, 0, :1], v[:, 0], beta[:, 0], None), "`k_t`"),
    (lambda: M.softmax_attention(q, k[:, :, :1], v, causal=True), "`v`"),
    (lambda: M.softmax_attention(q, k[:, :4], v[:, :4]), "`k`"),
    (lambda: M.softmax_attention(q[..., :3], k, v), "`k`"),
    (lambda: M.softmax_attention_step(q[:, 0], k[:, 0], v[:, 0], (k, v)), "`cache`"),
])
def test_bad_input_names_the_argument(call, arg):
    with pytest.raises(ValueError, match=arg):
        call()


def test_softmax_heads_must_divide():
    k3 = jnp.zeros((B, T, 3, K))
    with pytest.raises(ValueError, match="Hkv"):
        M.softmax_attention(q, k3, jnp.zeros((B, T, 3, V)))


def test_valid_inputs_are_left_untouched():
    """Validation never mutates or consumes its inputs (loses nothing)."""
    g = np.full((B, T, H, K), -0.2, np.float32)
    g_copy = g.copy()
    # Called directly (the value checks run on concrete arrays only). The checks come before either
    # form; the recurrent one runs as one scan where the chunked form would compile op by op.
    out, _ = M.kda(q, k, v, g, beta, mode="recurrent")  # the caller's own NumPy array, not a device copy
    np.testing.assert_array_equal(g, g_copy)
    assert out.shape == (B, T, H, V)


def test_gates_are_not_checked_under_jit_but_run():
    # Under jit values are abstract: the sign check is skipped (documented), shapes are still checked.
    out, _ = jax.jit(M.gated_delta_rule)(q, k, v, g_s, beta)
    assert out.shape == (B, T, H, V)
    with pytest.raises(ValueError, match="`g`"):
        jax.jit(M.gated_delta_rule)(q, k, v, g_c, beta)
