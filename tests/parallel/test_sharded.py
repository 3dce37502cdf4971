"""The loss and the argument checks of the sharded entry points (one device)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lineage_jax.layers.moe import MoE
from lineage_jax.parallel import sharded as S
from lineage_jax.parallel.mesh import make_mesh


class FixedLogits:
    """A stand-in model whose forward returns given logits."""

    def __init__(self, logits):
        self.logits = logits

    def forward(self, tokens, segment_ids=None):
        return self.logits, {"moe": []}


def test_next_token_loss_masks_boundaries_and_targets():
    rng = np.random.default_rng(0)
    B, T, V = 2, 5, 7
    logits = rng.normal(size=(B, T, V)).astype(np.float32)
    tokens = rng.integers(0, V, size=(B, T)).astype(np.int32)
    seg = np.array([[0, 0, 1, 1, 1], [3, 3, 3, 3, 3]], np.int32)
    loss_mask = np.array([[1, 1, 1, 1, 1], [1, 1, 0, 1, 1]], np.int32)
    loss, aux = S.next_token_loss(FixedLogits(jnp.asarray(logits)),
                                  {"tokens": jnp.asarray(tokens), "segment_ids": seg, "loss_mask": loss_mask})
    logp = logits - np.log(np.sum(np.exp(logits), -1, keepdims=True))
    terms = [-logp[b, t, tokens[b, t + 1]] for b in range(B) for t in range(T - 1)
             if seg[b, t + 1] == seg[b, t] and loss_mask[b, t + 1]]
    assert int(aux["num_tokens"]) == len(terms) == 6        # one boundary and one masked target left out
    np.testing.assert_allclose(float(loss), np.mean(terms), rtol=1e-6)


@pytest.mark.parametrize("tokens, needle", [
    (jnp.zeros((2, 4), jnp.float32), "integer"),
    (jnp.zeros((2, 1), jnp.int32), "T >= 2"),
    (jnp.zeros((4,), jnp.int32), "integer array"),
])
def test_next_token_loss_rejects(tokens, needle):
    with pytest.raises(ValueError, match=needle):
        S.next_token_loss(FixedLogits(None), {"tokens": tokens})


def test_argument_checks():
    mesh = make_mesh(devices=jax.devices()[:1])
    moe = MoE(8, num_experts=4, top_k=2, expert_hidden=6, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="`model`"):
        S.init_sharded(moe, mesh)                                   # an instance, not a constructor
    with pytest.raises(ValueError, match="router_bias_rate"):
        S.TrainStep(moe, mesh, router_bias_rate=-1.0)
    with pytest.raises(ValueError, match="batch_size"):
        S.ShardedDecoder(moe, mesh, batch_size=0, max_len=8)
    with pytest.raises(ValueError, match="Decoder"):
        S.ShardedDecoder(moe, mesh, batch_size=2, max_len=8)
    with pytest.raises(ValueError, match="expert_parallel"):
        S.resolve_expert_parallel(moe, mesh, None, "sometimes")
    assert S.resolve_expert_parallel(moe, mesh, None, "auto") is None   # expert axis of size 1
    assert S.resolve_expert_parallel(moe, mesh, None, True) is not None


def test_shard_batch_one_device():
    mesh = make_mesh(devices=jax.devices()[:1])
    out = S.shard_batch({"tokens": np.arange(6, dtype=np.int32).reshape(2, 3)}, mesh)
    assert out["tokens"].sharding.mesh.shape == mesh.shape
    np.testing.assert_array_equal(np.asarray(out["tokens"]), np.arange(6).reshape(2, 3))
