"""Meshes, rules, the planner (and the accounting it reads) on bad input: a ValueError naming the
argument, never a bare traceback or a silently wrong number (one device is enough)."""

import jax
import numpy as np
import pytest

from lineage_jax import accounting
from lineage_jax.parallel import mesh as M
from lineage_jax.parallel import plan as PL
from lineage_jax.parallel import rules as R
from lineage_jax.parallel.expert import ExpertParallel


# ----------------------------------------------------------------------------- mesh
@pytest.mark.parametrize("spec", ["data=1_0", "data=+2", "data=\u0662"])
def test_parse_rejects_sizes_that_are_not_plain_integers(spec):
    with pytest.raises(ValueError, match="size of mesh axis 'data' must be an integer"):
        M.parse_mesh_spec(spec)


@pytest.mark.parametrize("sizes", [["data"], 4, ("data", 2)])
def test_make_mesh_rejects_sizes_that_are_not_a_dict(sizes):
    with pytest.raises(ValueError, match="make_mesh: mesh axis sizes must be a dict"):
        M.make_mesh(sizes)


def test_numpy_integer_sizes_are_sizes():
    assert M.make_mesh({"data": np.int64(1)}).devices.size == 1


@pytest.mark.parametrize("n", [0, -4, 2.0])
def test_resolve_rejects_a_bad_device_count(n):
    with pytest.raises(ValueError, match="the device count must be a positive int"):
        M.resolve_axis_sizes("data=-1", n)


def test_make_mesh_on_no_devices():
    with pytest.raises(ValueError, match="the device count must be a positive int, got 0"):
        M.make_mesh("data=-1", devices=[])


# ----------------------------------------------------------------------------- rules
@pytest.mark.parametrize("rules, needle", [
    ((("embed", 3),), "logical axis 'embed' must map to None, a mesh axis or a tuple"),
    ((("embed", ("fsdp", "fsdp")),), "logical axis 'embed' names a mesh axis twice"),
])
def test_rules_reject_malformed_mesh_axes(rules, needle):
    with pytest.raises(ValueError, match=needle):
        R.rules_dict(rules)


@pytest.mark.parametrize("mesh, needle", [
    ({"fsdpp": 2}, "unknown mesh axis 'fsdpp'"),          # was silently ignored: P()
    ({"fsdp": 0}, "size of mesh axis 'fsdp' must be"),    # was ZeroDivisionError
    ({"fsdp": -1}, "has a -1 axis; resolve it first"),    # was a silently wrong table
])
def test_rules_reject_bad_mesh_sizes(mesh, needle):
    with pytest.raises(ValueError, match=needle):
        R.logical_to_spec(("embed",), mesh, shape=(8,))
    with pytest.raises(ValueError, match=needle):
        R.sharding_table("tiny_llama", mesh)


# ----------------------------------------------------------------------------- expert parallel
@pytest.mark.parametrize("cf", [float("inf"), float("nan"), "1.25", True, 0, -1.0])
def test_expert_parallel_rejects_a_bad_capacity_factor(cf):
    mesh = M.make_mesh("data=1", devices=jax.devices()[:1])
    with pytest.raises(ValueError, match="ExpertParallel: `capacity_factor` must be a positive finite number"):
        ExpertParallel(mesh, capacity_factor=cf)


# ----------------------------------------------------------------------------- plan
@pytest.mark.parametrize("kwargs, needle", [
    (dict(capacity_factor=float("inf")), "plan: `capacity_factor` must be a positive finite number"),  # OverflowError
    (dict(capacity_factor="1"), "plan: `capacity_factor` must be a positive finite number"),           # TypeError
    (dict(capacity_factor=0.0), "plan: `capacity_factor` must be a positive finite number"),
    (dict(mesh={"fsdp": -1}, devices=0), "plan: `devices` must be a positive int, got 0"),      # ZeroDivisionError
    (dict(devices=-1), "plan: `devices` must be a positive int, got -1"),
    (dict(mesh={"fsdpp": 2}), "plan: `mesh`: unknown mesh axis 'fsdpp'"),
    (dict(mesh=["fsdp"]), "plan: `mesh`: mesh axis sizes must be a dict"),
    (dict(config=3), "plan: `config` must be a ModelConfig or a config name, got int"),
])
def test_plan_rejects(kwargs, needle):
    args = dict(config="tiny_k3", mesh={"fsdp": 1}, batch=2, seq=4)
    args.update(kwargs)
    with pytest.raises(ValueError, match=needle):
        PL.plan(args.pop("config"), args.pop("mesh"), **args)


def test_plan_takes_a_mesh_string_like_make_mesh():
    assert PL.plan("tiny_k3", "fsdp=2", batch=2, seq=4)["mesh"]["fsdp"] == 2


