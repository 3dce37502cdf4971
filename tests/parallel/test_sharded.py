"""The loss and the argument checks of the sharded entry points (one device): ``init_sharded``,
``TrainStep``, ``next_token_loss`` (``train.step``), ``ShardedDecoder`` (``generate``),
``resolve_expert_parallel`` and ``shard_batch`` (``parallel``)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lineage_jax.generate import ShardedDecoder
from lineage_jax.layers.moe import MoE
from lineage_jax.parallel.expert import resolve_expert_parallel
from lineage_jax.parallel.mesh import make_mesh
from lineage_jax.parallel.rules import shard_batch
from lineage_jax.train.step import TrainStep, init_sharded, next_token_loss


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
    loss, aux = next_token_loss(FixedLogits(jnp.asarray(logits)),
                                {"tokens": jnp.asarray(tokens), "segment_ids": seg, "loss_mask": loss_mask})
    logp = logits - np.log(np.sum(np.exp(logits), -1, keepdims=True))
    terms = [-logp[b, t, tokens[b, t + 1]] for b in range(B) for t in range(T - 1)
             if seg[b, t + 1] == seg[b, t] and loss_mask[b, t + 1]]
    assert int(aux["num_tokens"]) == len(terms) == 6        # one boundary and one masked target left out
    np.testing.assert_allclose(float(loss), np.mean(terms), rtol=1e-6)


def test_next_token_loss_takes_the_pipelines_batches_as_loss_fn_does():
    """A data-pipeline batch (``targets``, ``mask`` at the input position) gives loss_fn's loss: its mask is
    not dropped."""
    from lineage_jax.train.step import cross_entropy
    rng = np.random.default_rng(1)
    B, T, V = 2, 6, 7
    logits = jnp.asarray(rng.normal(size=(B, T, V)).astype(np.float32))
    tokens = jnp.asarray(rng.integers(0, V, size=(B, T)).astype(np.int32))
    targets = jnp.asarray(rng.integers(0, V, size=(B, T)).astype(np.int32))
    mask = jnp.asarray((rng.uniform(size=(B, T)) < 0.4).astype(np.float32))
    loss, aux = next_token_loss(FixedLogits(logits), {"tokens": tokens, "targets": targets, "mask": mask})
    want, _ = cross_entropy(logits, targets, mask)
    assert float(loss) == float(want) and int(aux["num_tokens"]) == int(mask.sum())
    for batch, needle in [({"tokens": tokens, "targets": targets, "loss_mask": mask}, "give one form"),
                          ({"tokens": tokens, "mask": mask}, r"needs `batch\['targets'\]`"),
                          ({"tokens": tokens, "targets": targets[:, :3]}, r"`batch\['targets'\]` must have the shape")]:
        with pytest.raises(ValueError, match=needle):
            next_token_loss(FixedLogits(logits), batch)


@pytest.mark.parametrize("tokens, needle", [
    (jnp.zeros((2, 4), jnp.float32), "integer"),
    (jnp.zeros((2, 1), jnp.int32), "T >= 2"),
    (jnp.zeros((4,), jnp.int32), "integer array"),
])
def test_next_token_loss_rejects(tokens, needle):
    with pytest.raises(ValueError, match=needle):
        next_token_loss(FixedLogits(None), {"tokens": tokens})


def test_argument_checks():
    mesh = make_mesh(devices=jax.devices()[:1])
    moe = MoE(8, num_experts=4, top_k=2, expert_hidden=6, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="`model`"):
        init_sharded(moe, mesh)                                   # an instance, not a constructor
    with pytest.raises(ValueError, match="router_bias_rate"):
        TrainStep(moe, mesh, router_bias_rate=-1.0)
    with pytest.raises(ValueError, match="batch_size"):
        ShardedDecoder(moe, mesh, batch_size=0, max_len=8)
    with pytest.raises(ValueError, match="Decoder"):
        ShardedDecoder(moe, mesh, batch_size=2, max_len=8)
    with pytest.raises(ValueError, match="expert_parallel"):
        resolve_expert_parallel(moe, mesh, None, "sometimes")
    assert resolve_expert_parallel(moe, mesh, None, "auto") is None   # expert axis of size 1
    assert resolve_expert_parallel(moe, mesh, None, True) is not None


def test_shard_batch_one_device():
    mesh = make_mesh(devices=jax.devices()[:1])
    out = shard_batch({"tokens": np.arange(6, dtype=np.int32).reshape(2, 3)}, mesh)
    assert out["tokens"].sharding.mesh.shape == mesh.shape
    np.testing.assert_array_equal(np.asarray(out["tokens"]), np.arange(6).reshape(2, 3))


def test_one_train_state_and_the_former_import_paths():
    import lineage_jax.parallel as parallel
    from lineage_jax import train
    from lineage_jax.parallel import sharded as former

    assert parallel.TrainState is former.TrainState is train.TrainState
    assert parallel.TrainStep is former.TrainStep is TrainStep
    assert parallel.ShardedDecoder is former.ShardedDecoder is ShardedDecoder
    assert former.init_sharded is init_sharded and former.next_token_loss is next_token_loss


def test_train_step_state_is_the_train_state_with_its_shardings():
    from lineage_jax.models import get_config
    from lineage_jax.train.step import TrainState, state_shardings

    mesh = make_mesh(devices=jax.devices()[:1])
    model = init_sharded(get_config("tiny_kimi_linear").replace(pattern="KM", first_dense_layers=0,
                                                                attnres_block=0), mesh)
    trainer = TrainStep(model, mesh)
    state = trainer.init(model)
    assert isinstance(state, TrainState) and int(state.step) == 0
    _, params, rest = nnx.split(model, nnx.Param, ...)
    expected = state_shardings((params, rest), trainer.tx, trainer.parallel)
    assert jax.tree.structure(trainer.state_shardings) == jax.tree.structure(expected)
    state, metrics = trainer(state, {"tokens": jnp.zeros((2, 8), jnp.int32)})
    assert int(state.step) == 1 and np.isfinite(float(metrics["loss"]))
