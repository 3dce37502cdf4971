"""Bad input to the memory functions and caches gets a ValueError naming the argument; traced values
are not read."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lineage_jax import memory as M

B, T, H, D = 1, 8, 2, 4
r = np.random.default_rng(0)
q = jnp.asarray(r.normal(size=(B, T, H, D)), jnp.float32)
k = jnp.asarray(r.normal(size=(B, T, H, D)), jnp.float32)
v = jnp.asarray(r.normal(size=(B, T, H, D)), jnp.float32)
beta = jnp.full((B, T, H), 0.5)
g_c = jnp.full((B, T, H, D), -0.1)
S = jnp.zeros((B, H, D, D))
qt, kt, vt, bt, gt = q[:, 0], k[:, 0], v[:, 0], beta[:, 0], g_c[:, 0]
nan = float("nan")


def kv_cache(**changes):
    return M.init_kv_cache(B, 16, H, D)._replace(**changes)


@pytest.mark.parametrize("call, match", [
    # beta: required by the erasing rules, finite
    (lambda: M.delta_rule(q, k, v, None), "delta_rule: `beta` is required"),
    (lambda: M.delta_corrections(k, v, None), "delta_corrections: `beta` is required"),
    (lambda: M.delta_rule(q, k, v, beta.at[0, 0, 0].set(nan)), "delta_rule: `beta` has 1 non-finite"),
    (lambda: M.delta_rule_step(qt, kt, vt, None, S), "delta_rule_step: `beta_t` is required"),
    (lambda: M.delta_rule_step(qt, kt, vt, bt * nan, S), "delta_rule_step: `beta_t` has 2 non-finite"),
    # states: finite, one array for the delta rules
    (lambda: M.delta_rule(q, k, v, beta, initial_state=jnp.full((B, H, D, D), nan)),
     "delta_rule: `initial_state` has 32 non-finite"),
    (lambda: M.delta_corrections(k, v, beta, initial_state=jnp.full((B, H, D, D), jnp.inf)),
     "delta_corrections: `initial_state` has 32 non-finite"),
    (lambda: M.delta_rule(q, k, v, beta, initial_state=jnp.zeros((B, H, D, D), jnp.int32)),
     "delta_rule: `initial_state` must be a floating-point array, got dtype int32"),
    (lambda: M.delta_corrections(k, v, beta, initial_state=np.zeros((B, H, D, D), bool)),
     "delta_corrections: `initial_state` must be a floating-point array, got dtype bool"),
    (lambda: M.linear_attention(q, k, v, normalize=True, initial_state=(S, jnp.full((B, H, D), nan))),
     "linear_attention: `initial_state` has 8 non-finite"),
    (lambda: M.delta_rule_step(qt, kt, vt, bt, (S, jnp.zeros((B, H, D)))),
     "delta_rule_step: `state` must be one array"),
    (lambda: M.delta_rule(q, k, v, beta, initial_state=(S, jnp.zeros((B, H, D)))),
     "delta_rule: `initial_state` must be one array"),
    # steps: floating inputs, a bool `normalize`, the caller's own v_t in messages
    (lambda: M.delta_rule_step(qt.astype(jnp.int32), kt, vt, bt, S), "`q_t` must be a floating-point"),
    (lambda: M.delta_rule_step(qt, kt, vt, bt.astype(jnp.int32), S), "`beta_t` must be a floating-point"),
    (lambda: M.gated_delta_rule_step(qt, kt, vt, jnp.zeros((B, H), jnp.int32), bt, S), "`g_t` must be a floating"),
    (lambda: M.linear_attention_step(qt, kt, vt, None, normalize="no"), "linear_attention_step: `normalize` must"),
    (lambda: M.linear_attention_step(qt, kt, jnp.zeros((2, H, D)), None, normalize=True),
     r"`v_t` must have shape \[B,H,V\] with B,H = \(1, 2\), got \(2, 2, 4\)"),
    (lambda: M.linear_attention(q, k, v, normalize=True, eps=nan), "linear_attention: `eps` must be a finite number"),
    (lambda: M.linear_attention(q, k, v, normalize=True, eps="x"), "linear_attention: `eps` must be"),
    (lambda: M.linear_attention_step(qt, kt, vt, None, normalize=True, eps=-1.0), "linear_attention_step: `eps`"),
    # KDA's gate bound holds on every backend
    (lambda: M.kda(q, k, v, g_c * 100, beta, gate_lower_bound=-1.0, backend="xla"),
     "kda: `g` .* below `gate_lower_bound`"),
])
def test_rules_name_the_argument(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_delta_corrections_takes_the_gate_by_keyword():
    # the rules take (q, k, v, g, beta): a positional g here would be read as beta
    with pytest.raises(TypeError, match="positional"):
        M.delta_corrections(k, v, g_c, beta)
    assert M.delta_corrections(k, v, beta, g=g_c).shape == v.shape


@pytest.mark.parametrize("call, match", [
    (lambda: M.reference_attention(jnp.zeros((B, T, 3, D)), k, v), "reference_attention: query heads H=3"),
    (lambda: M.reference_attention(q, jnp.zeros((B, T, H, 5)), v), "reference_attention: `k` must have shape"),
    (lambda: M.reference_attention(q[0], k[0], v[0]), "reference_attention: `q` must have rank 4"),
    (lambda: M.reference_attention(q, k, v, segment_ids=jnp.zeros((B, T + 1), jnp.int32)),
     "reference_attention: `segment_ids`"),
    (lambda: M.reference_attention(q, k[:, :6], v[:, :6]), "reference_attention: causal attention needs"),
    (lambda: M.softmax_attention(q, k, v, causal="no"), "softmax_attention: `causal` must be a bool"),
    (lambda: M.reference_attention(q, k, v, causal=1), "reference_attention: `causal` must be a bool"),
    (lambda: M.softmax_attention(q[:, :0], k[:, :0], v[:, :0]), "softmax_attention: `q` has T = 0 tokens"),
    (lambda: M.softmax_attention(q, k[:, :0], v[:, :0], causal=False), "softmax_attention: `k` has S = 0 tokens"),
])
def test_attention_checks_are_shared(call, match):
    with pytest.raises(ValueError, match=match):
        call()


@pytest.mark.parametrize("call, match", [
    (lambda: M.init_kv_cache(B, 16, H, D, v_head_dim=0), "init_kv_cache: `v_head_dim` must be a positive int"),
    (lambda: M.init_kv_cache(B, 16, H, D, v_head_dim=-1), "init_kv_cache: `v_head_dim`"),
    (lambda: M.init_kv_cache(True, 16, H, D), "init_kv_cache: `batch` must be a positive int, got True"),
    (lambda: M.init_kv_cache(B, 16, H, D, dtype=jnp.int32), "init_kv_cache: `dtype` must be a floating-point dtype"),
    (lambda: M.init_kv_cache(B, 16, H, D, dtype="bogus"), "init_kv_cache: `dtype` must be a floating-point dtype"),
    (lambda: M.softmax_attention_extend(q, k, v, kv_cache(k=jnp.zeros((B, 16, H, D), jnp.int32))),
     "softmax_attention_extend: `cache.k` must be a floating-point array"),
    (lambda: M.softmax_attention_extend(q.astype(jnp.int32), k, v, kv_cache()),
     "softmax_attention_extend: `q` must be a floating-point array"),
    (lambda: M.softmax_attention_step(qt.astype(jnp.int32), kt, vt, kv_cache(), read="reduce"),
     "softmax_attention_step: `q_t` must be a floating-point array"),
    (lambda: M.softmax_attention_step(qt, kt, vt, kv_cache(v=jnp.zeros((B, 16, H, D), jnp.int32)), read="reduce"),
     "softmax_attention_step: `cache.v` must be a floating-point array"),
    (lambda: M.kv_cache_from_prefill(k, v, 4.0 + 16), "kv_cache_from_prefill: `max_len`"),
    (lambda: M.softmax_attention_extend(q, k.astype(jnp.int32), v, kv_cache()),
     "softmax_attention_extend: `k` must be a floating-point array"),
    (lambda: M.softmax_attention_extend(q[:, :0], k[:, :0], v[:, :0], kv_cache()),
     "softmax_attention_extend: `q` has T = 0 tokens"),
    (lambda: M.softmax_attention_step(qt, kt, vt.astype(jnp.int32), kv_cache(), read="reduce"),
     "softmax_attention_step: `v_t` must be a floating-point array"),
    (lambda: M.kv_cache_from_prefill(k.astype(jnp.int32), v, 16), "kv_cache_from_prefill: `k` must be a floating"),
    (lambda: M.delta_corrections(k.astype(jnp.int32), v, beta), "delta_corrections: `k` must be a floating-point"),
    (lambda: M.delta_corrections(k[:, :0], v[:, :0], beta[:, :0]), "delta_corrections: `k` has T = 0 tokens"),
    (lambda: M.delta_corrections(k, v[:, :, :1], beta), r"delta_corrections: `v` must have shape .* as in k"),
    (lambda: M.linear_attention(q, k, v, normalize=True, initial_state=(S.astype(jnp.int32), S[..., 0])),
     r"linear_attention: `initial_state\[0\] \(S\)` must be a floating-point array"),
    (lambda: M.softmax_attention_extend(q, k, v, kv_cache(length=jnp.full((B,), -3, jnp.int32))),
     r"softmax_attention_extend: `cache.length` must be >= 0, got -3"),
    (lambda: M.softmax_attention_extend(q, k, v, kv_cache(length=jnp.zeros((B,)))),
     "softmax_attention_extend: `cache.length` must be an integer array"),
    (lambda: M.softmax_attention_extend(q, k, v, kv_cache(length=jnp.int32(0))),
     "softmax_attention_extend: `cache.length` must have rank 1"),
    (lambda: M.softmax_attention_extend(q, k, v, kv_cache(length=jnp.zeros((3,), jnp.int32))),
     "softmax_attention_extend: `cache.length` has batch 3, the input has batch 1"),
    (lambda: M.softmax_attention_extend(q, k, v, M.init_kv_cache(2, 16, H, D)), "softmax_attention_extend: `cache.k`"),
    (lambda: M.softmax_attention_extend(q, k, v, M.init_kv_cache(B, 16, H, 8)), "softmax_attention_extend: `cache.k`"),
    (lambda: M.softmax_attention_extend(q, k, v, kv_cache(k=jnp.zeros((16, H, D)))),
     "softmax_attention_extend: `cache.k` must have rank 4"),
    (lambda: M.softmax_attention_extend(q, k, v, kv_cache(v=jnp.zeros((B, 16, H)))),
     "softmax_attention_extend: `cache.v` must have rank 4"),
    (lambda: M.softmax_attention_extend(q, k, v, kv_cache(v=jnp.zeros((B, 10, H, D)))),
     "softmax_attention_extend: `cache.v` must have shape"),
    (lambda: M.softmax_attention_step(qt, kt, vt, kv_cache(length=jnp.full((B,), -3, jnp.int32)), read="reduce"),
     "softmax_attention_step: `cache.length` must be >= 0"),
    (lambda: M.softmax_attention_step(qt, kt, vt, M.init_kv_cache(2, 16, H, D), read="reduce"),
     "softmax_attention_step: `cache.k`"),
    (lambda: M.softmax_attention_step(qt, kt, vt, kv_cache(length=jnp.full((B,), -3, jnp.int32)), read="dot"),
     "softmax_attention_step: `cache.length` must be >= 0"),
])
def test_kv_caches_are_checked(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_numpy_integers_size_a_cache():
    c = M.init_kv_cache(np.int64(1), np.int32(16), H, D)
    assert c.k.shape == (1, 16, H, D) and isinstance(c.capacity, int)
    assert M.kv_cache_from_prefill(k, v, np.int64(16)).capacity == 16


def test_values_are_not_read_under_jit():
    """NaN beta, a NaN state and a negative cache length are refused outside ``jit`` only: traced
    values are never read (no host sync inside a compiled step)."""
    o, _ = jax.jit(M.delta_rule)(q, k, v, beta.at[0, 0, 0].set(nan))
    assert np.isnan(np.asarray(o)).any()
    o, _ = jax.jit(M.delta_rule_step)(qt, kt, vt, bt, S.at[0, 0, 0, 0].set(nan))
    assert np.isnan(np.asarray(o)).any()
    bad = kv_cache(length=jnp.full((B,), -3, jnp.int32))
    o, _ = jax.jit(M.softmax_attention_extend)(q, k, v, bad)
    assert o.shape == (B, T, H, D)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("bound", [-0.3, -1.1, -5.0])
def test_gates_at_the_bound_are_accepted(bound, dtype):
    """A gate exactly at ``gate_lower_bound`` (a saturated ``bound·σ(·)``) passes, also where float32
    cannot hold the bound; one just below it is refused."""
    M.kda(q, k, v, jnp.full((B, T, H, D), bound, dtype), beta, gate_lower_bound=bound)
    with pytest.raises(ValueError, match="below `gate_lower_bound`"):
        M.kda(q, k, v, jnp.full((B, T, H, D), bound * 1.01, dtype), beta, gate_lower_bound=bound)


def test_causal_takes_a_concrete_bool_array():
    want = M.softmax_attention(q, k, v, causal=True)
    np.testing.assert_array_equal(np.asarray(M.softmax_attention(q, k, v, causal=jnp.bool_(True))), np.asarray(want))
    with pytest.raises(ValueError, match="`causal` must be a bool"):
        M.softmax_attention(q, k, v, causal=jnp.int32(1))
