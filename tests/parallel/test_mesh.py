"""Mesh specs, mesh construction and multi-host detection (one device is enough)."""

import jax
import pytest
from jax.sharding import AxisType

from lineage_jax.parallel import mesh as M


def test_parse_full_spec():
    assert M.parse_mesh_spec("data=2,fsdp=1,tensor=1,expert=4") == {"data": 2, "fsdp": 1, "expert": 4, "tensor": 1}


def test_parse_missing_axes_are_one_and_whitespace_ignored():
    assert M.parse_mesh_spec(" expert = 8 ,") == {"data": 1, "fsdp": 1, "expert": 8, "tensor": 1}
    assert M.parse_mesh_spec("") == {"data": 1, "fsdp": 1, "expert": 1, "tensor": 1}
    assert M.parse_mesh_spec("data=-1,tensor=2")["data"] == -1


@pytest.mark.parametrize("spec, needle", [
    ("data=2,pipeline=4", "'pipeline'"),       # unknown axis, named
    ("data=two", "'data'"),                     # bad value, axis named
    ("expert=0", "'expert'"),
    ("tensor=-2", "'tensor'"),
    ("data=2,data=4", "'data'"),                # given twice
    ("data=-1,fsdp=-1", "-1"),                  # two 'rest' axes
    ("data", "axis=size"),                      # no '='
])
def test_parse_rejects(spec, needle):
    with pytest.raises(ValueError, match=needle.replace("(", r"\(")) as e:
        M.parse_mesh_spec(spec)
    assert "parse_mesh_spec" in str(e.value)


def test_parse_rejects_non_string():
    with pytest.raises(ValueError, match="spec"):
        M.parse_mesh_spec({"data": 2})


def test_resolve_rest_and_mismatch():
    assert M.resolve_axis_sizes({"data": -1, "expert": 4}, 32) == {"data": 8, "fsdp": 1, "expert": 4, "tensor": 1}
    assert M.resolve_axis_sizes("tensor=2", 2)["tensor"] == 2
    with pytest.raises(ValueError, match="needs 16 devices, larger than the 8"):
        M.resolve_axis_sizes({"data": 4, "expert": 4}, 8)
    with pytest.raises(ValueError, match="smaller than"):
        M.resolve_axis_sizes({"data": 2}, 8)
    with pytest.raises(ValueError, match="does not divide"):
        M.resolve_axis_sizes({"data": -1, "expert": 3}, 8)
    with pytest.raises(ValueError, match="'experts'"):
        M.resolve_axis_sizes({"experts": 2}, 2)


def test_make_mesh_one_device():
    mesh = M.make_mesh(devices=jax.devices()[:1])
    assert mesh.axis_names == M.MESH_AXES == ("data", "fsdp", "expert", "tensor")
    assert M.mesh_shape(mesh) == {"data": 1, "fsdp": 1, "expert": 1, "tensor": 1}
    assert all(t == AxisType.Auto for t in mesh.axis_types)
    with pytest.raises(ValueError, match="mesh"):
        M.make_mesh({"data": 2}, devices=jax.devices()[:1])
    with pytest.raises(ValueError, match="dcn"):
        M.make_mesh({"data": 1}, devices=jax.devices()[:1], dcn={"data": 2})


# ----------------------------------------------------------------------------- multi-host
def test_detect_cluster_single_host_is_none():
    assert M.detect_cluster({}) is None
    assert M.detect_cluster({"TPU_WORKER_HOSTNAMES": "localhost"}) is None
    assert M.detect_cluster({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "1"}) is None
    assert M.detect_cluster({"JAX_NUM_PROCESSES": "1"}) is None


def test_detect_cluster_explicit():
    env = {"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234", "JAX_NUM_PROCESSES": "4", "JAX_PROCESS_ID": "3"}
    assert M.detect_cluster(env) == dict(coordinator_address="10.0.0.1:1234", num_processes=4, process_id=3)


@pytest.mark.parametrize("env", [
    {"MEGASCALE_NUM_SLICES": "2"},
    {"TPU_WORKER_HOSTNAMES": "t1,t2,t3,t4"},
    {"TPU_PROCESS_ADDRESSES": "10.0.0.1:8476,10.0.0.2:8476"},
    {"SLURM_JOB_ID": "7", "SLURM_NTASKS": "16"},
    {"OMPI_COMM_WORLD_SIZE": "2"},
])
def test_detect_cluster_auto(env):
    assert M.detect_cluster(env) == {}


@pytest.mark.parametrize("env, needle", [
    ({"JAX_NUM_PROCESSES": "many"}, "JAX_NUM_PROCESSES"),
    ({"JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "0"}, "JAX_COORDINATOR_ADDRESS"),
    ({"JAX_NUM_PROCESSES": "2", "JAX_COORDINATOR_ADDRESS": "h:1", "JAX_PROCESS_ID": "2"}, "JAX_PROCESS_ID"),
    ({"SLURM_JOB_ID": "1", "SLURM_NTASKS": "x"}, "SLURM_NTASKS"),
])
def test_detect_cluster_bad_env(env, needle):
    with pytest.raises(ValueError, match=needle):
        M.detect_cluster(env)


def test_maybe_initialize_distributed(monkeypatch):
    calls = []
    monkeypatch.setattr(jax.distributed, "is_initialized", lambda: False)
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: calls.append(kw))
    assert M.maybe_initialize_distributed({}) is False and calls == []
    env = {"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "1"}
    assert M.maybe_initialize_distributed(env) is True
    assert calls == [dict(coordinator_address="h:1", num_processes=2, process_id=1)]
    assert M.maybe_initialize_distributed({"MEGASCALE_NUM_SLICES": "4"}) is True and calls[-1] == {}
    monkeypatch.setattr(jax.distributed, "is_initialized", lambda: True)
    assert M.maybe_initialize_distributed(env) is False and len(calls) == 2
