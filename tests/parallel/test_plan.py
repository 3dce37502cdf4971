"""The per-device memory / communication planner."""

import pytest

from lineage_jax import accounting
from lineage_jax.parallel import plan as PL

K3_MESH = {"fsdp": 16, "expert": 64}


def test_one_device_holds_everything():
    p = PL.plan("tiny_kimi_linear", {}, batch=4, seq=32)
    total = accounting.param_counts("tiny_kimi_linear")["total"]
    assert p["devices"] == 1 and p["params_total"] == p["params_per_device"] == total
    assert p["train_state_bytes_per_device"] == 16 * total
    assert p["moe"]["off_device_fraction"] == 0.0 and p["fsdp_gather_bytes_per_device_per_step"] == 0
    assert p["tokens_per_device"] == 4 * 32


def test_fsdp_traffic_counts_every_sharded_weight():
    """On a pure FSDP mesh every sharded dimension is a width over fsdp, gathered before use: the planner's
    all-gather bytes are Σ (shard count − 1) × local size × 4 over every parameter of the sharding table
    (the low-rank inputs q_lora, kv_lora, gate_rank included)."""
    from lineage_jax.parallel.rules import sharding_table

    rows = sharding_table("tiny_k3", {"fsdp": 4})
    want = sum(4 * r["local_size"] * (r["size"] // r["local_size"] - 1) for r in rows)
    assert any("q_lora" in r["axes"] and r["size"] > r["local_size"] for r in rows)
    assert PL.plan("tiny_k3", {"fsdp": 4}, batch=4, seq=16)["fsdp_gather_bytes_per_device_per_step"] == want


def test_kimi_k3_numbers():
    p = PL.plan("kimi_k3", K3_MESH, batch=1024, seq=8192, capacity_factor=1.25, hardware="tpu_v5p")
    total = accounting.param_counts("kimi_k3")["total"]
    assert p["devices"] == 1024 and p["params_total"] == total
    # at least the even split; within 5% of it (a few low-rank dims do not divide over 1024 devices)
    assert total / 1024 <= p["params_per_device"] <= 1.05 * total / 1024
    assert p["by_component"]["routed_experts"]["per_device"] * 1024 == p["by_component"]["routed_experts"]["total"]
    m = p["moe"]
    assert m["moe_layers"] == 92 and m["experts_per_device"] == 14 and m["routed_width"] == 3584
    assert p["tokens_per_device"] == 8192
    assert m["exchange"] == "ragged" and m["act_bytes"] == 4                # TPU; kimi_k3's dtype is float32
    assert m["bytes_one_way_per_layer"] == 8192 * 16 * 3584 * 4             # the n·k rows that exist
    assert m["bytes_train_all_layers"] == 4 * 92 * m["bytes_one_way_per_layer"]
    assert m["receive_buffer_rows"] == 64 * 2560                         # ceil(1.25 * 8192 * 16 / 64) per source
    assert 0 < p["hbm_fraction_train_state"] < 1
    assert p["lower_bound_seconds_per_step"]["compute_s"] > 0


def test_dropless_buffer_is_worst_case():
    p = PL.plan("kimi_k3", K3_MESH, batch=1024, seq=8192)
    assert p["moe"]["receive_buffer_rows"] == 64 * 8192 * 14            # ep * n * min(k, E_local)


def test_gpu_exchange_sends_the_padded_buffer():
    """GPUs run the dense exchange: every source sends its whole ``[ep·C, W]`` buffer (the multi-device test
    checks the rows against a traced exchange); ``act_bytes`` overrides the config's dtype."""
    p = PL.plan("kimi_k3", {"fsdp": 8, "expert": 64}, batch=512, seq=8192, hardware="h200", capacity_factor=1.25)
    m = p["moe"]
    assert m["exchange"] == "dense" and m["rows_per_device"] == m["receive_buffer_rows"] == 64 * 2560
    assert m["bytes_one_way_per_layer"] == 64 * 2560 * 3584 * 4
    m2 = PL.plan("kimi_k3", {"fsdp": 8, "expert": 64}, batch=512, seq=8192, hardware="h200", capacity_factor=1.25,
                 act_bytes=2)["moe"]
    assert m2["bytes_one_way_per_layer"] * 2 == m["bytes_one_way_per_layer"]


def test_capacity_follows_the_config_as_expert_parallel_does():
    from lineage_jax.models import get_config

    cfg = get_config("tiny_kimi_linear", moe_dispatch="capacity", capacity_factor=1.0)
    assert PL.plan(cfg, {"expert": 4}, batch=8, seq=64)["moe"]["capacity_factor"] == 1.0
    assert PL.plan(cfg, {"expert": 4}, batch=8, seq=64, capacity_factor=2.0)["moe"]["capacity_factor"] == 2.0
    assert PL.plan("tiny_kimi_linear", {"expert": 4}, batch=8, seq=64)["moe"]["capacity_factor"] is None


def test_every_dropped_dimension_is_listed():
    from lineage_jax.parallel.rules import sharding_table

    want = {(r["path"], d) for r in sharding_table("kimi_k3", {"fsdp": 16, "expert": 64}) for d, _, _ in r["dropped"]}
    got = PL.plan("kimi_k3", K3_MESH, batch=1024, seq=8192)["dropped_axes"]
    assert len(want) > 8 and {(x["param"], x["dim"]) for x in got} == want and len(got) == len(want)


def test_numpy_ints_are_taken():
    import numpy as np

    p = PL.plan("tiny_kimi_linear", {}, batch=np.int64(4), seq=np.int32(32), act_bytes=np.int64(2))
    assert p["tokens_per_device"] == 128 and p["moe"]["act_bytes"] == 2


def test_h200_off_node_fraction():
    p = PL.plan("kimi_k3", {"fsdp": 8, "expert": 64}, batch=512, seq=8192, hardware="h200")
    assert p["moe"]["off_node_fraction"] == pytest.approx(56 / 64)


@pytest.mark.parametrize("kw, needle", [
    (dict(mesh={"expert": 3}, batch=3, seq=8), "num_experts"),
    (dict(mesh={"data": 4}, batch=6, seq=8), "batch"),
    (dict(mesh={"data": -1}, batch=4, seq=8), "devices"),
    (dict(mesh={}, batch=0, seq=8), "batch"),
    (dict(mesh={}, batch=2, seq=8, hardware="abacus"), "hardware"),
    (dict(mesh={}, batch=2, seq=8, hardware=[]), "hardware"),
    (dict(mesh={"fsdp": 4}, batch=4, seq=8, devices=8), "`devices` says 8"),
    (dict(mesh={}, batch=2, seq=8, act_bytes=0), "act_bytes"),
])
def test_plan_rejects(kw, needle):
    with pytest.raises(ValueError, match=needle):
        PL.plan("kimi_k3", **kw)


def test_plan_rejects_a_sequence_past_learned_positions_and_experts_on_two_axes():
    from lineage_jax.parallel.rules import DEFAULT_RULES

    with pytest.raises(ValueError, match="`seq`=100000 is longer than tiny_gpt2's learned position table"):
        PL.plan("tiny_gpt2", {}, batch=1, seq=100000)
    rules = tuple((n, ("expert", "fsdp")) if n == "experts" else (n, a) for n, a in DEFAULT_RULES)
    with pytest.raises(ValueError, match="'experts' to exactly one mesh axis"):
        PL.plan("tiny_kimi_linear", {"expert": 2, "fsdp": 2}, batch=4, seq=8, rules=rules)


def test_cli(capsys):
    assert PL.main(["--config", "tiny_kimi_linear", "--mesh", "data=2,expert=4", "--batch", "8", "--seq", "64"]) == 0
    out = capsys.readouterr().out
    assert "tiny_kimi_linear on mesh data=2,fsdp=1,expert=4,tensor=1 (8 devices)" in out
    assert "all-to-all per MoE layer" in out
    assert PL.main(["--config", "tiny_kimi_linear", "--mesh", "expert=3", "--batch", "9", "--seq", "8"]) == 2
    assert "num_experts" in capsys.readouterr().err
