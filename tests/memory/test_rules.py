"""Property tests of the fixed-state memories (linear attention, DeltaNet, GDN, KDA)."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from lineage_jax import memory as M
from tests.memory import naive
from tests.memory.conftest import Inputs, l2norm


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


# name -> (sequence fn, inputs -> positional args, step fn, inputs -> per-token args, naive kwargs)
RULES = {
    "linear": (M.linear_attention, lambda x: (x.q, x.k, x.v), M.linear_attention_step,
               lambda x: (), lambda x: dict(erase=False)),
    "delta": (M.delta_rule, lambda x: (x.q, x.k, x.v, x.beta), M.delta_rule_step,
              lambda x: (x.beta,), lambda x: dict(beta=x.beta)),
    "gdn": (M.gated_delta_rule, lambda x: (x.q, x.k, x.v, x.g_scalar, x.beta), M.gated_delta_rule_step,
            lambda x: (x.g_scalar, x.beta), lambda x: dict(beta=x.beta, g=x.g_scalar)),
    "kda": (M.kda, lambda x: (x.q, x.k, x.v, x.g_channel, x.beta), M.kda_step,
            lambda x: (x.g_channel, x.beta), lambda x: dict(beta=x.beta, g=x.g_channel)),
}
ALL = list(RULES)


# Each rule under one ``jax.jit`` (mode and chunk size static): a call compiles one program per
# shape, where the same call run op by op compiles every operation separately (several times
# slower on XLA:CPU). Same math; test_jit_and_vmap keeps the op-by-op path equal to the jitted.
JITTED = {name: jax.jit(fn, static_argnames=("mode", "chunk_size")) for name, (fn, *_) in RULES.items()}


def run(name, x, **kw):
    _, args, *_ = RULES[name]
    return JITTED[name](*(jnp.asarray(a) for a in args(x)), **kw)


@functools.partial(jax.jit, static_argnames=("name", "mode", "chunk_size"))
def _grads(a, S0, w_o, w_s, segment_ids, *, name, mode, chunk_size):
    fn = RULES[name][0]

    def loss(a, S0):
        o, S = fn(*a, initial_state=S0, segment_ids=segment_ids, mode=mode, chunk_size=chunk_size)
        return jnp.sum(o * w_o) + jnp.sum(S * w_s)

    return jax.grad(loss, argnums=(0, 1))(a, S0)


def grads(name, x, seed, segment_ids=None, mode="chunked", chunk_size=None):
    """Gradients of a random linear functional of (o, S) w.r.t. every input and the initial state
    (one compilation per rule, mode, chunk size and shape)."""
    _, args, *_ = RULES[name]
    r = np.random.default_rng(seed + 1000)
    a = tuple(jnp.asarray(t) for t in args(x))
    S0 = jnp.asarray(x.S0)
    w_o = jnp.asarray(r.normal(size=(x.B, x.T, x.H, x.V)), jnp.float32)
    w_s = jnp.asarray(r.normal(size=S0.shape), jnp.float32)
    return _grads(a, S0, w_o, w_s, segment_ids, name=name, mode=mode, chunk_size=chunk_size)


# --------------------------------------------------------------------------- equivalences
@pytest.mark.parametrize("name", ALL)
def test_recurrent_matches_float64_reference(name):
    x = Inputs(0, T=21)
    o, S = run(name, x, mode="recurrent", initial_state=jnp.asarray(x.S0), segment_ids=jnp.asarray(x.segment_ids))
    o_ref, S_ref = naive.delta_family(*RULES[name][1](x)[:3], initial_state=x.S0, segment_ids=x.segment_ids,
                                      **RULES[name][4](x))
    assert rel_err(o, o_ref) < 2e-6 and rel_err(S, S_ref) < 2e-6


# (T, chunk) -> the rules checked there by default; the other rules there run with -m slow.
# (37, 16): every rule, odd T over several chunks with a partial last one. (100, 64): KDA, the one
# rule whose chunk of 64 takes the anchored sub-block path (four 16-token sub-blocks). (1, 64) and
# (7, 16): a chunk that is mostly padding, with a per-channel and a scalar gate.
DEFAULT_SHAPES = {(37, 16): ALL, (100, 64): ("kda",), (1, 64): ("kda",), (7, 16): ("gdn",)}
CHUNKED_CASES = [pytest.param(T, chunk, name, marks=() if name in names else pytest.mark.slow)
                 for (T, chunk), names in DEFAULT_SHAPES.items() for name in ALL]


@pytest.mark.parametrize("T,chunk,name", CHUNKED_CASES)
def test_chunked_equals_recurrent_outputs_states_and_gradients(T, chunk, name):
    """(1, 64) and (7, 16): a chunk that is mostly zero padding — the case XLA:GPU could not
    compile while the gate sums were ``jnp.cumsum`` (see ``memory.core.prefix_sum``)."""
    x = Inputs(1, T=T)
    kw = dict(segment_ids=jnp.asarray(x.segment_ids))  # T = 1 included: a one-token prefill
    o_r, S_r = run(name, x, mode="recurrent", initial_state=jnp.asarray(x.S0), **kw)
    o_c, S_c = run(name, x, mode="chunked", chunk_size=chunk, initial_state=jnp.asarray(x.S0), **kw)
    assert rel_err(o_c, o_r) <= 1e-5
    assert rel_err(S_c, S_r) <= 1e-5
    g_r = grads(name, x, 1, mode="recurrent", **kw)
    g_c = grads(name, x, 1, mode="chunked", chunk_size=chunk, **kw)
    for got, want in zip(jax.tree.leaves(g_c), jax.tree.leaves(g_r)):
        assert np.all(np.isfinite(got))
        assert rel_err(got, want) <= 1e-5


@pytest.mark.parametrize("name", ALL)
def test_chunk_size_invariance(name):
    x = Inputs(2, T=130, gate_scale=0.3)
    outs = [run(name, x, chunk_size=c, initial_state=jnp.asarray(x.S0)) for c in (16, 32, 64, 128)]
    for o, S in outs[1:]:
        assert rel_err(o, outs[0][0]) <= 1e-5 and rel_err(S, outs[0][1]) <= 1e-5


RANDOM_SHAPES = dict(
    name=st.sampled_from(ALL),
    B=st.integers(1, 2),
    T=st.integers(1, 70),
    H=st.integers(1, 3),
    K=st.sampled_from([4, 8, 16, 32]),
    V=st.sampled_from([1, 4, 8]),
    chunk=st.sampled_from([1, 3, 16, 32, 48, 64]),
    seed=st.integers(0, 2**16),
)


# Every example compiles two programs of a new shape (four with the gradients): four examples of
# the forward and one of the gradients by default, 24 of both with -m slow.
@settings(max_examples=4, deadline=None)
@given(**RANDOM_SHAPES)
def test_chunked_equals_recurrent_random_shapes(name, B, T, H, K, V, chunk, seed):
    check_random_shapes(name, B, T, H, K, V, chunk, seed, gradients=False)


@settings(max_examples=1, deadline=None)
@given(**RANDOM_SHAPES)
def test_chunked_gradients_equal_recurrent_random_shapes(name, B, T, H, K, V, chunk, seed):
    check_random_shapes(name, B, T, H, K, V, chunk, seed)


@pytest.mark.slow
@settings(max_examples=24, deadline=None)
@given(**RANDOM_SHAPES)
def test_chunked_equals_recurrent_random_shapes_more_examples(name, B, T, H, K, V, chunk, seed):
    check_random_shapes(name, B, T, H, K, V, chunk, seed)


def check_random_shapes(name, B, T, H, K, V, chunk, seed, gradients=True):
    x = Inputs(seed, B=B, T=T, H=H, K=K, V=V)
    kw = dict(initial_state=jnp.asarray(x.S0))
    if T > 1:
        kw["segment_ids"] = jnp.asarray(x.segment_ids)
    o_r, S_r = run(name, x, mode="recurrent", **kw)
    o_c, S_c = run(name, x, mode="chunked", chunk_size=chunk, **kw)
    chex.assert_shape(o_c, (B, T, H, V))
    chex.assert_shape(S_c, (B, H, K, V))
    assert rel_err(o_c, o_r) <= 1e-5 and rel_err(S_c, S_r) <= 1e-5
    if not gradients:
        return
    # Every gradient (each input and the initial state) of a random functional of (o, S).
    # Measured over 29 random examples: at most 2.2e-6 (gdn, T=1, K=32, V=8, chunk 64).
    seg = kw.get("segment_ids")
    g_r = grads(name, x, seed, segment_ids=seg, mode="recurrent")
    g_c = grads(name, x, seed, segment_ids=seg, mode="chunked", chunk_size=chunk)
    leaves_c, leaves_r = jax.tree.leaves(g_c), jax.tree.leaves(g_r)
    assert len(leaves_c) == len(leaves_r) == len(RULES[name][1](x)) + 1
    for got, want in zip(leaves_c, leaves_r):
        assert np.all(np.isfinite(got)) and np.any(want != 0)
        assert rel_err(got, want) <= 1e-5


# --------------------------------------------------------------------------- decode
@pytest.mark.parametrize("name", ALL)
def test_decode_steps_equal_sequence(name):
    x = Inputs(3, T=13)
    _, _, step, step_args, _ = RULES[name]
    o_seq, S_seq = run(name, x, initial_state=jnp.asarray(x.S0), chunk_size=8)
    S = jnp.asarray(x.S0)
    step_jit = jax.jit(step)
    for t in range(x.T):
        per_tok = [jnp.asarray(a[:, t]) for a in step_args(x)]
        o_t, S = step_jit(jnp.asarray(x.q[:, t]), jnp.asarray(x.k[:, t]), jnp.asarray(x.v[:, t]), *per_tok, S)
        assert rel_err(o_t, o_seq[:, t]) <= 1e-5
    assert rel_err(S, S_seq) <= 1e-5


@pytest.mark.parametrize("name", ALL)
def test_prefill_then_decode_equals_full_sequence(name):
    x = Inputs(4, T=29)
    _, args, step, step_args, _ = RULES[name]
    P = 20
    o_full, S_full = run(name, x, chunk_size=16)
    o_pre, S = JITTED[name](*(jnp.asarray(a[:, :P]) for a in args(x)), chunk_size=16)
    np.testing.assert_allclose(o_pre, o_full[:, :P], rtol=1e-5, atol=1e-5)
    step_jit = jax.jit(step)
    for t in range(P, x.T):
        per_tok = [jnp.asarray(a[:, t]) for a in step_args(x)]
        o_t, S = step_jit(jnp.asarray(x.q[:, t]), jnp.asarray(x.k[:, t]), jnp.asarray(x.v[:, t]), *per_tok, S)
        assert rel_err(o_t, o_full[:, t]) <= 1e-5
    assert rel_err(S, S_full) <= 1e-5


def test_normalized_linear_attention():
    x = Inputs(5, T=23)
    phi = lambda a: jax.nn.elu(jnp.asarray(a)) + 1.0  # positive features
    q, k, v = phi(x.q), phi(x.k), jnp.asarray(x.v)
    la = jax.jit(M.linear_attention, static_argnames=("normalize", "mode", "chunk_size"))
    o, (S, z) = la(q, k, v, normalize=True, chunk_size=8)
    o_r, (S_r, z_r) = la(q, k, v, normalize=True, mode="recurrent")
    # Direct formula: o_t = (q_t S_t) / (q_t . z_t + eps), S_t / z_t prefix sums, q scaled.
    sc = x.K ** -0.5
    qs, k64, v64 = np.asarray(q, np.float64) * sc, np.asarray(k, np.float64), np.asarray(v, np.float64)
    S_pref = np.cumsum(np.einsum("bthk,bthv->bthkv", k64, v64), axis=1)
    z_pref = np.cumsum(k64, axis=1)
    want = np.einsum("bthk,bthkv->bthv", qs, S_pref) / (np.einsum("bthk,bthk->bth", qs, z_pref)[..., None] + 1e-6)
    assert rel_err(o, want) < 1e-5 and rel_err(o_r, want) < 1e-5
    np.testing.assert_allclose(S, S_pref[:, -1], rtol=1e-5, atol=1e-5)  # [B,H,K,V]
    np.testing.assert_allclose(z, z_pref[:, -1], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(z_r, z, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(S_r, S_pref[:, -1], rtol=1e-5, atol=1e-5)
    # Decode with the (S, z) pair continues the sequence: a prefill of P tokens, then one step per token
    # from the pair it returns; every output and the final pair equal the direct formula's.
    P = 9
    _, state = la(q[:, :P], k[:, :P], v[:, :P], normalize=True, chunk_size=8)
    step = jax.jit(M.linear_attention_step)
    for t in range(P, x.T):
        o_t, state = step(q[:, t], k[:, t], v[:, t], state)
        assert rel_err(o_t, want[:, t]) < 1e-6, t  # measured: at most 2.3e-7
    np.testing.assert_allclose(state[0], S_pref[:, -1], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(state[1], z_pref[:, -1], rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------- memory semantics
@pytest.mark.parametrize("name", ["delta", "gdn", "kda"])
def test_beta_zero_leaves_state_unchanged(name):
    x = Inputs(6, T=19)
    x.beta = np.zeros_like(x.beta)
    x.g_scalar = np.zeros_like(x.g_scalar)
    x.g_channel = np.zeros_like(x.g_channel)
    for mode in ("chunked", "recurrent"):
        _, S = run(name, x, mode=mode, chunk_size=8, initial_state=jnp.asarray(x.S0))
        np.testing.assert_array_equal(S, x.S0)


@pytest.mark.parametrize("name", ["delta", "gdn", "kda"])
def test_beta_one_unit_key_overwrites(name):
    """beta = 1 with a unit key: reading that key returns exactly the new value."""
    r = np.random.default_rng(7)
    B, H, K, V = 2, 3, 8, 5
    S = jnp.asarray(r.normal(size=(B, H, K, V)), jnp.float32)
    k = jnp.asarray(l2norm(r.normal(size=(B, H, K))), jnp.float32)
    v = jnp.asarray(r.normal(size=(B, H, V)), jnp.float32)
    beta = jnp.ones((B, H))
    gate = {"delta": (), "gdn": (jnp.full((B, H), -0.3),), "kda": (jnp.asarray(-r.uniform(0, 1, (B, H, K)), jnp.float32),)}[name]
    step = RULES[name][2]
    o, S_new = step(k, k, v, *gate, beta, S, scale=1.0)  # query with the key itself
    np.testing.assert_allclose(o, v, atol=2e-6)
    np.testing.assert_allclose(jnp.einsum("bhk,bhkv->bhv", k, S_new), v, atol=2e-6)


@pytest.mark.parametrize("mode", ["chunked", "recurrent"])
def test_zero_gate_reduces_gdn_and_kda_to_deltanet(mode):
    x = Inputs(8, T=45)
    o_d, S_d = run("delta", x, mode=mode, chunk_size=16, initial_state=jnp.asarray(x.S0))
    x.g_scalar = np.zeros_like(x.g_scalar)
    x.g_channel = np.zeros_like(x.g_channel)
    for name in ("gdn", "kda"):
        o, S = run(name, x, mode=mode, chunk_size=16, initial_state=jnp.asarray(x.S0))
        assert rel_err(o, o_d) <= 1e-5 and rel_err(S, S_d) <= 1e-5


@pytest.mark.parametrize("mode", ["chunked", "recurrent"])
def test_channel_constant_kda_equals_gdn(mode):
    x = Inputs(9, T=45)
    x.g_channel = np.repeat(x.g_scalar[..., None], x.K, axis=-1)
    o_g, S_g = run("gdn", x, mode=mode, chunk_size=32)
    o_k, S_k = run("kda", x, mode=mode, chunk_size=32)
    assert rel_err(o_k, o_g) <= 1e-5 and rel_err(S_k, S_g) <= 1e-5


@pytest.mark.parametrize("mode", ["chunked", "recurrent"])
def test_orthogonal_keys_make_deltanet_linear_attention(mode):
    """With mutually orthogonal unit keys nothing is ever read back, so erasing is a no-op."""
    r = np.random.default_rng(10)
    B, T, H, K, V = 2, 12, 2, 16, 8
    basis = np.linalg.qr(r.normal(size=(B * H, K, K)))[0]  # orthonormal columns
    k = np.moveaxis(basis[:, :, :T].reshape(B, H, K, T), 3, 1).astype(np.float32)  # [B,T,H,K]
    q = r.normal(size=(B, T, H, K)).astype(np.float32)
    v = r.normal(size=(B, T, H, V)).astype(np.float32)
    o_d, S_d = JITTED["delta"](q, k, v, jnp.ones((B, T, H)), mode=mode, chunk_size=4)
    o_l, S_l = JITTED["linear"](q, k, v, mode=mode, chunk_size=4)
    assert rel_err(o_d, o_l) <= 1e-5 and rel_err(S_d, S_l) <= 1e-5


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("mode", ["chunked", "recurrent"])
def test_segment_ids_equal_separate_runs(name, mode):
    x = Inputs(11, B=1, T=40)
    seg = np.zeros((1, 40), np.int32)
    seg[:, 13:] = 5
    seg[:, 31:] = 2
    o, S = run(name, x, mode=mode, chunk_size=16, segment_ids=jnp.asarray(seg), initial_state=jnp.asarray(x.S0))
    _, args, *_ = RULES[name]
    pieces, state = [], jnp.asarray(x.S0)
    for lo, hi in ((0, 13), (13, 31), (31, 40)):
        o_p, S_p = JITTED[name](*(jnp.asarray(a[:, lo:hi]) for a in args(x)), mode=mode, chunk_size=16,
                                  initial_state=state if lo == 0 else None)
        pieces.append(o_p)
    assert rel_err(o, jnp.concatenate(pieces, axis=1)) <= 1e-5
    assert rel_err(S, S_p) <= 1e-5


@pytest.mark.parametrize("name", ["gdn", "kda"])
@pytest.mark.parametrize("mixed", [False, True])
def test_strong_gates_stay_finite(name, mixed):
    """-20 per token: chunk sums reach -1280, far past exp's range; outputs and grads stay finite."""
    x = Inputs(12, T=70, K=32)
    slam = x.rng.uniform(size=x.g_channel.shape) < (0.5 if mixed else 1.0)
    # Mixed: slammed (-20) and open (-0.01) gates per token and channel. Differences of long
    # cumulative sums would lose ~1e-4 absolute here; the chunked form must not.
    x.g_channel = np.where(slam, -20.0, -0.01).astype(np.float32)
    x.g_scalar = x.g_channel[..., 0].copy()
    o_c, S_c = run(name, x, chunk_size=64, initial_state=jnp.asarray(x.S0))
    o_r, S_r = run(name, x, mode="recurrent", initial_state=jnp.asarray(x.S0))
    assert np.all(np.isfinite(o_c)) and np.all(np.isfinite(S_c))
    assert rel_err(o_c, o_r) <= 1e-5 and rel_err(S_c, S_r) <= 1e-5
    g_c, g_r = grads(name, x, 12, chunk_size=64), grads(name, x, 12, mode="recurrent")
    for g in (g_c, g_r):
        for leaf in jax.tree.leaves(g):
            assert np.all(np.isfinite(leaf))
    for got, want in zip(jax.tree.leaves(g_c), jax.tree.leaves(g_r)):
        assert rel_err(got, want) <= 1e-5


