"""The ``jax.lax.ragged_all_to_all`` path of expert parallelism, on a GPU or TPU.

XLA:CPU has no ragged-all-to-all (jax 0.10.2: "HLO opcode ragged-all-to-all is not
supported by XLA:CPU ThunkEmitter"), so these tests skip on the CPU; the CPU suite
checks the same bookkeeping through ``impl="ragged_reference"``. With one accelerator
the expert axis has size 1 (every offset is trivial); the multi-device layouts are
checked on 8 fake CPU devices.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from lineage_jax.layers.moe import MoE
from lineage_jax.models import get_config
from lineage_jax.parallel.expert import ExpertParallel, moe_forward
from lineage_jax.parallel.mesh import make_mesh
from lineage_jax.parallel.sharded import TrainStep, init_sharded

pytestmark = pytest.mark.skipif(jax.default_backend() == "cpu", reason="ragged_all_to_all needs a GPU or TPU")


@pytest.fixture(autouse=True)
def _fp32_matmuls():
    with jax.default_matmul_precision("highest"):
        yield


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def test_ragged_moe_forward_and_grad():
    mesh = make_mesh(devices=jax.devices()[:1])
    moe = MoE(32, num_experts=8, top_k=2, expert_hidden=24, num_shared_experts=1, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (4, 16, 32))
    ep = ExpertParallel(mesh, impl="ragged")
    assert ExpertParallel(mesh).resolved_impl() == "ragged"

    def loss(m, x, use_ep):
        y, _ = moe_forward(m, x, ep) if use_ep else m(x)
        return jnp.sum(jnp.sin(y)), y

    grad = jax.jit(nnx.value_and_grad(loss, argnums=(0, 1), has_aux=True), static_argnums=2)
    text = jax.jit(lambda x: moe_forward(moe, x, ep)).lower(x).as_text()
    assert "ragged_all_to_all" in text
    (_, y0), (gm0, gx0) = grad(moe, x, False)
    (_, y1), (gm1, gx1) = grad(moe, x, True)
    assert rel(y1, y0) <= 1e-5 and rel(gx1, gx0) <= 1e-5
    for a, b in zip(jax.tree.leaves(gm1), jax.tree.leaves(gm0)):
        assert rel(a, b) <= 1e-5


def test_ragged_capacity_counts_drops():
    mesh = make_mesh(devices=jax.devices()[:1])
    moe = MoE(32, num_experts=8, top_k=2, expert_hidden=24, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(2), (4, 16, 32))
    outs = {}
    for impl in ("ragged", "dense"):
        ep = ExpertParallel(mesh, impl=impl, capacity_factor=0.5)
        y, stats = jax.jit(lambda x: moe_forward(moe, x, ep))(x)
        outs[impl] = (np.asarray(y), int(stats.tokens_dropped))
    assert outs["ragged"][1] == outs["dense"][1] == 64          # one shard: C = 0.5·64·2 of 128 assignments
    assert rel(outs["ragged"][0], outs["dense"][0]) <= 1e-5


def test_train_step_with_ragged_expert_parallel():
    cfg = get_config("tiny_kimi_linear").replace(pattern="KMKM", first_dense_layers=0, attnres_block=0)
    mesh = make_mesh(devices=jax.devices()[:1])
    model = init_sharded(cfg, mesh)
    batch = {"tokens": jax.random.randint(jax.random.key(0), (4, 32), 0, cfg.vocab_size)}
    plain = TrainStep(model, mesh, optax.adamw(1e-3), expert_parallel=False)
    ragged = TrainStep(model, mesh, optax.adamw(1e-3), expert_parallel=ExpertParallel(mesh, impl="ragged"))
    l0, _, g0 = plain.loss_and_grad(plain.init(model), batch)
    l1, m1, g1 = ragged.loss_and_grad(ragged.init(model), batch)
    assert abs(float(l1) - float(l0)) <= 1e-5 * abs(float(l0))
    assert int(m1["tokens_dropped"]) == 0
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g0)):
        assert rel(a, b) <= 1e-5
    state, metrics = ragged(ragged.init(model), batch)
    assert int(state.step) == 1 and np.isfinite(float(metrics["loss"]))
