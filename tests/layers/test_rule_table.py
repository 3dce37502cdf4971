"""The fixed-state mixers are rows of one table (``memory_mixer.RULES``): each named row is the setting of
the update equation its memory function computes, and a row registered at run time is a new mixer end to
end."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lineage_jax import accounting, memory
from lineage_jax.layers.memory_mixer import RULES, MemoryMixer, Rule, check_rules
from lineage_jax.models import config as config_module
from lineage_jax.models import Decoder, get_config, register_rule
from tests._registry import SavedTables

D = 24
inputs = nnx.jit(lambda m, x: m._inputs(x, None, None)[:5])  # the layer's (q, k, v, g, beta)
call = nnx.jit(lambda m, x: m(x))
prefill = nnx.jit(lambda m, x, c: m.prefill(x, c))
decode = nnx.jit(lambda m, x, c: m.decode(x, c))


def make(rule, **kw):
    return MemoryMixer(D, rule=rule, num_heads=3, head_dim=8, v_head_dim=5, chunk_size=8, backend="xla",
                       rngs=nnx.Rngs(0), **kw)


@pytest.mark.parametrize("rule", ["linear", "deltanet", "gdn", "kda"])
def test_named_rows_run_their_memory_function(rule):
    """The layer's sequence and its decode step, run from the row's switches, equal the named function
    of the rule on the layer's own projections (a row with a wrong gate or erase switch fails here)."""
    layer = make(rule)
    x = jax.random.normal(jax.random.key(1), (2, 11, D))
    q, k, v, g, beta = inputs(layer, x)
    named = {"linear": lambda: memory.linear_attention(q, k, v, normalize=True, mode="recurrent"),
             "deltanet": lambda: memory.delta_rule(q, k, v, beta, mode="recurrent"),
             "gdn": lambda: memory.gated_delta_rule(q, k, v, g, beta, mode="recurrent"),
             "kda": lambda: memory.kda(q, k, v, g, beta, mode="recurrent")}[rule]
    o_ref, S_ref = named()
    o, S = layer._rule(q, k, v, g, beta, None, None)
    S, S_ref = (S[0], S_ref[0]) if rule == "linear" else (S, S_ref)
    np.testing.assert_allclose(o, o_ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(S, S_ref, rtol=1e-5, atol=1e-5)
    assert (layer.beta is not None) == RULES[rule].erase


GLA = Rule("X", gate="channel", erase=False, output_gate="full", gate_activation="silu")


@pytest.fixture
def gla():
    """A row added at run time: gated linear attention (per-channel decay, no erasing)."""
    with SavedTables():
        register_rule("gla", GLA)
        yield "gla"


def test_a_new_row_is_a_mixer(gla):
    layer = make(gla)
    assert layer.beta is None and layer.gate_b is not None and layer.out_gate is not None
    x = jax.random.normal(jax.random.key(2), (2, 13, D))
    q, k, v, g, beta = inputs(layer, x)
    assert beta is None and g.shape == (2, 13, 3, 8) and bool(jnp.all(g <= 0))
    o, S = layer._rule(q, k, v, g, beta, None, None)
    o_ref, S_ref = memory.update_rule(q, k, v, g=g, gate="channel", erase=False, mode="recurrent")
    np.testing.assert_allclose(o, o_ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(S, S_ref, rtol=1e-5, atol=1e-5)
    # the layer's cache and decode step follow from the row
    y = call(layer, x)
    cache = layer.init_cache(2)
    y_pre, cache = prefill(layer, x[:, :6], cache)
    np.testing.assert_allclose(y_pre, y[:, :6], rtol=1e-5, atol=1e-5)
    for t in range(6, 13):
        y_t, cache = decode(layer, x[:, t], cache)
        np.testing.assert_allclose(y_t, y[:, t], rtol=1e-4, atol=1e-5)


def test_a_new_row_is_a_pattern_letter(gla):
    cfg = get_config("tiny_gdn", name="tiny_gla", pattern="XGX", decay_a_init="unit")
    assert cfg.mixer(0) == "gla" and cfg.mixer_part("gla").kwargs["conv_size"] == cfg.conv_size
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    tokens = jax.random.randint(jax.random.key(3), (2, 16), 0, cfg.vocab_size)
    logits = nnx.jit(lambda m, t: m(t))(model, tokens)
    assert logits.shape == (2, 16, cfg.vocab_size) and bool(jnp.all(jnp.isfinite(logits)))
    real = sum(int(np.prod(p.shape)) for p in jax.tree.leaves(nnx.state(model, nnx.Param)))
    assert accounting.param_counts(cfg)["total"] == real
    H, K = cfg.num_heads, cfg.resolved_head_dim
    assert accounting.state_bytes(cfg) == 4 * 3 * H * K * K  # two X layers and one G, no normalizer
    with pytest.raises(ValueError, match="allow_neg_eigval"):  # β belongs to the erasing rules
        get_config("tiny_gdn", pattern="XX", allow_neg_eigval=True)


@pytest.mark.parametrize("row,match", [
    (Rule("G"), "letter"),
    (Rule("S"), "letter"),
    (Rule("xy"), "letter"),
    (Rule("X", gate="head"), "gate"),
    (Rule("X", feature="relu"), "feature"),
    (Rule("X", output_gate="partial"), "output_gate"),
    (Rule("X", erase=1), "erase"),
    (Rule("X", normalize=True), "normalized read"),
    (Rule("X", erase=False, normalize=True, gate="scalar"), "normalized read"),
])
def test_bad_rows_are_refused(row, match):
    with pytest.raises(ValueError, match=match):
        check_rules({**RULES, "new": row})
    check_rules(RULES)


def test_register_rule_refuses_taken_names_and_letters(gla):
    for name, row, match in (("gla", Rule("Y"), "is taken"), ("mla", Rule("Y"), "is taken"),
                             ("kda2", Rule("K"), "letter"), ("two words", Rule("Y"), "identifier"),
                             ("bad", Rule("Y", normalize=True), "register_rule: .*normalized read")):
        with pytest.raises(ValueError, match=match):
            register_rule(name, row)
    assert "bad" not in RULES and "Y" not in config_module.MIXERS  # nothing half-registered
    with pytest.raises(ValueError, match="unknown letter"):
        get_config("tiny_gdn", pattern="YG")
