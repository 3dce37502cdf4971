"""The options that loading transformers' checkpoints needs (each off by default): norm epsilons,
YaRN RoPE and the MLA softmax scale, group-limited routing, SiLU on v without a conv, a bias on
KDA's output gate and negative-eigenvalue β. Each: decode after prefill equals the training call,
gradients match finite differences, and the option changes what it should."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lineage_jax.layers.common import YaRN, apply_rope, rope_frequencies
from lineage_jax.layers.memory_mixer import MemoryMixer
from lineage_jax.layers.mla import MLA
from lineage_jax.layers.moe import select_experts
from lineage_jax.models import Decoder, ModelConfig, get_config
from tests.layers.test_mixers import check_gradients
from tests.layers.test_models import check_decode_after_prefill

D = 24


def rel(a, b):
    return float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))


call = nnx.jit(lambda m, x: m(x))
prefill = nnx.jit(lambda m, x, c: m.prefill(x, c))
decode = nnx.jit(lambda m, x, c: m.decode(x, c))


def _consistent(layer, T=9, P=5, grads=True):
    """Prefill P tokens then decode the rest; each output equals the whole-sequence call; with
    ``grads``, every parameter's gradient (and the input's) matches finite differences."""
    x = jax.random.normal(jax.random.key(1), (2, T, D))
    with jax.default_matmul_precision("highest"):
        y = call(layer, x)
        cache = layer.init_cache(2, T + 1)
        y_pre, cache = prefill(layer, x[:, :P], cache)
        assert rel(y_pre, y[:, :P]) <= 1e-5
        for t in range(P, T):
            y_t, cache = decode(layer, x[:, t], cache)
            assert rel(y_t, y[:, t]) <= 1e-5, t
    if grads:
        # Measured (float32, step 1e-3): worst error 5.7e-3 (kda with a full, biased output gate: dt_bias).
        check_gradients(layer, x)
    return y


def _mixer(**kw):
    # 4-token chunks: the XLA chunked form on every backend (the Pallas kernels take chunks >= 16).
    return MemoryMixer(D, num_heads=3, head_dim=8, chunk_size=4, backend="xla", rngs=nnx.Rngs(0), **kw)


@pytest.mark.parametrize("kw,grads", [
    (dict(rule="deltanet", conv_size=0, silu_v=True), True),
    (dict(rule="gdn", allow_neg_eigval=True), True),
    (dict(rule="kda", output_gate_bias=True, norm_eps=1e-5), True),
    pytest.param(dict(rule="kda", output_gate="full", output_gate_bias=True, allow_neg_eigval=True), True,
                 marks=pytest.mark.slow)])
def test_mixer_options_prefill_decode_grad(kw, grads):
    layer = _mixer(**kw)
    if "output_gate_bias" in kw:  # a nonzero bias, so the check sees it
        layer.out_gate.bias[...] = 0.5 + jax.random.normal(jax.random.key(3), layer.out_gate.bias.shape)
    y = _consistent(layer, grads=grads)
    if "output_gate_bias" in kw:  # the bias is used: zeroing it changes the output
        layer.out_gate.bias[...] = jnp.zeros_like(layer.out_gate.bias[...])
        assert rel(call(layer, jax.random.normal(jax.random.key(1), (2, 9, D))), y) > 1e-3


def test_neg_eigval_doubles_beta():
    a, b = _mixer(rule="deltanet"), _mixer(rule="deltanet", allow_neg_eigval=True)
    x = jax.random.normal(jax.random.key(2), (1, 5, D))
    beta_a, beta_b = a._inputs(x, None, None)[4], b._inputs(x, None, None)[4]
    np.testing.assert_allclose(beta_b, 2 * beta_a, rtol=1e-6)
    assert float(beta_b.max()) > 1.0


def test_silu_v_only_without_conv():
    x = jax.random.normal(jax.random.key(2), (1, 5, D))
    v_off = _mixer(rule="deltanet", conv_size=0)._inputs(x, None, None)[2]
    v_on = _mixer(rule="deltanet", conv_size=0, silu_v=True)._inputs(x, None, None)[2]
    np.testing.assert_allclose(v_on, jax.nn.silu(v_off), rtol=1e-6)


def test_mixer_norm_eps_reaches_the_output_norm():
    assert _mixer(rule="kda", norm_eps=1e-5).norm.eps == 1e-5 and _mixer(rule="kda").norm.eps == 1e-6
    with pytest.raises(ValueError, match="output_gate_bias"):
        _mixer(rule="deltanet", output_gate_bias=True)


def _yarn_reference(dim, theta, factor, orig, beta_fast=32.0, beta_slow=1.0):
    """YaRN's frequencies written out from the paper's definition (float64)."""
    freqs = []
    for i in range(dim // 2):
        base = theta ** (-2 * i / dim)
        lo = math.floor(dim * math.log(orig / (beta_fast * 2 * math.pi)) / (2 * math.log(theta)))
        hi = math.ceil(dim * math.log(orig / (beta_slow * 2 * math.pi)) / (2 * math.log(theta)))
        lo, hi = max(lo, 0), min(hi, dim - 1)
        ramp = min(max((i - lo) / (hi - lo), 0.0), 1.0)
        freqs.append(base / factor * ramp + base * (1 - ramp))
    return np.array(freqs)


def test_yarn_frequencies():
    np.testing.assert_allclose(rope_frequencies(64, 10000.0, YaRN(40.0, 4096)),
                               _yarn_reference(64, 10000.0, 40.0, 4096), rtol=1e-5)
    np.testing.assert_allclose(rope_frequencies(16, 500.0), 500.0 ** (-np.arange(8) / 8), rtol=1e-6)
    # The attention factor scales the rotated vector's norm.
    x = jax.random.normal(jax.random.key(0), (3, 8))
    y = apply_rope(x, jnp.arange(3), theta=1e4, yarn=YaRN(4.0, 32, attention_factor=1.5))
    np.testing.assert_allclose(jnp.linalg.norm(y, axis=-1), 1.5 * jnp.linalg.norm(x, axis=-1), rtol=1e-5)


def test_mla_yarn_and_softmax_scale_prefill_decode_grad():
    layer = MLA(D, num_heads=2, q_lora_rank=12, kv_lora_rank=10, qk_nope_head_dim=6, qk_rope_head_dim=4,
                v_head_dim=5, use_rope=True, yarn=YaRN(4.0, 8, attention_factor=1.2), softmax_scale=0.5,
                rngs=nnx.Rngs(0))
    y = _consistent(layer)
    plain = MLA(D, num_heads=2, q_lora_rank=12, kv_lora_rank=10, qk_nope_head_dim=6, qk_rope_head_dim=4,
                v_head_dim=5, use_rope=True, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (2, 9, D))
    assert rel(call(plain, x), y) > 1e-3
    with pytest.raises(ValueError, match="yarn"):
        MLA(D, num_heads=2, kv_lora_rank=10, qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=5,
            yarn=YaRN(4.0, 8), rngs=nnx.Rngs(0))


def _grouped_reference(scores, bias, top_k, n_group, topk_group):
    """Group-limited top-k written out per token (numpy)."""
    out = []
    for s in scores + bias:
        groups = s.reshape(n_group, -1)
        gscore = np.sort(groups, axis=-1)[:, -2:].sum(-1)
        keep = np.argsort(-gscore, kind="stable")[:topk_group]
        masked = np.full_like(groups, -np.inf)
        masked[keep] = groups[keep]
        out.append(set(np.argsort(-masked.reshape(-1), kind="stable")[:top_k].tolist()))
    return out


@pytest.mark.parametrize("n_group,topk_group,top_k", [(4, 2, 3), (2, 1, 2), (8, 3, 4)])
def test_group_limited_routing(n_group, topk_group, top_k):
    E = 16
    logits = jax.random.normal(jax.random.key(0), (64, E)) * 2
    bias = jax.random.normal(jax.random.key(1), (E,)) * 0.1
    idx, w, scores = select_experts(logits, bias, top_k, 2.5, n_group=n_group, topk_group=topk_group)
    want = _grouped_reference(np.asarray(scores), np.asarray(bias), top_k, n_group, topk_group)
    assert [set(r) for r in np.asarray(idx).tolist()] == want
    np.testing.assert_allclose(np.asarray(w).sum(-1), 2.5, rtol=1e-5)
    plain, _, _ = select_experts(logits, bias, top_k, 2.5)
    assert any(set(a) != set(b) for a, b in zip(np.asarray(idx).tolist(), np.asarray(plain).tolist()))


@pytest.mark.slow
def test_decoder_with_every_option_prefill_decode_grad():
    cfg = get_config("tiny_mla", pattern="MK", scan_layers=False, mla_rope=True, rope_scaling="yarn", rope_factor=4.0,
                     rope_original_max_len=16, rope_attention_factor=1.1, mla_softmax_scale=0.3, norm_eps=1e-5,
                     mixer_norm_eps=1e-5, num_experts=4, top_k=2, moe_hidden=16, n_group=2, topk_group=1,
                     first_dense_layers=0, allow_neg_eigval=True, kda_output_gate_bias=True, chunk_size=4,
                     memory_backend="xla")
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    assert model.groups[0].blocks[0].norm1.eps == 1e-5
    tokens = jax.random.randint(jax.random.key(0), (2, 9), 0, cfg.vocab_size)
    with jax.default_matmul_precision("highest"):
        check_decode_after_prefill(model, tokens, 5, 10, 1e-5)
    grads = nnx.jit(nnx.grad(lambda m, t: jnp.mean(m(t) ** 2)))(model, tokens)
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(nnx.state(grads, nnx.Param)))


@pytest.mark.parametrize("bad,match", [
    (dict(pattern="SS", rope_scaling="yarn"), "rope_scaling"),
    (dict(pattern="MM", **dict(kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8),
          mla_rope=True, rope_scaling="yarn", rope_factor=0.5), "rope_factor"),
    (dict(pattern="SS", num_experts=4, top_k=2, moe_hidden=8, n_group=3), "n_group"),
    (dict(pattern="SS", num_experts=4, top_k=3, moe_hidden=8, n_group=2, topk_group=1), "top_k"),
    (dict(pattern="SS", norm_eps=0.0), "norm_eps"),
    (dict(pattern="SS", allow_neg_eigval=True), "allow_neg_eigval"),
    (dict(pattern="KK", kda_output_gate="none", kda_output_gate_bias=True), "kda_output_gate_bias"),
])
def test_bad_option_configs_name_the_field(bad, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig(**bad)
