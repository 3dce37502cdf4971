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
    assert m["bytes_one_way_per_layer"] == 8192 * 16 * 3584 * 2
    assert m["bytes_train_all_layers"] == 4 * 92 * m["bytes_one_way_per_layer"]
    assert m["receive_buffer_rows"] == 64 * 2560                         # ceil(1.25 * 8192 * 16 / 64) per source
    assert 0 < p["hbm_fraction_train_state"] < 1
    assert p["lower_bound_seconds_per_step"]["compute_s"] > 0


def test_dropless_buffer_is_worst_case():
    p = PL.plan("kimi_k3", K3_MESH, batch=1024, seq=8192)
    assert p["moe"]["receive_buffer_rows"] == 64 * 8192 * 14            # ep * n * min(k, E_local)


def test_h200_off_node_fraction():
    p = PL.plan("kimi_k3", {"fsdp": 8, "expert": 64}, batch=512, seq=8192, hardware="h200")
    assert p["moe"]["off_node_fraction"] == pytest.approx(56 / 64)


@pytest.mark.parametrize("kw, needle", [
    (dict(mesh={"expert": 3}, batch=3, seq=8), "num_experts"),
    (dict(mesh={"data": 4}, batch=6, seq=8), "batch"),
    (dict(mesh={"data": -1}, batch=4, seq=8), "devices"),
    (dict(mesh={}, batch=0, seq=8), "batch"),
    (dict(mesh={}, batch=2, seq=8, hardware="abacus"), "hardware"),
])
def test_plan_rejects(kw, needle):
    with pytest.raises(ValueError, match=needle):
        PL.plan("kimi_k3", **kw)


def test_cli(capsys):
    assert PL.main(["--config", "tiny_kimi_linear", "--mesh", "data=2,expert=4", "--batch", "8", "--seq", "64"]) == 0
    out = capsys.readouterr().out
    assert "tiny_kimi_linear on mesh data=2,fsdp=1,expert=4,tensor=1 (8 devices)" in out
    assert "all-to-all per MoE layer" in out
    assert PL.main(["--config", "tiny_kimi_linear", "--mesh", "expert=3", "--batch", "9", "--seq", "8"]) == 2
    assert "num_experts" in capsys.readouterr().err