@pytest.mark.parametrize("argv, needle", [
    (["--devices", "0", "--mesh", "fsdp=-1"], "`devices` must be a positive int"),
    (["--capacity-factor", "inf"], "`capacity_factor` must be a positive finite number"),
])
def test_plan_cli_reports_bad_flags(argv, needle, capsys):
    base = ["--config", "tiny_k3", "--batch", "2", "--seq", "4"]
    if "--mesh" not in argv:
        base += ["--mesh", "fsdp=1"]
    assert PL.main(base + argv) == 2
    assert needle in capsys.readouterr().err


# ----------------------------------------------------------------------------- accounting
@pytest.mark.parametrize("fn, args, needle", [
    (accounting.param_counts, (3,), "param_counts: `config` must be a ModelConfig or a config name, got int"),
    (accounting.param_table, (None,), "param_table: `config` must be a ModelConfig or a config name"),
    (accounting.flops_per_token, ("tiny_llama", 2.5), "flops_per_token: `seq_len` must be a positive int"),
    (accounting.flops_per_token, ("tiny_llama", float("nan")), "flops_per_token: `seq_len` must be a positive int"),
    (accounting.flops_per_token, ("tiny_llama", "8"), "flops_per_token: `seq_len` must be a positive int"),
    (accounting.cache_bytes_per_token, ("tiny_llama", 0), "cache_bytes_per_token: `dtype_bytes` must be a positive"),
    (accounting.cache_bytes_per_token, ("tiny_llama", -2), "cache_bytes_per_token: `dtype_bytes` must be a positive"),
    (accounting.state_bytes, ("tiny_kda", 2.5), "state_bytes: `dtype_bytes` must be a positive int"),
])
def test_accounting_rejects(fn, args, needle):
    with pytest.raises(ValueError, match=needle):
        fn(*args)



def test_a_mesh_the_rules_cannot_use_is_refused_by_name():
    """Not a Mesh (a spec string), or axes that are not AxisType.Auto (jax.make_mesh's default is Explicit):
    TrainStep, ShardedDecoder and init_sharded refuse it up front, naming `mesh`."""
    from flax import nnx
    from jax.sharding import AxisType, Mesh

    from lineage_jax.generate import ShardedDecoder
    from lineage_jax.models import Decoder, get_config
    from lineage_jax.train.step import TrainStep, init_sharded

    cfg = get_config("tiny_gpt2")
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    devices = np.array(jax.devices()[:1])
    explicit = Mesh(devices, ("data",), axis_types=(AxisType.Explicit,))
    for make in (lambda mesh: TrainStep(model, mesh), lambda mesh: ShardedDecoder(model, mesh, batch_size=1, max_len=8),
                 lambda mesh: init_sharded(cfg, mesh)):
        with pytest.raises(ValueError, match="`mesh` must be a jax.sharding.Mesh .* got str"):
            make("data=1")
        with pytest.raises(ValueError, match="`mesh` axes must all be AxisType.Auto"):
            make(explicit)
    R.check_mesh("f", M.make_mesh({"data": 1}))
    R.check_mesh("f", Mesh(devices, ("dp",), axis_types=(AxisType.Auto,)))  # a size-1 axis replicates nothing


def test_train_step_checks_its_router_bias_settings():
    from flax import nnx

    from lineage_jax.models import Decoder, get_config
    from lineage_jax.train.step import TrainStep

    model = Decoder(get_config("tiny_gpt2"), rngs=nnx.Rngs(0))
    mesh = M.make_mesh({"data": 1})
    for kw, match in ((dict(router_bias_rate=float("nan")), "router_bias_rate"),
                      (dict(router_bias_rate=-1.0), "router_bias_rate"),
                      (dict(router_bias_rule="mean"), "router_bias_rule")):
        with pytest.raises(ValueError, match=match):
            TrainStep(model, mesh, **kw)


def test_make_mesh_refuses_a_device_listed_twice():
    d = jax.devices()[0]
    with pytest.raises(ValueError, match="make_mesh: `devices` lists a device more than once"):
        M.make_mesh({"data": 2}, devices=[d, d])


def test_auto_expert_parallelism_is_off_where_the_rules_keep_experts_whole():
    from flax import nnx

    from lineage_jax.models import Decoder, get_config
    from lineage_jax.parallel.expert import resolve_expert_parallel

    model = Decoder(get_config("tiny_kimi_linear"), rngs=nnx.Rngs(0))
    rules = tuple((name, None if name == "experts" else axes) for name, axes in R.DEFAULT_RULES)
    assert resolve_expert_parallel(model, M.make_mesh({"data": 1}), rules, "auto") is None
    with pytest.raises(ValueError, match="exactly one mesh axis"):  # asked for explicitly, it is refused
        resolve_expert_parallel(model, M.make_mesh({"data": 1}), rules, True)
