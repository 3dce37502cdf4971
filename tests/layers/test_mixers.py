"""Token mixers: decode after prefill equals the training call, for every fixed-state rule and softmax."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lineage_jax.layers.attention import Attention
from lineage_jax.layers.memory_mixer import MemoryMixer, causal_conv
from tests._gradcheck import directional_derivatives

D = 24


def make(kind, **kw):
    rngs = nnx.Rngs(0)
    if kind == "softmax":
        return Attention(D, num_heads=4, head_dim=6, num_kv_heads=2, use_bias=True, rngs=rngs, **kw)
    # The XLA chunked form with 8-token chunks (several chunks, resets inside them) on every backend;
    # the kernels' path is tested in tests/kernels and by test_bounded_kda_gate_and_chunk_size_reach_the_kernel.
    kw.setdefault("backend", "xla")
    return MemoryMixer(D, rule=kind, num_heads=3, head_dim=8, v_head_dim=5, chunk_size=8, rngs=rngs, **kw)


CASES = [("softmax", {}), ("linear", {}), ("deltanet", {}), ("deltanet", {"conv_size": 0}), ("gdn", {}),
         ("kda", {}), ("kda", {"kda_gate": "bounded", "output_gate": "full"}), ("kda", {"gate_rank": 3}),
         ("softmax", {"decode_read": "reduce"}), ("softmax", {"rope_theta": 100.0}),
         ("gdn", {"num_v_heads": 6}), ("kda", {"num_v_heads": 6, "kda_gate": "bounded"})]


call = nnx.jit(lambda m, x: m(x))
call_segments = nnx.jit(lambda m, x, s: m(x, segment_ids=s))
gate_inputs = nnx.jit(lambda m, x: m._inputs(x, None, None)[3:5])  # the layer's (g, beta)
prefill = nnx.jit(lambda m, x, c: m.prefill(x, c))
decode = nnx.jit(lambda m, x, c: m.decode(x, c))


def rel(a, b):
    return float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))


@pytest.mark.parametrize("kind,kw", CASES)
def test_prefill_then_decode_equals_call(kind, kw):
    layer = make(kind, **kw)
    x = jax.random.normal(jax.random.key(1), (2, 13, D))
    y = call(layer, x)
    assert y.shape == x.shape and np.all(np.isfinite(y))
    cache = layer.init_cache(2, 16)
    P = 6
    y_pre, cache = prefill(layer, x[:, :P], cache)
    assert rel(y_pre, y[:, :P]) <= 1e-5
    for t in range(P, 13):
        y_t, cache = decode(layer, x[:, t], cache)
        assert rel(y_t, y[:, t]) <= 1e-5, t
    # Prefill in two pieces equals one (the first piece the prefill above, compiled already).
    c2 = layer.init_cache(2, 16)
    a, c2 = prefill(layer, x[:, :P], c2)
    b, c2 = prefill(layer, x[:, P:13], c2)
    assert rel(jnp.concatenate([a, b], 1), y) <= 1e-5


@pytest.mark.parametrize("kind,kw", CASES[:2] + CASES[4:6] + CASES[-1:])
def test_segments_equal_separate_runs(kind, kw):
    # (For RoPE attention this is also the relative-position check: the second document starts
    # at position 5 in the packed row and at 0 alone.)
    layer = make(kind, **kw)
    x = jax.random.normal(jax.random.key(2), (1, 12, D))
    seg = jnp.asarray([[0] * 5 + [1] * 7])
    y = call_segments(layer, x, seg)
    want = jnp.concatenate([call(layer, x[:, :5]), call(layer, x[:, 5:])], axis=1)
    assert rel(y, want) <= 1e-5


def check_gradients(layer, x, *, zero=(), tol=3e-2):
    """The gradients of ``sum(layer(x) * w)`` with respect to every parameter and to ``x`` against
    finite differences (two random directions per argument, :func:`tests._gradcheck.directional_derivatives`):
    each finite, nonzero and within ``tol`` of the numeric derivative relative to its norm. ``zero``:
    parameters whose gradient is exactly zero in exact arithmetic (checked to be ~0 both ways)."""
    graphdef, params, rest = nnx.split(layer, nnx.Param, ...)
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    names = ["/".join(str(getattr(k, "key", k)) for k in path[:-1]) for path, _ in flat] + ["x"]
    treedef = jax.tree.structure(params)
    w = jax.random.normal(jax.random.key(4), x.shape)
    loss = lambda a: jnp.sum(nnx.merge(graphdef, jax.tree.unflatten(treedef, a[:-1]), rest)(a[-1]) * w)
    grads, pairs = directional_derivatives(loss, [v for _, v in flat] + [x])
    assert set(zero) <= set(names) and len(names) > 2
    scale = max(float(np.linalg.norm(g)) for g in grads)
    errors = {}
    for name, g, pair in zip(names, grads, pairs):
        assert np.all(np.isfinite(g)), name
        if name in zero:
            assert np.max(np.abs(g)) <= 1e-6 * scale and all(abs(n) <= 1e-3 * scale for n, _ in pair), name
            continue
        norm = float(np.linalg.norm(g))
        assert norm > 0, f"{name}: zero gradient"
        errors[name] = max(abs(n - a) / norm for n, a in pair)
    assert max(errors.values()) < tol, errors
    return errors


@pytest.mark.parametrize("kind,kw", CASES)
def test_gradients_match_finite_differences(kind, kw):
    """Every parameter's gradient (and the input's) against finite differences of the layer."""
    layer = make(kind, **kw)
    x = jax.random.normal(jax.random.key(3), (2, 9, D))
    # Softmax attention without RoPE is invariant to the key bias (it shifts each query's scores by one
    # constant); rotated, the bias differs per position and has a gradient.
    # Measured (float32, step 1e-3): worst error 9.9e-3 over these cases (kda with gate_rank=3, A_log).
    check_gradients(layer, x, zero=("k/bias",) if kind == "softmax" and "rope_theta" not in kw else ())


def test_causal_conv_respects_documents_and_prefix():
    r = np.random.default_rng(0)
    x = jnp.asarray(r.normal(size=(1, 7, 3)), jnp.float32)
    w = jnp.asarray(r.normal(size=(4, 3)), jnp.float32)
    doc = jnp.asarray([[0, 0, 0, 1, 1, 1, 1]])
    y, _ = causal_conv(x, w, None, doc)
    want = np.zeros((7, 3))
    for t in range(7):
        for i in range(4):
            if t - i >= 0 and doc[0, t - i] == doc[0, t]:
                want[t] += np.asarray(w[i]) * np.asarray(x[0, t - i])
    np.testing.assert_allclose(y[0], want, rtol=1e-5, atol=1e-6)


def test_kda_gates_are_log_decays_and_bounded():
    layer = make("kda", kda_gate="bounded")
    x = 50.0 * jax.random.normal(jax.random.key(4), (2, 5, D))
    g, beta = gate_inputs(layer, x)
    assert g.shape == (2, 5, 3, 8) and bool(jnp.all(g <= 0)) and bool(jnp.all(g >= -5.0))
    layer = make("gdn")
    g, _ = gate_inputs(layer, x)
    assert g.shape == (2, 5, 3) and bool(jnp.all(g <= 0))


@pytest.mark.parametrize("bad", [dict(rule="mamba"), dict(rule="kda", num_heads=0), dict(rule="kda", kda_gate="tanh"),
                                 dict(rule="kda", output_gate="mid"), dict(rule="kda", conv_size=1),
                                 dict(rule="gdn", gate_activation="relu")])
def test_bad_config_names_field(bad):
    kw = dict(num_heads=2, head_dim=4, rngs=nnx.Rngs(0))
    kw.update(bad)
    field = [k for k in bad if k != "rule"][-1] if len(bad) > 1 else "rule"
    with pytest.raises(ValueError, match=field):
        MemoryMixer(D, **kw)


def test_gdn_output_gate_variants():
    """GDN's output gate: SiLU by default (fla), sigmoid or none on request — the read is the normed
    state read times act(W_g x), and with no gate there is no gate parameter at all."""
    x = jax.random.normal(jax.random.key(1), (2, 6, D))
    layers = {act: MemoryMixer(D, rule="gdn", num_heads=2, head_dim=8, gate_activation=act, rngs=nnx.Rngs(0))
              for act in ("silu", "sigmoid")}
    plain = MemoryMixer(D, rule="gdn", num_heads=2, head_dim=8, output_gate="none", rngs=nnx.Rngs(0))
    assert layers["silu"].gate_activation == "silu" and not hasattr(plain, "out_gate")

    @nnx.jit
    def normed_read(m, x):
        q, k, v, g, beta, _ = m._inputs(x, None, None)
        return m.norm(m._rule(q, k, v, g, beta, None, None)[0])

    normed = normed_read(plain, x)
    for act, fn in (("silu", jax.nn.silu), ("sigmoid", jax.nn.sigmoid)):
        layer = layers[act]
        gate = fn(layer.out_gate(x).astype(jnp.float32))
        want = jnp.einsum("...hv,hvd->...d", normed * gate, layer.o[...])
        np.testing.assert_allclose(call(layer, x), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(call(plain, x), jnp.einsum("...hv,hvd->...d", normed, plain.o[...]), rtol=1e-5, atol=1e-5)


def test_rope_attention_rotates_queries_and_keys():
    """RoPE changes the output (same weights), only through positions: a sequence's first token
    is at position 0, where the rotation is the identity, so its output is the plain layer's."""
    plain, rope = make("softmax"), make("softmax", rope_theta=100.0)
    x = jax.random.normal(jax.random.key(4), (2, 7, D))
    y0, y1 = plain(x), rope(x)
    assert rel(y1[:, 0], y0[:, 0]) <= 1e-6
    assert rel(y1[:, 1:], y0[:, 1:]) > 1e-2
    for bad, field in (({"rope_theta": 0.0}, "rope_theta"), ({"rope_theta": True}, "rope_theta"),
                       ({"rope_theta": "1e4"}, "rope_theta")):
        with pytest.raises(ValueError, match=field):
            make("softmax", **bad)
    with pytest.raises(ValueError, match="head_dim"):
        Attention(D, num_heads=4, head_dim=5, rope_theta=100.0, rngs=nnx.Rngs(0))


