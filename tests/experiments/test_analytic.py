"""The analytic experiments reproduce hand-computed numbers from the library.

Expected values below are only constants worked by hand (the d = 4 worked
examples, 36,864 B/token, 37.7 MB, 124M, 2.8T, 1.5B, ≈1,867×, ~98%); everything
else is checked for consistency (linearity, flatness, optima), not against
typed-in results.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from experiments import accountant, chunk_dial, common, memory_wall, mochi

REPO = Path(__file__).resolve().parents[2]

# The worked d = 4 examples (interference, delta-rule overwrite, chunked solve, scalar gate,
# per-channel gate), computed by hand.
WORKED_INTERFERENCE_READ = [2, 2.8, 0.6, 2.2]
WORKED_OVERWRITE_READ = [1, 0, 2, 2]  # = v_Biscuit
WORKED_OVERWRITE_V_OLD = [2, 1, 0, 1]  # = v_Mochi
WORKED_OVERWRITE_U = [-1, -1, 2, 1]
WORKED_WY_U2 = [-1.2, 2.4, 1, 1.4]
WORKED_WY_V_OLD = [1.2, 0.6, 0, 0.6]
WORKED_SURVIVAL = 0.405  # 0.9 · 0.5 · 0.9
WORKED_MOCHI = [2, 1, 0, 1]
WORKED_REX = [0, 3, 1, 2]
WORKED_KEY_OVERLAP = 0.6
ATOL = 1e-5


def _assert_files(record: dict):
    js, png = Path(record["files"]["json"]), Path(record["files"]["png"])
    assert js.is_file() and png.is_file()
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    on_disk = json.loads(js.read_text())
    for key in ("date", "git_commit", "git_dirty", "jax_version", "device"):
        assert key in on_disk
    assert on_disk["jax_version"] and on_disk["device"]["platform"]
    assert on_disk["git_commit"] is None or re.fullmatch(r"[0-9a-f]{7,40}", on_disk["git_commit"])
    return on_disk


# ----------------------------------------------------------------------------- mochi
@pytest.fixture(scope="module")
def mochi_record(tmp_path_factory):
    return mochi.run(out=str(tmp_path_factory.mktemp("results")))


def test_mochi_headline_numbers_match_hand_computation(mochi_record):
    r = mochi_record
    np.testing.assert_allclose(r["interference_read"], WORKED_INTERFERENCE_READ, atol=ATOL)
    np.testing.assert_allclose(r["overwrite_read"], WORKED_OVERWRITE_READ, atol=ATOL)
    np.testing.assert_allclose(r["wy_u2"], WORKED_WY_U2, atol=ATOL)
    assert r["survival"] == pytest.approx(WORKED_SURVIVAL, abs=1e-6)
    assert r["gated_survival"]["strength_chunked"] == pytest.approx(WORKED_SURVIVAL, abs=1e-6)
    np.testing.assert_allclose(r["gated_survival"]["read"], WORKED_SURVIVAL * np.asarray(WORKED_MOCHI), atol=ATOL)


def test_mochi_worked_steps_match_hand_computation(mochi_record):
    r = mochi_record
    # Read-back identity: unit key returns v; |k|² = 4 returns 4v.
    np.testing.assert_allclose(r["read_back"]["unit_key_read"], WORKED_REX, atol=ATOL)
    assert r["read_back"]["long_key_gain"] == pytest.approx(r["read_back"]["long_key_norm_sq"], abs=1e-5)
    # Interference law: error = (k_cat · k_dog) v_Rex.
    assert r["interference"]["key_overlap"] == pytest.approx(WORKED_KEY_OVERLAP)
    np.testing.assert_allclose(r["interference"]["error"], WORKED_KEY_OVERLAP * np.asarray(WORKED_REX), atol=ATOL)
    # Clean delta-rule overwrite: READ v_old, SUBTRACT u, and Silver's row untouched.
    np.testing.assert_allclose(r["overwrite"]["v_old"], WORKED_OVERWRITE_V_OLD, atol=ATOL)
    np.testing.assert_allclose(r["overwrite"]["u"], WORKED_OVERWRITE_U, atol=ATOL)
    np.testing.assert_allclose(r["overwrite"]["silver_read_after"], r["overwrite"]["silver_read_before"], atol=ATOL)
    # Chunked solve: the sequential read agrees with the solve.
    np.testing.assert_allclose(r["wy_solve"]["sequential_v_old"], WORKED_WY_V_OLD, atol=ATOL)
    np.testing.assert_allclose(r["wy_solve"]["sequential_u2"], WORKED_WY_U2, atol=ATOL)
    np.testing.assert_allclose(r["wy_solve"]["u1"], WORKED_MOCHI, atol=ATOL)
    assert r["wy_solve"]["chunk_vs_scan_max_abs_dev"] < 1e-5


def test_mochi_contaminated_board(mochi_record):
    c = mochi_record["contaminated"]
    np.testing.assert_allclose(c["cat_read_before"], WORKED_INTERFERENCE_READ, atol=ATOL)  # Rex bled in
    np.testing.assert_allclose(c["cat_read_after"], WORKED_OVERWRITE_READ, atol=ATOL)  # clean Biscuit
    assert np.max(np.abs(c["dog_shift"])) > 0.1  # the side effect on the overlapping fact
    np.testing.assert_allclose(c["dog_shift"], c["dog_shift_predicted"], atol=ATOL)


def test_mochi_twin_boards(mochi_record):
    t = mochi_record["twin_boards"]
    alpha = t["switch_alpha"]
    assert t["gdn_mochi_kept"] == pytest.approx(alpha, abs=1e-5)  # the cat was shot
    assert t["kda_mochi_kept"] == pytest.approx(1.0, abs=1e-5)  # the cat lives
    np.testing.assert_allclose(t["gdn_cat_read"], alpha * np.asarray(WORKED_MOCHI), atol=ATOL)
    np.testing.assert_allclose(t["kda_cat_read"], WORKED_MOCHI, atol=ATOL)
    assert t["gdn_junk_kept"] == pytest.approx(alpha, abs=1e-5)
    assert t["kda_junk_kept"] == pytest.approx(alpha, abs=1e-5)  # the junk faded on both boards
    _assert_files(mochi_record)


def test_mochi_cli_json(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "experiments.mochi", "--json", "--out", str(tmp_path)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    record = json.loads(proc.stdout)
    for key in ("interference_read", "overwrite_read", "wy_u2", "survival", "contaminated", "twin_boards", "read_back"):
        assert key in record
    np.testing.assert_allclose(record["interference_read"], WORKED_INTERFERENCE_READ, atol=ATOL)
    np.testing.assert_allclose(record["wy_u2"], WORKED_WY_U2, atol=ATOL)
    assert (tmp_path / "mochi" / "mochi.json").is_file() and (tmp_path / "mochi" / "mochi.png").is_file()


# ----------------------------------------------------------------------------- memory wall
@pytest.fixture(scope="module")
def wall(tmp_path_factory):
    return memory_wall.run(quick=True, out=str(tmp_path_factory.mktemp("results")))


def _bytes_at(record, label, tokens):
    return record["lines"][label]["bytes"][record["contexts"].index(tokens)]


def test_memory_wall_gpt2_numbers(wall):
    gpt2 = wall["lines"]["GPT-2 small (MHA)"]
    assert gpt2["cache_bytes_per_token"] == 2 * 12 * 12 * 64 * 2 == 36_864  # by hand
    at_1k = _bytes_at(wall, "GPT-2 small (MHA)", 1024)
    assert at_1k == 36_864 * 1024
    assert at_1k / 1e6 == pytest.approx(37.7, abs=0.05)
    # At 1M tokens the cache outweighs the model.
    assert _bytes_at(wall, "GPT-2 small (MHA)", 1 << 20) > gpt2["weights_bytes_bf16"]
    # A 2.8T-scale MHA model needs terabytes of cache at 1M tokens.
    assert _bytes_at(wall, "dense 2.8T MHA (hypothetical)", 1 << 20) > 1e12
    assert wall["lines"]["dense 2.8T MHA (hypothetical)"]["params_total"] / 1e12 == pytest.approx(2.8, abs=0.05)
    _assert_files(wall)


def test_memory_wall_cache_formula_matches_config_shapes(wall):
    # bytes/token = 2 × n_layers × n_kv_heads × d_head × 2 (bf16) for the softmax models.
    for label in ("GPT-2 small (MHA)", "70B GQA (Llama-2-70B shape)", "dense 2.8T MHA (hypothetical)"):
        line = wall["lines"][label]
        assert line["cache_bytes_per_token"] == 2 * line["layers"]["softmax"] * line["kv_heads"] * line["head_dim"] * 2
    gqa = wall["lines"]["70B GQA (Llama-2-70B shape)"]
    assert gqa["kv_heads"] < gqa["heads"] and gqa["params_total"] / 1e9 == pytest.approx(70, rel=0.05)


def test_memory_wall_shapes(wall):
    ctx = np.asarray(wall["contexts"], np.float64)
    assert ctx[0] == 1 << 10 and ctx[-1] == 1 << 20 and np.all(np.diff(ctx) > 0)
    kda = np.asarray(wall["lines"]["K3: KDA states only"]["bytes"], np.float64)
    assert kda[0] > 0 and np.all(kda == kda[0])  # flat in context
    for label in ("GPT-2 small (MHA)", "70B GQA (Llama-2-70B shape)", "dense 2.8T MHA (hypothetical)",
                  "K3: MLA layers only"):
        b = np.asarray(wall["lines"][label]["bytes"], np.float64)
        np.testing.assert_allclose(b / ctx, b[0] / ctx[0], rtol=1e-12)  # linear through the origin
        assert b[-1] / b[0] == pytest.approx(ctx[-1] / ctx[0])
    hybrid = np.asarray(wall["lines"]["K3 hybrid total"]["bytes"], np.float64)
    mla = np.asarray(wall["lines"]["K3: MLA layers only"]["bytes"], np.float64)
    np.testing.assert_allclose(hybrid, mla + kda, rtol=1e-12)
    # fills an H200 exactly where the line crosses 141 GB
    dense = wall["lines"]["dense 2.8T MHA (hypothetical)"]
    assert dense["fills_h200_at_tokens"] * dense["cache_bytes_per_token"] == pytest.approx(wall["h200_hbm_bytes"])
    assert wall["lines"]["K3: KDA states only"]["fills_h200_at_tokens"] is None


# ----------------------------------------------------------------------------- accountant
@pytest.fixture(scope="module")
def acct(tmp_path_factory):
    return accountant.run(out=str(tmp_path_factory.mktemp("results")))


def test_accountant_headline_ratio(acct):
    k3, small = acct["models"]["kimi_k3"], acct["models"]["gpt2_small"]
    assert k3["total"] / 1e12 == pytest.approx(2.8, abs=0.05)  # "2.8 trillion"
    assert small["total"] / 1e6 == pytest.approx(124, abs=0.5)  # "124 million"
    ratio = acct["ratio_total_vs_gpt2_small"]
    assert ratio == k3["total"] / small["total"]
    assert 22_300 <= ratio < 22_700  # the headline 22,580 is 2.8T / 124M rounded
    # the computed ratio agrees with the published one (2.8T / 124M) within that one's rounding
    assert ratio == pytest.approx(acct["seed_headline_ratio"], rel=0.02)
    _assert_files(acct)


def test_accountant_gpt2_xl_and_active(acct):
    xl = acct["models"]["gpt2_xl"]
    assert (xl["layers"], xl["d_model"], xl["num_heads"]) == (48, 1600, 25)
    assert 1.5e9 <= xl["total"] < 1.6e9  # "the 1.5B-parameter XL"
    assert acct["ratio_total_vs_gpt2_xl"] == acct["models"]["kimi_k3"]["total"] / xl["total"]
    assert acct["ratio_total_vs_gpt2_xl"] == pytest.approx(1_867, rel=0.1)  # "about 1,867×"
    # per-token active parameters: "hundreds, not tens of thousands"
    assert 100 <= acct["ratio_active_vs_gpt2_small_active"] < 1000
    assert acct["models"]["kimi_k3"]["active"] < 0.1 * acct["models"]["kimi_k3"]["total"]


def test_accountant_component_shares(acct):
    shares = acct["k3_component_shares"]
    assert sum(shares.values()) == pytest.approx(1.0, abs=1e-12)
    assert acct["routed_expert_share"] > 0.97  # "~98% of parameters are MoE expert FFNs"
    assert max(shares, key=shares.get) == "routed_experts"
    assert acct["all_expert_share"] > 0.95  # "~95%+ expert FFNs"
    assert acct["gpt2_small_mlp_share_of_blocks"] == pytest.approx(2 / 3, abs=0.01)  # "two-thirds ... MLPs"


# ----------------------------------------------------------------------------- chunk dial
@pytest.fixture(scope="module")
def dial(tmp_path_factory):
    # The quick budget at T = 128 (quick's own T is 1024): eight chunk sizes per rule instead of
    # eleven, each one more compilation; nothing checked below depends on T.
    return chunk_dial.run(quick=True, out=str(tmp_path_factory.mktemp("results")), seq_len=128)


def test_chunk_dial_quick(dial):
    p = dial["params"]
    T, d, BH = p["seq_len"], p["head_dim"], p["batch"] * p["heads"]
    assert dial["chunk_sizes"] == [2 ** e for e in range(int(np.log2(T)) + 1)]
    for rule, r in dial["rules"].items():
        Cs = [row["C"] for row in r["rows"]]
        flops = np.asarray([row["analytic_flops"] for row in r["rows"]])
        assert r["flop_optimal_C"] == min(Cs) == 1
        assert np.all(np.diff(flops) > 0)
        assert r["wall_clock_optimal_C"] in Cs
        assert r["wall_clock_optimal_s"] == min(row["median_s"] for row in r["rows"])
        assert all(row["median_s"] > 0 for row in r["rows"])
        assert max(row["max_rel_err_vs_recurrent"] for row in r["rows"]) < 1e-4  # every C is the same memory
    lin = dial["rules"]["linear_attention"]["rows"]
    for row in lin:  # the chunked form's law 2Ld² + 2LCd, per (batch, head)
        assert row["analytic_flops"] == BH * (2 * T * d * d + 2 * T * row["C"] * d)
    _assert_files(dial)


def test_chunk_dial_rejects_bad_arguments(capsys):
    with pytest.raises(SystemExit):
        chunk_dial.main(["--quick", "--seq-len", "1000"])
    assert "power of two" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        chunk_dial.main(["--quick", "--rules", "softmax"])
    assert "invalid choice" in capsys.readouterr().err
    with pytest.raises(ValueError, match="seq_len"):
        chunk_dial.dial(True, seq_len=0)
    with pytest.raises(SystemExit):
        mochi.main(["--bogus"])
    assert "unrecognized arguments" in capsys.readouterr().err


def test_common_helpers(tmp_path):
    bad = tmp_path / "a_file"
    bad.write_text("x")
    with pytest.raises(SystemExit):
        common.make_parser("x", "y").parse_args(["--out", str(bad)])
    assert common.fmt_tokens(1 << 17) == "128K" and common.fmt_tokens(1 << 20) == "1M"
    assert common.fmt_bytes(37.7e6) == "37.7 MB"
    table = common.format_table(["a", "b"], [["x", 1.5], ["yy", [1, 2]]])
    assert table.splitlines()[2].startswith("x ") and "[1, 2]" in table
    commit = common.git_commit(REPO)
    assert commit is None or re.fullmatch(r"[0-9a-f]{40}", commit)
    assert common.git_commit(tmp_path) is None
    assert common.git_dirty(tmp_path) is None  # not a repository (a repository's status: the next test)


def test_git_dirty_sees_uncommitted_changes(tmp_path):
    import shutil
    import subprocess

    if shutil.which("git") is None:
        pytest.skip("git not installed")
    git = lambda *a: subprocess.run(["git", "-C", str(tmp_path), *a], check=True, capture_output=True)  # noqa: E731
    git("init", "-q")
    (tmp_path / "f.txt").write_text("a\n")
    git("add", "f.txt")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
    assert common.git_dirty(tmp_path) is False
    assert re.fullmatch(r"[0-9a-f]{40}", common.git_commit(tmp_path))
    (tmp_path / "f.txt").write_text("b\n")
    assert common.git_dirty(tmp_path) is True
