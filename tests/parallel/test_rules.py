"""The logical-axis rules: spec derivation, divisibility policy, coverage of every config."""

import math

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from lineage_jax.layers.moe import MoE
from lineage_jax.models import config_names
from lineage_jax.parallel import rules as R
from lineage_jax.parallel.expert import ExpertParallel, moe_forward
from lineage_jax.parallel.mesh import make_mesh

BIG = {"data": 2, "fsdp": 4, "expert": 8, "tensor": 2}


def spec(axes, shape=None, mesh=BIG, **kw):
    return R.logical_to_spec(axes, mesh, shape=shape, **kw)


def test_activation_takes_batch_axes_first():
    assert spec(("batch", "seq", "embed")) == P(("data", "fsdp", "expert"))
    assert spec(("batch", "seq", "heads", "head_dim")) == P(("data", "fsdp", "expert"), None, "tensor")
    assert spec(("batch", "seq", "vocab")) == P(("data", "fsdp", "expert"), None, "tensor")


def test_weights():
    # routed experts: experts over expert, width FSDP, hidden over tensor
    assert spec(("experts", "embed", "expert_mlp")) == P("expert", "fsdp", "tensor")
    assert spec(("layers", "experts", "expert_mlp", "latent")) == P(None, "expert", "tensor", "fsdp")
    # dense weights: the expert axis is more FSDP
    assert spec(("embed", "heads", "head_dim")) == P(("fsdp", "expert"), "tensor")
    assert spec(("heads", "head_dim", "embed")) == P("tensor", None, ("fsdp", "expert"))
    assert spec(("vocab", "embed")) == P("tensor", ("fsdp", "expert"))
    assert spec(("embed", "experts")) == P(("fsdp", "expert"))      # router: expert already taken by embed
    assert spec(("norm",)) == P() and spec((None, "embed")) == P(None, ("fsdp", "expert"))


def test_size_one_axes_are_left_out():
    assert spec(("batch", "seq"), mesh={"data": 8}) == P("data")
    assert spec(("experts", "embed", "expert_mlp"), mesh={"expert": 4}) == P("expert")


def test_divisibility_drops_axes_and_reports():
    dropped = []
    # 4 heads on tensor=8: replicated; 96 embed over fsdp=4 x expert=8 = 32: kept
    assert spec(("embed", "heads", "head_dim"), shape=(96, 4, 16), mesh={"fsdp": 4, "expert": 8, "tensor": 8},
                what="q", dropped=dropped) == P(("fsdp", "expert"))
    assert dropped == [("q", 1, "heads", "tensor")]
    # a tuple keeps axes left to right while the product divides: 12 = data (2) x expert (3); fsdp (4) is skipped
    assert spec(("batch",), shape=(12,), mesh={"data": 2, "fsdp": 4, "expert": 3}) == P(("data", "expert"))


def test_strict_raises_naming_the_parameter():
    with pytest.raises(ValueError, match=r"mixer/q/kernel.*'heads'.*'tensor'"):
        spec(("embed", "heads", "head_dim"), shape=(64, 4, 16), mesh={"tensor": 8}, what="mixer/q/kernel", strict=True)


def test_unknown_names_and_bad_rules():
    with pytest.raises(ValueError, match="'hedas'"):
        spec(("embed", "hedas"))
    with pytest.raises(ValueError, match="'heads' has two rules"):
        R.rules_dict((("heads", "tensor"), ("heads", None)))
    with pytest.raises(ValueError, match="unknown mesh axis 'model'"):
        R.rules_dict((("heads", "model"),))
    with pytest.raises(ValueError, match="do not match shape"):
        spec(("embed",), shape=(4, 4))


@pytest.mark.parametrize("name", config_names())
def test_every_config_is_covered(name):
    """Every parameter of every named config gets a spec, each shard divides exactly, and on
    a mesh with all four axes at most 2% of the parameters stay fully replicated."""
    mesh = {"data": 2, "fsdp": 2, "expert": 4, "tensor": 2}
    rows = R.sharding_table(name, mesh)
    for r in rows:
        assert math.prod(r["local_shape"]) * _ways(r["spec"], mesh) == r["size"], r
    total = sum(r["size"] for r in rows)
    replicated = sum(r["size"] for r in rows if not tuple(r["spec"]))
    assert replicated <= 0.02 * total, (name, replicated, total)


def _ways(spec, mesh):
    n = 1
    for entry in spec:
        for a in (() if entry is None else (entry,) if isinstance(entry, str) else entry):
            n *= mesh[a]
    return n