@pytest.mark.parametrize("rule,kw", [("gdn", {}), ("kda", {}), ("kda", {"kda_gate": "bounded"})])
def test_decay_a_init(rule, kw):
    """a_init="unit" starts every decay scale at A = 1 (A_log = 0); "default" keeps Mamba-2's
    A ~ U[1, 16] for the softplus gates and A = 1 for the bounded gate."""
    default = MemoryMixer(D, rule=rule, num_heads=3, head_dim=8, rngs=nnx.Rngs(0), **kw)
    unit = MemoryMixer(D, rule=rule, num_heads=3, head_dim=8, a_init="unit", rngs=nnx.Rngs(0), **kw)
    np.testing.assert_array_equal(unit.A_log[...], 0.0)
    a = np.exp(np.asarray(default.A_log[...]))
    if kw.get("kda_gate") == "bounded":
        np.testing.assert_array_equal(a, 1.0)
    else:
        assert np.all((a >= 1.0) & (a <= 16.0)) and a.max() > 1.5
    with pytest.raises(ValueError, match="a_init"):
        MemoryMixer(D, rule=rule, num_heads=3, head_dim=8, a_init="slow", rngs=nnx.Rngs(0), **kw)


def test_bad_input_width():
    with pytest.raises(ValueError, match="`x`"):
        make("kda")(jnp.zeros((2, 3, D + 1)))
    with pytest.raises(ValueError, match="`x`"):
        make("softmax")(jnp.zeros((2, D)))


