"""The accountant's counts from abstract shapes. The counts themselves are checked against built models
(``test_counts_match_a_real_model``, ``test_state_bytes_match_a_built_models_caches``); the pinned figures of
the full-size configs are the ones docs/guide.md prints (GPT-2 small's 124M is its published size; Kimi
Linear's 49.1B / 3.1B total / active by this count, published as 48B / 3B)."""

import pytest

from lineage_jax import accounting as A
from lineage_jax.models import get_config


def test_gpt2_small_exact():
    assert A.param_counts("gpt2_small") == {"total": 124_475_904, "active": 123_689_472}  # active: no position table
    assert A.cache_bytes_per_token("gpt2_small", dtype_bytes=2) == 36_864
    assert A.state_bytes("gpt2_small") == 0


def test_kimi_linear_48b_a3b():
    c = A.param_counts("kimi_linear_48b_a3b")
    assert abs(c["total"] / 1e9 - 49.1) < 0.1
    assert abs(c["active"] / 1e9 - 3.1) < 0.05
    assert (round(c["total"] / 1e9, 2), round(c["active"] / 1e9, 2)) == (49.12, 3.11)  # docs/guide.md's table
    assert A.cache_bytes_per_token("kimi_linear_48b_a3b", dtype_bytes=2) == 8_064  # 7 MLA layers × (512 + 64) × 2
    assert A.state_bytes("kimi_linear_48b_a3b", dtype_bytes=4) == 41_943_040  # 41.9 MB


def test_kimi_k3():
    c = A.param_counts("kimi_k3")
    assert abs(c["total"] / 1e12 - 2.78) < 0.005
    assert abs(c["active"] / 1e9 - 104.2) < 0.5
    assert A.cache_bytes_per_token("kimi_k3", dtype_bytes=2) == 24 * (512 + 64) * 2  # ≈ 27.6 KB
    assert abs(A.cache_bytes_per_token("kimi_k3") / 1e3 - 27.6) < 0.1
    assert A.state_bytes("kimi_k3", dtype_bytes=4) == 69 * 96 * 128 * 128 * 4  # ≈ 434 MB
    comp = A.component_counts("kimi_k3")
    assert comp["routed_experts"] / c["total"] > 0.97  # experts ≈ 98% of the parameters


def test_counts_match_a_real_model():
    """The abstract count equals the parameters of an actually built tiny model."""
    import jax
    import numpy as np
    from flax import nnx

    from lineage_jax.models import Decoder

    # tiny_k3's parts (a dense first layer, then a scanned group of two KKKM macrocycles: stacked
    # parameters, latent MoE, MLA, AttnRes) at 9 of its 13 layers: built eagerly, op by op
    for cfg in (get_config("tiny_k3").replace(pattern="KKKM" * 2 + "K"), get_config("tiny_gpt2")):
        model = Decoder(cfg, rngs=nnx.Rngs(0))
        assert cfg.name == "tiny_gpt2" or any(n >= 2 for _, _, n in model.groups_spec)  # stacked parameters
        real = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
        assert A.param_counts(cfg)["total"] == real


def test_flops_per_token_grows_with_context_only_for_attention():
    kda, gpt = get_config("tiny_kda"), get_config("tiny_gpt2")
    assert A.flops_per_token(kda, 4096) == A.flops_per_token(kda, 8192)  # fixed state: flat in context
    assert A.flops_per_token(gpt, 8192) > A.flops_per_token(gpt, 4096)
    assert A.flops_per_token(gpt, 1) >= 2 * A.param_counts(gpt)["active"]
    with pytest.raises(ValueError, match="seq_len"):
        A.flops_per_token(gpt, 0)


def test_state_bytes_match_a_built_models_caches():
    """``state_bytes`` (with and without the short-conv buffers) equals the bytes of a built model's fixed-state
    caches: the delta rules with grouped value heads, and a registered normalized rule with a conv (its values
    have the query heads, so its conv buffer does too)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from lineage_jax.layers.memory_mixer import MemoryCache, Rule
    from lineage_jax.models import Decoder, register_rule
    from tests._registry import SavedTables

    with SavedTables():
        register_rule("normalized_conv", Rule("Y", erase=False, normalize=True, feature="elu1", conv=True,
                                              output_norm=False))
        for cfg in (get_config("tiny_kda", pattern="YK", num_v_heads=8), get_config("tiny_kda", num_v_heads=8)):
            cache = Decoder(cfg, rngs=nnx.Rngs(0)).init_cache(1, 8, jnp.float32)
            mems = [c for c in jax.tree.leaves(cache.layers, is_leaf=lambda x: isinstance(x, MemoryCache))
                    if isinstance(c, MemoryCache)]
            state = sum(a.nbytes for m in mems for a in jax.tree.leaves(m.state))
            conv = sum(a.nbytes for m in mems for a in jax.tree.leaves(m.conv))
            assert conv > 0
            assert A.state_bytes(cfg) == state
            assert A.state_bytes(cfg, include_conv=True) == state + conv
    with pytest.raises(ValueError, match="include_conv"):
        A.state_bytes("tiny_kda", include_conv="no")
