"""experiments.kv_read: the cache reads agree and every row is reported (tiny, CPU)."""

import json

import pytest

from experiments import kv_read as probe


def test_three_reads_agree_and_are_reported(tmp_path, capsys):
    rows = probe.main(["--context", "512", "--heads", "4", "--head-dim", "16", "--batch", "2", "--steps", "2",
                       "--dtype", "float32", "--mla-rank", "16", "--mla-rope", "8", "--out", str(tmp_path)])
    assert [r["form"] for r in rows] == ["dot", "heads_major", "reduce", "mla_dot", "mla_reduce"]
    for r in rows:
        assert r["ms_per_step"] > 0 and r["read_gb_per_s"] > 0
        per_token = 24 if r["form"].startswith("mla") else 2 * 4 * 16  # --mla-rank 16 + --mla-rope 8
        assert r["bytes_read"] == 2 * 512 * per_token * 4
        assert r["max_abs_diff_vs_dot"] < 1e-5  # the same first step's output from every form of a family
    assert json.loads((tmp_path / "kv_read" / "kv_read.json").read_text())["rows"] == rows
    assert "heads_major" in capsys.readouterr().out
    with pytest.raises(ValueError, match="context"):
        probe.run(5, 4, 16, 1, "float32", 2)  # 2 timed + 3 warm-up writes need 6 slots
    with pytest.raises(ValueError, match="^heads:"):
        probe.run(64, 0, 16, 1, "float32", 2)
    with pytest.raises(ValueError, match="^dtype:"):
        probe.run(64, 4, 16, 1, "int8", 2)
    gqa = probe.run(64, 4, 16, 1, "float32", 2, mla_rank=8, mla_rope=8, kv_heads=2)
    assert [r["form"] for r in gqa] == ["dot", "reduce", "mla_dot", "mla_reduce"]  # heads_major: no GQA
    assert gqa[0]["bytes_read"] == 2 * 64 * 2 * 16 * 4 and gqa[1]["max_abs_diff_vs_dot"] < 1e-5
    with pytest.raises(ValueError, match="^kv_heads:"):
        probe.run(64, 4, 16, 1, "float32", 2, kv_heads=3)
    with pytest.raises(ValueError, match="^mla_rank:"):
        probe.run(64, 4, 16, 1, "float32", 2, mla_rank=0)