@pytest.mark.parametrize("name", ALL)
def test_bf16_inputs_close_to_float32(name):
    x = Inputs(13, T=50)
    for attr in ("q", "k", "v", "beta", "g_scalar", "g_channel"):  # same values, two dtypes
        setattr(x, attr, np.asarray(jnp.asarray(getattr(x, attr), jnp.bfloat16).astype(jnp.float32)))
    fn, args = JITTED[name], RULES[name][1]
    o32, S32 = fn(*(jnp.asarray(a) for a in args(x)), chunk_size=16)
    o16, S16 = fn(*(jnp.asarray(a, jnp.bfloat16) for a in args(x)), chunk_size=16)
    assert o16.dtype == jnp.bfloat16 and S16.dtype == jnp.float32
    assert rel_err(o16, o32) <= 1e-2 and rel_err(S16, S32) <= 1e-5


# DeltaNet and GDN (-m slow) run the same chunked core as KDA, whose per-channel gate is the most general
# edit of it; linear attention is its own function. (Op by op, each rule compiles ~10 s of operations.)
@pytest.mark.xdist_group("rules_op_by_op")  # one worker: the rules' op-by-op calls share their operations
@pytest.mark.parametrize("name", [n if n in ("linear", "kda") else pytest.param(n, marks=pytest.mark.slow)
                                  for n in ALL])
