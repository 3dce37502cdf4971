"""The ``jax.lax.ragged_all_to_all`` path of expert parallelism, on a GPU or TPU.

XLA:CPU has no ragged-all-to-all (jax 0.10.2: "HLO opcode ragged-all-to-all is not
supported by XLA:CPU ThunkEmitter"), so these tests skip on the CPU; the CPU suite
checks the same bookkeeping through ``impl="ragged_reference"``. Each test runs with the
expert axis over one device (every offset trivial) and, where the host has 2+ accelerators,
over two of them (``expert=2``: real cross-device offsets, NCCL / ICI collectives).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from lineage_jax.layers.moe import MoE
from lineage_jax.models import get_config
from lineage_jax.parallel.expert import ExpertParallel, ep_exchange, moe_forward
from lineage_jax.parallel.mesh import make_mesh
from lineage_jax.train.step import TrainStep, init_sharded

pytestmark = pytest.mark.skipif(jax.default_backend() == "cpu", reason="ragged_all_to_all needs a GPU or TPU")


@pytest.fixture(autouse=True)
def _fp32_matmuls():
    with jax.default_matmul_precision("highest"):
        yield


_GPU = jax.default_backend() == "gpu"
_RAGGED_GRAD_GPU = ("jax.lax.ragged_all_to_all's gradient is wrong across GPUs (measured 2026-11-29, 2 H200s, "
                    "jax 0.11.2; lineage_jax.parallel.expert): strict, so a fixed jax turns this red")


def _expert_sizes(grad: bool = False):
    """1, and 2 where the host has 2+ accelerators; with ``grad``, the ragged gradient over 2 GPUs
    is a strict expected failure."""
    if jax.device_count() < 2:
        return [1]
    # raises=AssertionError: only a wrong value is the known fault; a crash or an XLA error stays red
    return [1, pytest.param(2, marks=pytest.mark.xfail(_GPU and grad, reason=_RAGGED_GRAD_GPU, strict=True,
                                                      raises=AssertionError))]


def _mesh(n):
    return make_mesh({"expert": n}, devices=jax.devices()[:n])


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


@pytest.mark.parametrize("n", _expert_sizes(grad=True))
def test_exchange_impls_agree_forward_and_grad(n):
    """The exchange alone (a nonlinear per-row expert), every ``impl``: outputs and the gradients
    with respect to tokens and routing weights equal the dense all-to-all's."""
    mesh = _mesh(n)
    tokens, width, e, k = 64, 16, 8, 2
    kz, ki, kw, kr = jax.random.split(jax.random.key(n), 4)
    z = jax.random.normal(kz, (tokens, width))
    idx = jnp.argsort(jax.random.uniform(ki, (tokens, e)), axis=1)[:, :k].astype(jnp.int32)
    w = jax.random.uniform(kw, (tokens, k))
    r = jax.random.normal(kr, (tokens, width))
    spec = P("expert", None)

    def expert_fn(rows, local_expert):                  # a different nonlinear map per local expert
        scale = 1.0 + local_expert.astype(rows.dtype)[:, None]
        return jnp.where((local_expert >= 0)[:, None], jnp.tanh(rows * scale), 0.0)

    def run(impl):
        def shard(z, idx, w):
            routed, _ = ep_exchange(z, idx, w, expert_fn, e_loc=e // n, ep_axis="expert", ep=n,
                                    token_axes=("expert",), capacity_factor=None, impl=impl)
            return routed

        mapped = jax.shard_map(shard, mesh=mesh, in_specs=(spec, spec, spec), out_specs=spec)
        f = jax.jit(jax.value_and_grad(lambda z, w: jnp.sum(mapped(z, idx, w) * r), argnums=(0, 1)))
        return f(z, w)

    (l0, (gz0, gw0)) = run("dense")
    for impl in ("ragged_reference", "ragged"):
        l1, (gz1, gw1) = run(impl)
        assert abs(float(l1) - float(l0)) <= 1e-5 * abs(float(l0)), impl
        assert rel(gz1, gz0) <= 1e-5, (impl, rel(gz1, gz0))
        assert rel(gw1, gw0) <= 1e-5, (impl, rel(gw1, gw0))


@pytest.mark.parametrize("n", _expert_sizes())
def test_ragged_moe_forward(n):
    """The forward pass alone: right over every expert axis (the gradient is the GPU problem)."""
    mesh = _mesh(n)
    moe = MoE(32, num_experts=8, top_k=2, expert_hidden=24, num_shared_experts=1, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(3), (4, 16, 32))
    y0, _ = jax.jit(lambda x: moe(x))(x)
    for impl in ("ragged", "dense"):
        y1, stats = jax.jit(lambda x: moe_forward(moe, x, ExpertParallel(mesh, impl=impl)))(x)
        assert rel(y1, y0) <= 1e-5, impl
        assert int(stats.tokens_dropped) == 0


@pytest.mark.parametrize("n", _expert_sizes(grad=True))
def test_ragged_moe_forward_and_grad(n):
    mesh = _mesh(n)
    moe = MoE(32, num_experts=8, top_k=2, expert_hidden=24, num_shared_experts=1, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (4, 16, 32))
    ep = ExpertParallel(mesh, impl="ragged")
    assert ExpertParallel(mesh).resolved_impl() == ("ragged" if jax.default_backend() == "tpu" else "dense")

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


@pytest.mark.parametrize("n", _expert_sizes())
def test_ragged_capacity_counts_drops(n):
    mesh = _mesh(n)
    moe = MoE(32, num_experts=8, top_k=2, expert_hidden=24, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(2), (4, 16, 32))
    outs = {}
    for impl in ("ragged", "dense"):
        ep = ExpertParallel(mesh, impl=impl, capacity_factor=0.5)
        y, stats = jax.jit(lambda x: moe_forward(moe, x, ep))(x)
        outs[impl] = (np.asarray(y), int(stats.tokens_dropped))
    assert outs["ragged"][1] == outs["dense"][1]
    if n == 1:
        assert outs["ragged"][1] == 64                           # one shard: C = 0.5·64·2 of 128 assignments
    assert rel(outs["ragged"][0], outs["dense"][0]) <= 1e-5


@pytest.mark.parametrize("n", _expert_sizes(grad=True))
def test_train_step_with_ragged_expert_parallel(n):
    cfg = get_config("tiny_kimi_linear").replace(pattern="KMKM", first_dense_layers=0, attnres_block=0)
    mesh = _mesh(n)
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