@pytest.mark.parametrize("kind", ["softmax", "kda"])
def test_cache_dtype_is_stable_across_decode_steps(kind):
    """A float32 layer with a bf16 cache returns a bf16 cache: the decode step's input and
    output caches have one type, so a jitted decode loop compiles once."""
    layer = make(kind)
    cache = layer.init_cache(2, 8, jnp.bfloat16)
    _, new = decode(layer, jnp.ones((2, D)), cache)
    before = jax.tree.map(lambda a: (a.shape, a.dtype), cache)
    after = jax.tree.map(lambda a: (a.shape, a.dtype), new)
    assert before == after


@pytest.mark.parametrize("gate", ["softplus", "bounded"])
def test_fresh_kda_layer_forgets_slowly(gate):
    """At initialisation both KDA gates decay mildly (Mamba-2 init of A_log and the bias):
    the median channel keeps > 90% of its memory per token. (A bounded gate without the
    bias would start at −2.5 per token — e^−2.5 ≈ 8% kept — and could not learn recall.)"""
    layer = make("kda", kda_gate=gate)
    x = jax.random.normal(jax.random.key(5), (4, 16, D))
    g = gate_inputs(layer, x)[0]
    assert float(jnp.median(g)) > np.log(0.9)


@pytest.mark.parametrize("gate", ["softplus", "bounded"])
def test_fresh_kda_gate_can_learn(gate):
    """At initialisation the gate's slope ``dg/dz`` (z: the gate projection's output) is alive
    for most channels under both gates. (The bounded gate with Mamba-2's ``A ~ U[1, 16]``
    saturated its sigmoid: median slope ~3e-6, three quarters of the channels below 1e-3.)"""
    layer = make("kda", kda_gate=gate)
    x = jax.random.normal(jax.random.key(6), (4, 16, D))

    def g_of(z_shift):
        layer_z = layer.gate_b(layer.gate_a(x)) + z_shift
        rate = jnp.exp(layer.A_log[...])[:, None]
        z = layer_z + layer.dt_bias[...]
        return (-rate * jax.nn.softplus(z)) if gate == "softplus" else (-layer.gate_bound * jax.nn.sigmoid(rate * z))

    # The slope, checked against the layer's own gate (shift 0 reproduces _inputs' g).
    g0 = jax.jit(g_of)(0.0)
    np.testing.assert_allclose(g0, gate_inputs(layer, x)[0], rtol=1e-5, atol=1e-7)
    slope = jnp.abs(jax.jit(jax.grad(lambda s: jnp.sum(g_of(s))))(0.0)) / g0.size  # mean |dg/dz|
    per_channel = jnp.abs(jax.jit(jax.vmap(jax.grad(lambda s, i: g_of(s).reshape(-1)[i]), (None, 0)))(
        0.0, jnp.arange(64)))
    assert float(slope) > 1e-2
    assert float(jnp.median(per_channel)) > 1e-3


