"""Sharded vs one-device equivalence on 8 fake CPU devices.

Each test runs ``python -m tests.parallel._multi_device_checks <case>`` in a fresh
process (XLA_FLAGS must be set before JAX creates its CPU backend, which this pytest
worker may already have done) and asserts on the JSON it prints.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOL = 1e-5


def run_case(case: str, timeout: int = 600) -> dict:
    env = dict(os.environ)
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-m", "tests.parallel._multi_device_checks", case], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"case {case!r} failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert len(lines) == 1, f"case {case!r} printed no RESULT line:\n{proc.stdout[-3000:]}"
    return json.loads(lines[0][len("RESULT "):])


def test_expert_parallel_moe_equals_single_device():
    res = run_case("moe")
    for key in ("data=2,expert=4/dense", "data=2,expert=4/ragged_reference", "tensor=2,expert=4/dense",
                "expert=8/ragged_reference", "data=2,expert=4/dense+tiled", "expert=8/ragged_reference+tiled"):
        r = res[key]
        assert r["y_rel"] <= TOL and r["gx_rel"] <= TOL and r["gw_rel"] <= TOL, (key, r)
        assert r["dropped"] == 0, (key, r)                      # dropless by default
        assert r["all_to_all_ops"] >= 3, (key, r)               # tokens really move by all-to-all
    # capacity: the drop count and the kept rows match an independent NumPy model of the rule
    for key in ("capacity/dense/0.5", "capacity/dense/1.0", "capacity/ragged_reference/0.5"):
        r = res[key]
        assert r["dropped"] == r["expected_dropped"] > 0, (key, r)
        assert r["routed_rel"] <= TOL, (key, r)
    assert res["capacity/dense/0.5"]["dropped"] > res["capacity/dense/1.0"]["dropped"]
    assert "num_experts" in res["error_experts"] and "6" in res["error_experts"]
    assert "tokens" in res["error_tokens"]
    assert "16 devices" in res["error_mesh"] and "8 available" in res["error_mesh"]
    assert "divide" in res["error_mesh_rest"]


def _check_meshes(meshes):
    for name, r in meshes.items():
        assert r["loss_rel"] <= TOL, (name, r)
        assert r["grad_rel_max_leaf"] <= TOL and r["grad_rel"] <= TOL, (name, r)
        assert r["tokens_dropped"] == 0, (name, r)
        assert r["expert_parallel"] == ("expert" in name), (name, r)
        assert r["grad_w_gate_spec"] == r["w_gate_spec"], (name, r)   # gradients keep the parameter layout


def test_sharded_training_equals_single_device():
    """FSDP, expert-parallel (data x expert) and tensor x expert meshes; pure data parallelism (the
    data axis alone, every parameter replicated) is test_data_parallel_training_equals_single_device."""
    res = run_case("model")
    meshes = res["meshes"]
    assert set(meshes) == {"fsdp=8", "data=2,expert=4", "tensor=2,expert=4"}
    _check_meshes(meshes)

    # Parameters really are distributed: [layers, experts, embed, expert_mlp] and [vocab, embed].
    assert meshes["fsdp=8"]["w_gate_shards"] == [[2, 8, 8, 32]]        # embed over fsdp
    assert meshes["fsdp=8"]["embed_shards"] == [[256, 8]]
    assert meshes["data=2,expert=4"]["w_gate_shards"] == [[2, 2, 64, 32]]   # experts over expert
    assert meshes["data=2,expert=4"]["embed_shards"] == [[256, 16]]          # dense: expert axis as FSDP
    assert meshes["tensor=2,expert=4"]["w_gate_shards"] == [[2, 2, 64, 16]]  # + expert_mlp over tensor
    assert meshes["tensor=2,expert=4"]["embed_shards"] == [[128, 16]]         # vocab over tensor
    assert res["born_sharded"] == "tensor=2,expert=4"

    step = meshes["data=2,expert=4"]["step"]
    assert step["step"] == 1
    assert step["param_max_move"] > 1e-4                     # the step moved the parameters ...
    assert step["param_max_abs_diff"] <= 1e-6                # ... exactly as optax on one device does
    assert step["call_vs_apply"] == 0.0
    assert step["opt_mu_spec"] == meshes["data=2,expert=4"]["w_gate_spec"]   # Adam moments sharded like params


def test_muon_and_adafactor_update_on_a_mesh_as_on_one_device():
    """Optimizer states not laid out like the parameter tree (Muon's per-head dimension numbers, Adafactor's
    factored statistics) are placed on the mesh (their per-parameter buffers sharded, the rest replicated),
    and one step updates the parameters as on one device."""
    res = run_case("optimizers")
    for name in ("muon", "adafactor"):
        r = res[name]
        assert r["update_rel"] <= TOL and r["update_norm"] > 1e-3, (name, r)
        assert r["sharded_buffers"] > 0, (name, r)
    assert "does not split over the batch mesh axes" in res["error_batch"]  # TrainStep.shard_batch, B = 3 on fsdp=4
    assert "named by no sharding rule" in res["error_mesh_axes"]  # a mesh of axes ("dp", "ep")


@pytest.mark.slow  # the data axis (with expert) is test_sharded_training_equals_single_device's data=2,expert=4
def test_data_parallel_training_equals_single_device():
    res = run_case("model_data")
    assert set(res["meshes"]) == {"data=8"} and res["born_sharded"] == "data=8"
    _check_meshes(res["meshes"])
    assert res["meshes"]["data=8"]["w_gate_shards"] == [[2, 8, 64, 32]]   # pure data parallel: replicated


def test_sharded_decode_equals_single_device():
    res = run_case("decode")
    for name in ("data=2,expert=4", "tensor=2,expert=4"):
        r = res[name]
        assert r["prefill_rel"] <= TOL and r["decode_rel"] <= TOL, (name, r)
        assert r["expert_parallel"], r
        assert r["length"] == [7] * 8
        assert r["cache_shape"][1] == 8 and r["cache_shards"][0][1] < 8, r    # cache split over the batch
    assert res["init_max_abs_diff_between_meshes"] == 0.0
    assert "place" in res["other_layout_error"] and res["placed_rel"] <= TOL, res["placed_rel"]
    cap = res["capacity"]  # capacity dispatch decodes without expert parallelism, as one device does
    assert not cap["expert_parallel"] and cap["prefill_rel"] <= TOL and cap["decode_rel"] <= TOL, cap


@pytest.mark.slow
def test_tiny_kimi_linear_sharded():
    """The full tiny_kimi_linear (AttnRes, a dense first layer, unscanned). Its float32
    gradients are ~1e-4 from float64 ones even on one device, so sharding is judged
    against float64: it may not add error beyond float32 rounding."""
    res = run_case("kimi_linear")
    fp64 = res["fp64"]
    for name, r in res["meshes"].items():
        assert r["loss_rel"] <= TOL, (name, r)
        assert fp64[name] <= 2 * fp64["one_device"] + TOL, (name, fp64)
    assert res["meshes"]["data=2,expert=4"]["w_gate_shards"] == [[2, 64, 32]]
    assert res["meshes"]["fsdp=8"]["embed_shards"] == [[256, 8]]
    assert "num_experts" in res["error_experts"]


@pytest.mark.slow  # the default suite keeps test_sharded_training_equals_single_device and test_exact_resume
def test_train_loop_on_a_mesh_matches_one_device_and_resumes():
    """The train loop with TrainConfig.mesh (the CLI's --mesh): expert-parallel and tensor×FSDP
    runs equal one device per step, and a SIGTERM-preempted sharded run resumes exactly."""
    res = run_case("train_loop")
    for mesh in ("data=2,expert=4", "tensor=2,fsdp=4"):
        r = res[mesh]
        assert r["step"] == 4 and len(r["losses"]) == 4, (mesh, r)
        assert r["loss_rel"] <= TOL and r["val_loss_rel"] <= TOL, (mesh, r)
        assert r["losses"][-1] < r["losses"][0], (mesh, r)  # it trains
    assert res["data=2,expert=4"]["preempted_at"] == 2
    assert "batch_size=12" in res["error_batch"]
    assert "num_experts" in res["error_experts"]
    assert "16 devices" in res["error_devices"]
    assert res["dense_expert_axis_is_fsdp"]


@pytest.mark.slow  # tests/test_hf.py places a load on a one-device mesh in the default suite
def test_transformers_checkpoint_loads_onto_an_expert_parallel_mesh():
    res = run_case("hf_load")
    assert res["max_param_diff"] == 0.0 and res["placed_on_mesh"] == res["params"], res
    assert res["expert_sharded"] >= 3, res  # the routed experts' three weights split over "expert"
    assert res["logits_rel"] <= TOL, res


def test_flags_the_xla_parser_refuses_are_left_out(monkeypatch):
    """A compile-time flag whose name is in jaxlib's binaries but which XLA's flag parser refuses (fatal at
    start: "Unknown flag in XLA_FLAGS") is left out of the fake-device flags, the others kept; the probe
    runs once and its answer travels in the environment."""
    from tests import _fake_devices as FD

    monkeypatch.setenv(FD.REFUSED_ENV, "")
    monkeypatch.delenv(FD.REFUSED_ENV)                           # restored (absent) after the test
    monkeypatch.setattr(FD, "jaxlib_knows", lambda flag: True)
    gone = "xla_cpu_use_fusion_emitters"
    starts = []

    def start(cmd, env, **kw):
        starts.append(env["XLA_FLAGS"])
        if f"--{gone}=" in env["XLA_FLAGS"]:
            return subprocess.CompletedProcess(cmd, -6, "", f"F1205 parse_flags_from_env.cc:234] Unknown flag in "
                                                            f"XLA_FLAGS: --{gone}=false\n")
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(FD.subprocess, "run", start)
    flags = FD.fake_device_xla_flags(8, base="--xla_dump_to=x")
    assert gone not in flags, flags
    assert flags.startswith("--xla_dump_to=x --xla_force_host_platform_device_count=8"), flags
    for flag, value in FD.OPTIONAL_FLAGS:
        assert flag == gone or f"--{flag}={value}" in flags, (flag, flags)
    assert len(starts) == 2 and os.environ[FD.REFUSED_ENV] == gone
    assert FD.fake_device_xla_flags(8, base="") == flags[len("--xla_dump_to=x "):]
    assert len(starts) == 2                                      # probed once


def test_plan_counts_the_rows_the_gpu_exchange_sends():
    """``plan(hardware="h200")`` (the dense exchange GPUs run) against the traced expert-parallel forward on
    fake devices: its rows and element bytes are the all-to-all operand's, dropless and with the config's
    capacity dispatch."""
    res = run_case("plan_exchange")
    for name in ("dropless", "capacity"):
        r = res[name]
        assert r["exchange"] == "dense" and len(r["traced"]) == 1, r
        (rows, width), itemsize = r["traced"][0]
        assert (r["plan_rows"], r["width"], r["plan_act_bytes"]) == (rows, width, itemsize), r
        assert r["plan_bytes"] == rows * width * itemsize
    assert res["capacity"]["plan_rows"] < res["dropless"]["plan_rows"]


def test_delta_rule_kernels_run_per_device_under_a_sharded_layout():
    """``backend="pallas"`` inside a layout over data × fsdp × tensor: each kernel launch takes one device's
    share (a quarter of the batch, half the heads, under ``shard_map``), with the one-device call's outputs and
    gradients (DeltaNet, Gated DeltaNet, KDA; documents, an initial state); so do the short convolution's kernel
    and an MoE layer's grouped-matmul kernels (each device's tokens), and JAX's flash-attention kernels; built for
    a TPU the sharded steps lower to Mosaic calls (Mosaic refuses a kernel under a layout XLA would partition)."""
    res = run_case("pallas_mixers")
    for name in ("delta", "gdn", "kda"):
        r = res[name]
        assert r["max_rel"] < TOL, (name, r)
        assert r["sharded_kernel_elems"] * 8 == r["ref_kernel_elems"], (name, r)
        assert r["shard_maps"] > 0 and r["ref_shard_maps"] == 0, (name, r)
    assert res["conv"]["max_rel"] < TOL and res["conv"]["sharded_kernel_elems"] * 8 == res["conv"]["ref_kernel_elems"]
    assert res["moe"]["max_rel"] < TOL and res["moe"]["shard_maps"] > 0 == res["moe"]["ref_shard_maps"], res["moe"]
    assert res["attention"]["max_rel"] < TOL and res["attention"]["shard_maps"] > 0, res["attention"]
    assert res["tpu_export_mosaic_calls"] > 0 and res["tpu_export_attention_mosaic_calls"] > 0, res