def test_jit_and_vmap(name):
    x = Inputs(14, T=17)
    fn, args, *_ = RULES[name]
    a = tuple(jnp.asarray(t) for t in args(x))
    o, S = fn(*a, chunk_size=8)
    o_j, S_j = jax.jit(functools.partial(fn, chunk_size=8))(*a)
    np.testing.assert_allclose(o_j, o, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(S_j, S, rtol=1e-5, atol=1e-6)
    # vmap over an extra leading axis (two copies of the batch); jitted, so the batched rule
    # compiles as one program rather than op by op a second time.
    o_v, S_v = jax.jit(jax.vmap(functools.partial(fn, chunk_size=8)))(*(jnp.stack([t, t]) for t in a))
    np.testing.assert_allclose(o_v[1], o, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(S_v[0], S, rtol=1e-5, atol=1e-6)


def test_float64_inputs_compute_in_float64():
    x = Inputs(15, T=33)
    with jax.enable_x64(True):
        a = [jnp.asarray(t, jnp.float64) for t in (x.q, x.k, x.v, x.g_channel, x.beta)]
        o, S = JITTED["kda"](*a, chunk_size=16, segment_ids=jnp.asarray(x.segment_ids))
        assert o.dtype == jnp.float64 and S.dtype == jnp.float64
        o_ref, S_ref = naive.delta_family(x.q, x.k, x.v, beta=x.beta, g=x.g_channel, segment_ids=x.segment_ids)
        assert rel_err(o, o_ref) < 1e-12 and rel_err(S, S_ref) < 1e-12


# --------------------------------------------------------------------------- the switches given directly
NAMED_SETTINGS = [("linear", {}), ("delta", dict(erase=True)), ("gdn", dict(gate="scalar", erase=True)),
                  ("kda", dict(gate="channel", erase=True))]


def _switch_args(x, gate, erase):
    return dict(g=None if gate == "none" else jnp.asarray(x.g_scalar if gate == "scalar" else x.g_channel),
                beta=jnp.asarray(x.beta) if erase else None)


@pytest.mark.parametrize("name,switches", NAMED_SETTINGS)
def test_update_rule_gives_each_named_rule(name, switches):
    x = Inputs(3, T=21)
    kw = dict(initial_state=jnp.asarray(x.S0), segment_ids=jnp.asarray(x.segment_ids))
    o, S = run(name, x, **kw)
    args = _switch_args(x, switches.get("gate", "none"), switches.get("erase", False))
    o2, S2 = M.update_rule(jnp.asarray(x.q), jnp.asarray(x.k), jnp.asarray(x.v), **args, **switches, **kw)
    assert rel_err(o2, o) <= 1e-6 and rel_err(S2, S) <= 1e-6


@pytest.mark.parametrize("gate,erase", [("channel", False), ("scalar", False), ("none", True)])
def test_update_rule_unnamed_settings(gate, erase):
    """GLA (per-channel gate, no erase) and the other settings no named rule covers: the recurrence equals the
    float64 reference, the chunked form the recurrence (outputs, state and every gradient), the steps the
    sequence."""
    x = Inputs(4, T=23)
    args = _switch_args(x, gate, erase)
    q, k, v, S0 = (jnp.asarray(a) for a in (x.q, x.k, x.v, x.S0))
    f = functools.partial(M.update_rule, gate=gate, erase=erase, initial_state=S0)
    o_r, S_r = f(q, k, v, mode="recurrent", **args)
    o_ref, S_ref = naive.delta_family(x.q, x.k, x.v, beta=x.beta if erase else None, erase=erase,
                                      g=None if args["g"] is None else np.asarray(args["g"]), initial_state=x.S0)
    assert rel_err(o_r, o_ref) < 2e-6 and rel_err(S_r, S_ref) < 2e-6
    o_c, S_c = f(q, k, v, mode="chunked", chunk_size=8, **args)
    assert rel_err(o_c, o_r) <= 1e-5 and rel_err(S_c, S_r) <= 1e-5
    r = np.random.default_rng(5)
    w_o, w_s = jnp.asarray(r.normal(size=o_r.shape), jnp.float32), jnp.asarray(r.normal(size=S_r.shape), jnp.float32)

    def loss(mode, q, k, v, a):
        o, S = f(q, k, v, mode=mode, chunk_size=8 if mode == "chunked" else None, **a)
        return jnp.sum(o * w_o) + jnp.sum(S * w_s)

    a = {n: t for n, t in args.items() if t is not None}
    g_r = jax.grad(functools.partial(loss, "recurrent"), argnums=(0, 1, 2, 3))(q, k, v, a)
    g_c = jax.grad(functools.partial(loss, "chunked"), argnums=(0, 1, 2, 3))(q, k, v, a)
    for got, want in zip(jax.tree.leaves(g_c), jax.tree.leaves(g_r)):
        assert rel_err(got, want) <= 1e-5
    S = S0
    for t in range(x.T):  # every step's output against the sequence's, then the final state
        o_t, S = M.update_rule_step(q[:, t], k[:, t], v[:, t], S, gate=gate, erase=erase,
                                    g_t=None if args["g"] is None else args["g"][:, t],
                                    beta_t=None if args["beta"] is None else args["beta"][:, t])
        assert rel_err(o_t, o_r[:, t]) <= 1e-5, t
    assert rel_err(S, S_r) <= 1e-5


def test_update_rule_switches_are_checked():
    x = Inputs(6, T=5)
    q, k, v, gc = (jnp.asarray(a) for a in (x.q, x.k, x.v, x.g_channel))
    for kw, needle in [(dict(gate="diag", g=gc), "`gate` must be one of"),
                       (dict(erase=0.5), "`erase` must be a bool"),
                       (dict(erase=True), "`erase=True` needs `beta`"),
                       (dict(gate="channel"), "gate='channel' needs `g`"),
                       (dict(g=gc), "`g` is given where `gate` is 'none'")]:
        with pytest.raises(ValueError, match=f"update_rule: {needle}"):
            M.update_rule(q, k, v, **kw)
    with pytest.raises(ValueError, match="update_rule_step: `erase` must be a bool"):
        M.update_rule_step(q[:, 0], k[:, 0], v[:, 0], None, erase="yes")
