"""Smoke runs of the training and attention benchmarks (tiny sizes on the CPU)."""

import json

import pytest

from experiments import attention_bench, train_bench


def test_train_bench_quick_runs_and_compares_to_the_reference(tmp_path):
    rec = train_bench.run(quick=True, out=str(tmp_path), rows="reference,softmax", remat="dots")
    rows = {r["row"]: r for r in rec["results"]}
    assert rows["reference"]["status"] == rows["softmax"]["status"] == "ok"
    assert rows["reference"]["vs_reference"] == 1.0
    assert rows["softmax"]["tokens_per_s"] > 0 and rows["softmax"]["memory_bytes"] > 0
    assert all(l == l for l in rows["softmax"]["losses"])  # finite, not NaN
    saved = json.loads((tmp_path / "train_bench" / "train_bench.json").read_text())
    assert saved["results"][1]["row"] == "softmax" and (tmp_path / "train_bench" / "train_bench.png").stat().st_size


@pytest.mark.parametrize("kw, match", [(dict(rows="softmax,transformer"), "--rows"), (dict(remat="some"), "--remat"),
                                       (dict(shapes="4by4096"), "--shapes"),
                                       (dict(overrides=["no_such_field=1"]), "no_such_field")])
def test_train_bench_refuses_bad_arguments(tmp_path, kw, match):
    with pytest.raises(ValueError, match=match):
        train_bench.run(quick=True, out=str(tmp_path), **kw)


def test_train_bench_moe_row_has_the_dense_rows_active_parameters():
    size = train_bench.Size()
    dense = train_bench.model_config("hybrid", size, "dots")
    moe = train_bench.model_config("moe", size, "dots")
    from lineage_jax import accounting

    a, b = accounting.param_counts(dense)["active"], accounting.param_counts(moe)["active"]
    assert abs(a - b) / a < 0.03


def test_attention_bench_quick_checks_against_the_reference(tmp_path):
    rec = attention_bench.run(quick=True, out=str(tmp_path), impls="xla", layouts="gqa")
    assert {r["segments"] for r in rec["results"]} == {False, True}
    assert all(r["fwd_bwd_ms"] > 0 for r in rec["results"])
    assert all(c[n] < 2e-2 for c in rec["checks"] for n in ("o", "dq", "dk", "dv"))
