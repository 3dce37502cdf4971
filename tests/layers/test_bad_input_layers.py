"""Bad input to the layers, ModelConfig and the Decoder gets a ValueError naming the argument (or
field), before anything is computed or changed; traced values are not read."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lineage_jax.layers import grouped_pallas as GP
from lineage_jax.layers.attention import Attention
from lineage_jax.layers.common import Dense
from lineage_jax.layers.ffn import MLP
from lineage_jax.layers.memory_mixer import MemoryMixer, causal_conv
from lineage_jax.layers.mla import MLA
from lineage_jax.layers.moe import MoE, RouterStats
from lineage_jax.models.config import ModelConfig
from lineage_jax.models.decoder import Decoder

Dm, T = 8, 8
x = jnp.asarray(np.random.default_rng(0).normal(size=(1, T, Dm)), jnp.float32)
nan = float("nan")


def mixer(**kw):
    return MemoryMixer(Dm, **{**dict(rule="kda", num_heads=2, head_dim=4), **kw}, rngs=nnx.Rngs(0))


def moe(**kw):
    return MoE(Dm, **{**dict(num_experts=4, top_k=2, expert_hidden=8), **kw}, rngs=nnx.Rngs(0))


def mla(**kw):
    return MLA(Dm, num_heads=2, kv_lora_rank=4, qk_nope_head_dim=4, qk_rope_head_dim=2, v_head_dim=4,
               rngs=nnx.Rngs(0), **kw)


def config(**kw):
    return ModelConfig(**{**dict(d_model=16, num_heads=2, ffn_hidden=32, vocab_size=32, max_seq_len=16), **kw})


# ---------------------------------------------------------------------------- constructors
@pytest.mark.parametrize("build, match", [
    (lambda: mixer(v_head_dim=0), "MemoryMixer: `v_head_dim` must be a positive int"),
    (lambda: mixer(v_head_dim=2.0), "MemoryMixer: `v_head_dim` must be a positive int"),
    (lambda: mixer(gate_rank=2.5), "MemoryMixer: `gate_rank` must be a positive int"),
    (lambda: mixer(conv_size=2.5), "MemoryMixer: `conv_size` must be an int"),
    (lambda: mixer(norm_eps=-1.0), "MemoryMixer: `norm_eps` must be a positive finite number"),
    (lambda: mixer(norm_eps=nan), "MemoryMixer: `norm_eps`"),
    (lambda: mixer(kda_gate="bounded", gate_bound=10.0), "MemoryMixer: `gate_bound` must be a number in"),
    (lambda: Attention(0, num_heads=2, head_dim=4, rngs=nnx.Rngs(0)), "Attention: `d_model` must be a positive int"),
    (lambda: Attention(Dm, num_heads=2.0, head_dim=4, rngs=nnx.Rngs(0)), "Attention: `num_heads`"),
    (lambda: MLP(0, 16, rngs=nnx.Rngs(0)), "MLP: `d_model` must be a positive int"),
    (lambda: MLP(Dm, 16.0, rngs=nnx.Rngs(0)), "MLP: `hidden` must be a positive int"),
    (lambda: moe(expert_hidden=8.0), "MoE: `expert_hidden` must be a positive int"),
    (lambda: moe(top_k=1.5), "MoE: `top_k` must be an int"),
    (lambda: moe(num_experts=4.0), "MoE: `num_experts` must be a positive int"),
    (lambda: moe(latent_dim=2.5), "MoE: `latent_dim` must be a positive int"),
    (lambda: moe(num_shared_experts=1.0), "MoE: `num_shared_experts` must be an int"),
    (lambda: moe(num_shared_experts=1, shared_hidden=4.0), "MoE: `shared_hidden` must be a positive int"),
    (lambda: moe(routed_scaling_factor=nan), "MoE: `routed_scaling_factor` must be a positive finite"),
    (lambda: moe(routed_scaling_factor=-1.0), "MoE: `routed_scaling_factor`"),
    (lambda: moe(dispatch="capacity", capacity_factor=math.inf), "MoE: `capacity_factor` must be a positive finite"),
    (lambda: moe(dispatch="capacity", capacity_factor="2"), "MoE: `capacity_factor` must be a positive finite"),
    (lambda: moe(dispatch="capacity", capacity_factor=True), "MoE: `capacity_factor` must be a positive finite"),
    (lambda: mixer().init_cache(0), "MemoryMixer.init_cache: `batch` must be a positive int"),
    (lambda: mla().init_cache(True, 8), "MLA.init_cache: `batch` must be a positive int"),
])
def test_constructors_name_the_argument(build, match):
    with pytest.raises(ValueError, match=match):
        build()


# ---------------------------------------------------------------------------- boolean flags
def _empty_gmm(interpret):  # no rows: returns before any kernel runs, after the arguments are checked
    return GP.gmm(jnp.zeros((0, 16)), jnp.zeros((2, 16, 16)), jnp.zeros((2,), jnp.int32), tile=16,
                  interpret=interpret)


def _empty_routed_experts(interpret):
    w = jnp.zeros((2, 16, 16))
    return GP.routed_experts(jnp.zeros((0, 16)), jnp.zeros((0, 1), jnp.int32), jnp.zeros((0, 1)), w, w, w,
                             "swiglu", tile=16, interpret=interpret)


def _conv(kernel):  # with a prefix the XLA form runs whatever `kernel` says
    return causal_conv(jnp.ones((1, 4, 3)), jnp.ones((2, 3)), jnp.zeros((1, 1, 3)), None, kernel=kernel)


# (layer as named in its errors, flag, build(value), whether None means the default)
BOOL_FLAGS = [
    ("MemoryMixer", "output_norm", lambda v: mixer(output_norm=v), True),
    ("MemoryMixer", "silu_v", lambda v: mixer(silu_v=v, conv_size=0), False),
    ("MemoryMixer", "allow_neg_eigval", lambda v: mixer(allow_neg_eigval=v), False),
    ("MemoryMixer", "output_gate_bias", lambda v: mixer(output_gate_bias=v), False),
    ("Attention", "use_bias", lambda v: Attention(Dm, num_heads=2, head_dim=4, use_bias=v, rngs=nnx.Rngs(0)), False),
    ("MLA", "use_rope", lambda v: mla(use_rope=v), False),
    ("MLA", "output_gate", lambda v: mla(output_gate=v), False),
    ("MLP", "use_bias", lambda v: MLP(Dm, 16, use_bias=v, rngs=nnx.Rngs(0)), True),
    ("Dense", "use_bias", lambda v: Dense(Dm, 4, axes=("embed", "mlp"), use_bias=v, rngs=nnx.Rngs(0)), False),
    ("gmm", "interpret", _empty_gmm, True),
    ("routed_experts", "interpret", _empty_routed_experts, True),
    ("causal_conv", "kernel", _conv, False),
]
BOOL_IDS = [f"{layer}.{flag}" for layer, flag, _, _ in BOOL_FLAGS]


@pytest.mark.parametrize("value", ["no", "False", 1, 0, 1.0, [True]], ids=repr)
@pytest.mark.parametrize("layer, flag, build, none_ok", BOOL_FLAGS, ids=BOOL_IDS)
def test_bool_flags_refuse_other_types(layer, flag, build, none_ok, value):
    """A truthy string or a number is not read as a flag (``output_norm="no"`` would turn the norm on)."""
    with pytest.raises(ValueError, match=rf"^{layer}: `{flag}` must be a bool"):
        build(value)


@pytest.mark.parametrize("layer, flag, build, none_ok", [f for f in BOOL_FLAGS if not f[3]],
                         ids=[i for i, f in zip(BOOL_IDS, BOOL_FLAGS) if not f[3]])
def test_bool_flags_without_a_default_refuse_none(layer, flag, build, none_ok):
    with pytest.raises(ValueError, match=rf"^{layer}: `{flag}` must be a bool, got None"):
        build(None)


@pytest.mark.parametrize("layer, flag, build, none_ok", BOOL_FLAGS, ids=BOOL_IDS)
def test_bool_flags_accept_python_and_numpy_bools(layer, flag, build, none_ok):
    """A NumPy bool builds what the Python bool builds: the same graph (static settings included) and the same
    parameter values, or for functions the same result."""
    def built(value):
        obj = build(value)
        if isinstance(obj, nnx.Module):
            graphdef, state = nnx.split(obj)
            return graphdef, [np.asarray(x) for x in jax.tree.leaves(state)]
        return None, [np.asarray(x) for x in jax.tree.leaves(obj)]

    for value in (True, False):
        (g1, leaves1), (g2, leaves2) = built(value), built(np.bool_(value))
        assert g1 == g2, (layer, flag, value)
        assert len(leaves1) == len(leaves2) and all(np.array_equal(a, b) for a, b in zip(leaves1, leaves2))
    if none_ok:
        built(None)


def test_bool_flag_message_names_the_layer_the_argument_and_the_value():
    with pytest.raises(ValueError) as e:
        mixer(output_norm="no")
    assert str(e.value) == "MemoryMixer: `output_norm` must be a bool (or None for the rule's default), got 'no'"


def test_numpy_bools_mean_what_they_say():
    assert mixer(output_norm=np.bool_(False)).norm is None
    assert mixer(output_norm=np.bool_(True)).norm is not None
    assert mixer(rule="linear", conv_size=0, output_norm=None).norm is None  # the rule's default
    assert MLP(Dm, 16, use_bias=np.bool_(False), rngs=nnx.Rngs(0)).down.bias is None
    assert MLP(Dm, 16, kind="gelu", rngs=nnx.Rngs(0)).down.bias is not None  # None: the kind's default
    assert Attention(Dm, num_heads=2, head_dim=4, use_bias=np.bool_(True), rngs=nnx.Rngs(0)).o_bias is not None
    assert mla(use_rope=np.bool_(True)).use_rope is True


# ---------------------------------------------------------------------------- ModelConfig
@pytest.mark.parametrize("field, value, extra", [
    ("num_experts", "4", {}), ("num_experts", 2.5, {}), ("first_dense_layers", "1", {}),
    ("attnres_block", 1.5, {"pattern": "SS"}), ("scan_period", 1.5, {"pattern": "SSSS"}),
    ("kda_gate_rank", 2.5, {"pattern": "KK"}), ("conv_size", "4", {"pattern": "K"}),
    ("top_k", 1.5, {"num_experts": 4, "moe_hidden": 8}), ("moe_hidden", 8.0, {"num_experts": 4, "top_k": 2}),
    ("routed_scaling_factor", nan, {"num_experts": 4, "top_k": 2, "moe_hidden": 8}),
    ("rope_factor", "2", {"positions": "rope", "rope_scaling": "yarn"}),
    ("mixer_norm_eps", -1.0, {}),
    ("tie_embeddings", "no", {}), ("attn_bias", "no", {}), ("silu_v", "no", {}), ("allow_neg_eigval", "no", {}),
    ("kda_output_gate_bias", 1, {}), ("rope_truncate", 0, {}), ("mla_output_gate", "no", {}),
    ("scan_layers", "no", {}), ("scan_unroll", 1, {}),
    ("mla_rope", "no", {"pattern": "M", "kv_lora_rank": 4, "qk_nope_head_dim": 4, "qk_rope_head_dim": 2,
                        "v_head_dim": 4}),
])
def test_config_fields_are_typed(field, value, extra):
    with pytest.raises(ValueError, match=f"^ModelConfig.{field}: "):
        config(**extra, **{field: value})


# ---------------------------------------------------------------------------- MemoryMixer
def test_mixer_checks_segment_ids_and_cache_first():
    m = mixer()
    c = m.init_cache(1)
    for call, match in [
        (lambda: m(x, segment_ids=jnp.zeros((1, 9), jnp.int32)), r"MemoryMixer.__call__: `segment_ids`"),
        (lambda: m(x, segment_ids=jnp.zeros((T,), jnp.int32)), r"MemoryMixer.__call__: `segment_ids`"),
        (lambda: m.prefill(x, c, segment_ids=jnp.zeros((1, 9), jnp.int32)), r"MemoryMixer.prefill: `segment_ids`"),
        (lambda: m.prefill(x, m.init_cache(2)), r"MemoryMixer.prefill: `cache.conv` must have shape"),
        (lambda: m.prefill(x, c._replace(conv=c.conv[:, :1])), r"MemoryMixer.prefill: `cache.conv`"),
        (lambda: m.prefill(x, (c.conv, c.state)), r"MemoryMixer.prefill: `cache` must be a MemoryCache"),
        (lambda: m.prefill(x, None), r"MemoryMixer.prefill: `cache` must be a MemoryCache"),
        (lambda: m.decode(x[:, 0], c._replace(conv=None)), r"MemoryMixer.decode: `cache.conv` is required"),
        (lambda: m.decode(x[:, 0], m.init_cache(2)), r"MemoryMixer.decode: `cache.conv`"),
    ]:
        with pytest.raises(ValueError, match=match):
            call()


def test_mixer_decode_refuses_a_cache_of_another_layout():
    lin = mixer(rule="linear", conv_size=0)
    c = lin.init_cache(1)
    with pytest.raises(ValueError, match=r"linear_attention_step: with `normalize=True`, `state` must be a pair"):
        lin.decode(x[:, 0], c._replace(state=c.state[0]))  # a bare S would run unnormalized attention
    with pytest.raises(ValueError, match=r"MemoryMixer.decode: `cache.conv` must be None"):
        lin.decode(x[:, 0], mixer().init_cache(1))


# ---------------------------------------------------------------------------- Attention, MLA
def test_attention_and_mla_check_their_caches():
    a = Attention(Dm, num_heads=2, head_dim=4, rngs=nnx.Rngs(0))
    ca = a.init_cache(1, 16)
    with pytest.raises(ValueError, match=r"Attention.prefill: `cache` must be a KVCache"):
        a.prefill(x, tuple(ca))
    with pytest.raises(ValueError, match=r"Attention.decode: `cache.k` must have shape"):
        a.decode(x[:, 0], a.init_cache(2, 16))
    with pytest.raises(ValueError, match=r"Attention.prefill: `cache.length` must be >= 0"):
        a.prefill(x, ca._replace(length=jnp.full((1,), -2, jnp.int32)))
    m = mla()
    cm = m.init_cache(1, 16)
    with pytest.raises(ValueError, match=r"MLA.decode: `cache.length` must be >= 0, got -2"):
        m.decode(x[:, 0], cm._replace(length=jnp.full((1,), -2, jnp.int32)))
    with pytest.raises(ValueError, match=r"MLA.prefill: `cache.length` must be an integer array"):
        m.prefill(x, cm._replace(length=jnp.zeros((1,))))


def test_layers_check_their_input_width_and_dtype():
    f = MLP(Dm, 16, rngs=nnx.Rngs(0))
    assert f(x[0]).shape == (T, Dm)  # any leading axes
    for call, match in [
        (lambda: f(x[..., :5]), r"MLP: `x` must have shape \[..., D\] with D=8, got \(1, 8, 5\)"),
        (lambda: f(x.astype(jnp.int32)), r"MLP: `x` must be a floating-point array"),
        (lambda: moe()(x.astype(jnp.int32)), r"MoE: `x` must be a floating-point array"),
        (lambda: mixer()(x.astype(jnp.int32)), r"MemoryMixer.__call__: `x` must be a floating-point array"),
    ]:
        with pytest.raises(ValueError, match=match):
            call()


def test_caches_are_floating():
    # an integer cache would round every stored key, latent or conv input silently
    a, m, mm_ = Attention(Dm, num_heads=2, head_dim=4, rngs=nnx.Rngs(0)), mla(), mixer()
    for call, match in [
        (lambda: a.init_cache(1, 16, jnp.int32), r"init_kv_cache: `dtype` must be a floating-point dtype, got int32"),
        (lambda: m.init_cache(1, 16, jnp.int8), r"MLA.init_cache: `dtype` must be a floating-point dtype, got int8"),
        (lambda: mm_.init_cache(1, 16, jnp.int32), r"MemoryMixer.init_cache: `dtype` must be a floating-point dtype"),
        (lambda: m.decode(x[:, 0], m.init_cache(1, 16)._replace(latent=jnp.zeros((1, 16, 4), jnp.int32))),
         r"MLA.decode: `cache.latent` must be a floating-point array"),
        (lambda: mm_.decode(x[:, 0], mm_.init_cache(1)._replace(conv=jnp.zeros((1, 3, 24), jnp.int32))),
         r"MemoryMixer.decode: `cache.conv` must be a floating-point array"),
    ]:
        with pytest.raises(ValueError, match=match):
            call()


# ---------------------------------------------------------------------------- MoE bias update
def test_moe_update_bias_refuses_bad_rate_and_stats_and_keeps_the_bias():
    e = moe()
    stats = RouterStats(expert_counts=jnp.full((4,), 4, jnp.int32), load=jnp.full((4,), 0.25),
                        tokens_dropped=jnp.zeros((), jnp.int32), scores=jnp.full((T, 4), 0.5))
    before = np.asarray(e.router_bias[...]).copy()
    for kw, match in [
        (dict(rate=nan), "MoE.update_bias: `rate` must be a finite number >= 0"),
        (dict(rate=jnp.float32(-1.0)), "MoE.update_bias: `rate` must be a finite number >= 0"),
        (dict(rate="0.1"), "MoE.update_bias: `rate` must be a real number"),
        (dict(rate=0.1, stats=stats._replace(expert_counts=jnp.zeros((3,), jnp.int32))),
         "MoE.update_bias: `stats.expert_counts` must have shape"),
        (dict(rate=0.1, rule="quantile", stats=stats._replace(scores=stats.scores[:, :3])),
         "MoE.update_bias: `stats.scores` must have shape"),
        (dict(rate=0.1, stats=(stats.expert_counts,)), "MoE.update_bias: `stats` must be the RouterStats"),
    ]:
        with pytest.raises(ValueError, match=match):
            e.update_bias(**{"stats": stats, **kw})
    np.testing.assert_array_equal(np.asarray(e.router_bias[...]), before)


# ---------------------------------------------------------------------------- Decoder
@pytest.fixture(scope="module")
def learned():
    return Decoder(config(pattern="SK", positions="learned", chunk_size=16), rngs=nnx.Rngs(0))


tok = jnp.arange(T, dtype=jnp.int32)[None]


def test_decoder_refuses_ids_outside_its_tables(learned):
    m = learned
    for call, match in [
        (lambda: m.forward(tok.at[0, 3].set(40)), r"Decoder.forward: `tokens` must be in \[0, vocab_size=32\)"),
        (lambda: m.forward(tok.at[0, 3].set(-1)), r"Decoder.forward: `tokens` must be in \[0, vocab_size=32\)"),
        (lambda: m.decode(jnp.array([99], jnp.int32), m.init_cache(1, 32)), r"Decoder.decode: `token` must be in"),
        (lambda: m.forward(tok, positions=jnp.arange(9)[None]), r"Decoder.forward: `positions` must have shape"),
        (lambda: m.forward(tok, positions=jnp.arange(8.0)[None]), r"Decoder.forward: `positions` must be an integer"),
        (lambda: m.forward(tok, positions=jnp.arange(8)[None] + 12),
         r"Decoder.forward: `positions` must be in \[0, max_seq_len=16\)"),
        (lambda: m.prefill(jnp.zeros((1, 20), jnp.int32), m.init_cache(1, 32)),
         r"Decoder.prefill: position 19 exceeds the learned position table \(max_seq_len=16\)"),
        (lambda: m.decode(tok[:, 0], m.init_cache(1, 32)._replace(length=jnp.full((1,), 16, jnp.int32))),
         r"Decoder.decode: position 16 exceeds"),
        (lambda: m.forward(tok, segment_ids=jnp.zeros((1, 9), jnp.int32)), r"Decoder.forward: `segment_ids`"),
        (lambda: m.forward(tok[:, :0]), r"Decoder.forward: `tokens` holds no tokens \(shape \(1, 0\)\)"),
        (lambda: m.prefill(tok[:, :0], m.init_cache(1, 32)), r"Decoder.prefill: `tokens` holds no tokens"),
    ]:
        with pytest.raises(ValueError, match=match):
            call()


def test_decoder_checks_its_cache(learned):
    m = learned
    other = Decoder(config(pattern="KS", positions="learned", chunk_size=16), rngs=nnx.Rngs(0))
    c = m.init_cache(1, 32)
    for call, match in [
        (lambda: m.init_cache(1, 32, jnp.int32), r"Decoder.init_cache: `dtype` must be a floating-point dtype"),
        (lambda: m.prefill(tok, m.init_cache(2, 32)),
         r"Decoder.prefill: `cache.length` has batch 2, the input has batch 1"),
        (lambda: m.decode(tok[:, 0], m.init_cache(2, 32)), r"Decoder.decode: `cache.length` has batch 2"),
        (lambda: m.prefill(tok, tuple(c)), r"Decoder.prefill: `cache` must be a DecoderCache"),
        (lambda: m.prefill(tok, None), r"Decoder.prefill: `cache` must be a DecoderCache"),
        (lambda: m.prefill(tok, c._replace(layers=c.layers[:1])), r"Decoder.prefill: `cache.layers` must hold one"),
        (lambda: m.prefill(tok, other.init_cache(1, 32)), r"Attention.prefill: `cache` must be a KVCache"),
        (lambda: m.decode(tok[:, 0], c._replace(length=jnp.full((1,), -5, jnp.int32))),
         r"Decoder.decode: `cache.length` must be >= 0, got -5"),
    ]:
        with pytest.raises(ValueError, match=match):
            call()


@pytest.mark.parametrize("pattern", ["SS", "MM", "SKSK"])
def test_scanned_decoder_refuses_a_full_cache(pattern):
    # repeated layers run under one scan, where the layers see traced lengths: the Decoder checks the capacity
    kw = dict(kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=8) if "M" in pattern else {}
    m = Decoder(config(pattern=pattern, chunk_size=16, **kw), rngs=nnx.Rngs(0))
    assert m.cfg.scan_layers and any(n > 1 for _, _, n in m.groups_spec)
    _, c = m.prefill(tok, m.init_cache(1, T))  # exactly full: fine
    with pytest.raises(ValueError, match=rf"Decoder.decode: `cache` is full: {T} \+ 1 tokens exceed capacity {T}"):
        m.decode(tok[:, 0], c)
    with pytest.raises(ValueError, match=rf"Decoder.prefill: `cache` is full: 0 \+ {T + 1} tokens exceed capacity {T}"):
        m.prefill(jnp.arange(T + 1, dtype=jnp.int32)[None], m.init_cache(1, T))


@pytest.mark.parametrize("pattern", ["SS", "SK"])
def test_jitted_steps_past_a_full_cache_give_nan_logits(pattern):
    # under jit the lengths are traced and cannot be refused: the overflowing rows' logits are NaN, the others not
    from lineage_jax.models.decoder import inference_steps
    m = Decoder(config(pattern=pattern, chunk_size=16), rngs=nnx.Rngs(0))
    st, prefill, decode = inference_steps(m)
    c = m.init_cache(2, T)._replace(length=jnp.asarray([0, 1], jnp.int32))
    logits, c = prefill(st, jnp.concatenate([tok, tok]), c)  # row 1 holds T + 1 tokens in T slots
    assert bool(jnp.isfinite(logits[0]).all()) and bool(jnp.isnan(logits[1]).all())
    logits, _ = decode(st, tok[:, :2].reshape(2), c)
    assert bool(jnp.isnan(logits).all())  # both rows are past their capacity now


def test_fixed_state_decoder_has_no_capacity():
    m = Decoder(config(pattern="KK", chunk_size=16), rngs=nnx.Rngs(0))
    _, c = m.prefill(tok, m.init_cache(1, 1))  # the states do not grow: max_len bounds nothing
    logits, c = m.decode(tok[:, 0], c)
    assert int(c.length[0]) == T + 1 and bool(jnp.isfinite(logits).all())


def test_decoder_does_not_read_traced_tokens(learned):
    graphdef, state = nnx.split(learned)
    step = lambda st, t, c: nnx.merge(graphdef, st).prefill(t, c)  # traced as under jit; nothing runs
    bad = learned.init_cache(1, 32)._replace(length=jnp.full((1,), 20, jnp.int32))
    logits, _ = jax.eval_shape(step, state, tok.at[0, 3].set(40), bad)
    assert logits.shape == (1, T, 32)