def test_kimi_k3_expert_weights_local_shape():
    rows = R.sharding_table("kimi_k3", {"fsdp": 16, "expert": 64, "tensor": 2})
    stacked = [r for r in rows if r["axes"] == ("layers", "experts", "latent", "expert_mlp")]
    assert stacked, "kimi_k3 has stacked routed-expert weights"
    for r in stacked:
        n, e, w, h = r["shape"]
        assert r["local_shape"] == (n, e // 64, w // 16, h // 2)


def test_state_shardings_and_constraints_on_one_device():
    mesh = make_mesh(devices=jax.devices()[:1])
    moe = MoE(8, num_experts=4, top_k=2, expert_hidden=6, rngs=nnx.Rngs(0))
    sh = R.state_shardings(moe, mesh)
    leaves = jax.tree.leaves(sh)
    assert leaves and all(isinstance(s, NamedSharding) for s in leaves)
    assert len(leaves) == len(jax.tree.leaves(nnx.state(moe)))
    x = jnp.ones((2, 3, 8))
    assert R.with_logical_constraint(x, ("batch", "seq", "embed")) is x        # no mesh: unchanged
    with pytest.raises(ValueError, match="logical_axes"):
        with R.logical_sharding(mesh):
            R.with_logical_constraint(x, ("batch", "embed"))
    with R.logical_sharding(mesh):
        assert R.current_logical_sharding()[0] is mesh
        y = jax.jit(lambda x: R.with_logical_constraint(x, ("batch", "seq", "embed")) * 2)(x)
    assert R.current_logical_sharding() is None
    assert float(jnp.sum(y)) == 2 * x.size


def test_expert_parallel_on_one_device_matches_moe():
    """The EP path with a trivial expert axis (1 device) reproduces the MoE exactly."""
    mesh = make_mesh(devices=jax.devices()[:1])
    moe = MoE(8, num_experts=4, top_k=2, expert_hidden=6, num_shared_experts=1, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(0), (2, 5, 8))
    y0, _ = moe(x)
    for impl in ("dense", "ragged_reference"):
        y, stats = jax.jit(lambda x: moe_forward(moe, x, ExpertParallel(mesh, impl=impl)))(x)
        assert float(jnp.max(jnp.abs(y - y0))) <= 1e-6 * float(jnp.max(jnp.abs(y0)))
        assert int(stats.tokens_dropped) == 0
    assert type(moe) is MoE                                     # the caller's module is untouched
    assert ExpertParallel(mesh).resolved_impl() == ("ragged" if jax.devices()[0].platform == "tpu" else "dense")
    with pytest.raises(ValueError, match="impl"):
        ExpertParallel(mesh, impl="nccl")
    with pytest.raises(ValueError, match="capacity_factor"):
        ExpertParallel(mesh, capacity_factor=0.0)


def test_without_mesh_axis_replicates_dense_weights_over_it():
    from lineage_jax.parallel import DEFAULT_RULES, logical_to_spec, without_mesh_axis

    rules = without_mesh_axis("expert")
    sizes = {"fsdp": 2, "expert": 4}
    assert logical_to_spec(("embed", "heads", "head_dim"), sizes, DEFAULT_RULES) == P(("fsdp", "expert"))
    assert logical_to_spec(("embed", "heads", "head_dim"), sizes, rules) == P("fsdp")
    assert logical_to_spec(("experts", "embed", "expert_mlp"), sizes, rules) == P("expert", "fsdp")
    assert logical_to_spec(("batch", "seq", "embed"), sizes, rules) == P(("fsdp", "expert"))   # tokens still split
    assert dict(rules)["vocab"] == dict(DEFAULT_RULES)["vocab"]
    with pytest.raises(ValueError, match="`axis`"):
        without_mesh_axis("experts")
    with pytest.raises(ValueError, match="without a rule"):
        without_mesh_axis("expert", names=("embedding",))
    with pytest.raises(ValueError, match="`names` must be a sequence"):
        without_mesh_axis("expert", names="embed")


def test_exchange_default_per_platform_and_the_gpu_ragged_warning():
    """``impl="auto"`` resolves per platform (ragged only on TPU: its gradient was wrong across
    GPUs), and an explicit ragged exchange over a GPU expert axis > 1 warns. The mesh is a stand-in
    with fake devices: only ``axis_names``, ``devices.shape`` and the platform are read."""
    import types
    import warnings

    import numpy as np

    def fake_mesh(platform, expert):
        devs = np.array([types.SimpleNamespace(platform=platform)] * expert, dtype=object).reshape(1, 1, expert, 1)
        return types.SimpleNamespace(axis_names=("data", "fsdp", "expert", "tensor"), devices=devs)

    assert ExpertParallel(fake_mesh("tpu", 2)).resolved_impl() == "ragged"
    assert ExpertParallel(fake_mesh("gpu", 2)).resolved_impl() == "dense"
    assert ExpertParallel(fake_mesh("cpu", 2)).resolved_impl() == "dense"
    with pytest.warns(RuntimeWarning, match="wrong gradients"):
        ExpertParallel(fake_mesh("gpu", 2), impl="ragged")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ExpertParallel(fake_mesh("gpu", 1), impl="ragged")     # one device: nothing crosses GPUs
        ExpertParallel(fake_mesh("tpu", 2), impl="ragged")