def test_attention_decode_read_is_checked():
    with pytest.raises(ValueError, match="decode_read"):
        make("softmax", decode_read="einsum")


def test_bounded_kda_gate_and_chunk_size_reach_the_kernel(monkeypatch):
    """The layer passes K3's bound (``gate_lower_bound = -gate_bound``) and its chunk size to the
    Pallas kernel; a chunk the kernels cannot tile is refused naming ``chunk_size`` when the layer is made."""
    import kernels.delta as kd

    seen = {}
    real = kd.chunk_kda

    def spy(*args, **kw):
        seen.update(kw)
        return real(*args, **kw)

    monkeypatch.setattr(kd, "chunk_kda", spy)
    x = jax.random.normal(jax.random.key(0), (1, 20, 32))
    for gate, bound in (("bounded", -5.0), ("softplus", None)):
        seen.clear()
        m = MemoryMixer(32, rule="kda", num_heads=2, head_dim=16, kda_gate=gate, chunk_size=16, backend="pallas",
                        rngs=nnx.Rngs(0))
        graphdef, state = nnx.split(m)
        jax.eval_shape(lambda st, x: nnx.merge(graphdef, st)(x), state, x)  # traced: the kernel's arguments
        assert seen["gate_lower_bound"] == bound and seen["chunk_size"] == 16
    with pytest.raises(ValueError, match="MemoryMixer: `chunk_size` must be a power of two"):  # at construction
        MemoryMixer(32, rule="kda", num_heads=2, head_dim=16, chunk_size=24, backend="pallas", rngs=nnx.Rngs(0))


def test_memory_backend_defaults_to_auto():
    from lineage_jax.models import ModelConfig

    assert ModelConfig().memory_backend == "auto"
    assert MemoryMixer(32, rule="deltanet", num_heads=2, head_dim=16, rngs=nnx.Rngs(0)).backend == "auto"
    with pytest.raises(ValueError, match="MemoryMixer: `backend` must be one of"):
        MemoryMixer(32, rule="deltanet", num_heads=2, head_dim=16, backend="cuda", rngs=nnx.Rngs(0))


@pytest.mark.parametrize("rule", ["gdn", "kda", "deltanet"])
def test_grouped_value_heads_share_each_query_key_head(rule):
    """num_v_heads = 2 x num_heads is the ungrouped layer whose q/k projections repeat each head
    twice (consecutive value heads share it), all per-value-head parameters equal."""
    x = jax.random.normal(jax.random.key(3), (2, 11, D))
    kw = dict(rule=rule, head_dim=8, conv_size=0, backend="xla", chunk_size=8)
    grouped = MemoryMixer(D, num_heads=2, num_v_heads=4, rngs=nnx.Rngs(0), **kw)
    flat = MemoryMixer(D, num_heads=4, rngs=nnx.Rngs(1), **kw)
    for name in ("v", "beta", "gate_a", "gate_b", "out_gate", "out_gate_a"):
        if hasattr(grouped, name):
            getattr(flat, name).kernel[...] = getattr(grouped, name).kernel[...]
    for name in ("A_log", "dt_bias", "o"):
        if hasattr(grouped, name):
            getattr(flat, name)[...] = getattr(grouped, name)[...]
    if grouped.norm is not None:
        flat.norm.scale[...] = grouped.norm.scale[...]
    for name in ("q", "k"):
        getattr(flat, name).kernel[...] = jnp.repeat(getattr(grouped, name).kernel[...], 2, axis=1)
    assert grouped.q.kernel.shape == (D, 2, 8) and grouped.v.kernel.shape == (D, 4, 8)
    np.testing.assert_allclose(np.asarray(call(grouped, x)), np.asarray(call(flat, x)), rtol=1e-5, atol=1e-6)
    assert grouped.init_cache(2).state.shape == (2, 4, 8, 8)


def test_grouped_value_heads_refused_when_not_a_multiple():
    with pytest.raises(ValueError, match="num_v_heads"):
        MemoryMixer(D, rule="gdn", num_heads=2, head_dim=8, num_v_heads=3, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="num_v_heads"):
        MemoryMixer(D, rule="linear", num_heads=2, head_dim=8, num_v_heads=4, rngs=nnx.Rngs(0))
