"""The scorecard runs end to end (two architectures, a few steps) and reports every column.

Run as a subprocess, exactly as the README's main job runs.
"""

import json
import subprocess
import sys

import numpy as np
import pytest

from experiments import scorecard as S
from experiments import trainer as T


# Held-out rows per probe in the smoke runs: 32, not the quick budget's 128. Scoring is a teacher-forced
# forward per probe and query kind, and three steps teach nothing, so more rows measure no more;
# the card's structure (every column, every query kind, the kinds partitioning each probe) is the same.
EVAL_ROWS = 32


def _card_from_the_cli(tmp_path):
    """The README's main job at the smallest size (two architectures, three steps); checks every
    column of the card it writes."""
    out = subprocess.run([sys.executable, "-m", "experiments.scorecard", "--quick", "--steps", "3", "--only", "gpt2,kda",
                          "--eval-sequences", str(EVAL_ROWS), "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Predictions, stated before measuring" in out.stdout and "KDA" in out.stdout
    assert "Not taught in this budget" in out.stdout  # 3 steps teach nothing: no verdict, said so
    rec = json.loads((tmp_path / "scorecard" / "scorecard.json").read_text())
    assert rec["budget"]["eval_sequences"] == EVAL_ROWS and rec["budget"]["steps"] == 3
    assert (tmp_path / "scorecard" / "scorecard.png").stat().st_size > 10_000
    assert [r["architecture"] for r in rec["rows"]] == [S.KEYS["gpt2"], S.KEYS["kda"]]
    for r in rec["rows"]:
        assert set(r["accuracy"]) == set(S.PROBES)
        assert all(0.0 <= a <= 1.0 for a in r["accuracy"].values())
        assert r["decode_ms_per_token"] > 0
        assert r["best_lr"] in rec["budget"]["lrs"] and len(r["val_accuracy_per_lr"]) == len(rec["budget"]["lrs"])
    assert "Accuracy per query kind" in out.stdout
    kinds = {"mqar": {"query"}, "overwrite": {"original", "overwritten"}, "fade": {"a", "b"},
             "mixed_half_lives": {"long", "junk"}}
    for r in rec["rows"]:
        for p in S.PROBES:
            split = r["accuracy_by_kind"][p]
            assert set(split) == kinds[p]
            # the kinds partition the scored positions: the probe's accuracy is a mix of theirs
            assert min(split.values()) - 1e-6 <= r["accuracy"][p] <= max(split.values()) + 1e-6
    gpt, kda = rec["rows"]
    # the memory columns are the architecture's reference stack; the quick models train its last 2 layers
    assert (gpt["pattern"], gpt["trained_pattern"]) == ("SSSS", "SS")
    assert (kda["pattern"], kda["trained_pattern"]) == ("KKKK", "KK")
    assert gpt["memory_per_layer_1m"] > 500 * gpt["memory_per_layer_1k"]  # the cache grows with context
    assert kda["memory_per_layer_1m"] == kda["memory_per_layer_1k"]  # the state does not
    return rec


def _check_merge(tmp_path, second):
    """``--merge`` joins the card under ``tmp_path`` (gpt2, kda) with the record ``second`` (one linear
    attention row) and a record holding a diagnostic row (the second record's row renamed): the
    diagnostic row sorts after the card's rows. (Running a diagnostic row when named is
    test_decode_only_times_...'s gdn_nogate.)"""
    diag = json.loads(second.read_text())
    diag["rows"][0]["architecture"] = S.EXTRA_KEYS["gpt2_nope"]
    (tmp_path / "diag.json").write_text(json.dumps(diag))
    merged = S.run(out=str(tmp_path / "m"), merge=[str(tmp_path / "diag.json"), str(tmp_path), str(second)])
    assert [r["architecture"] for r in merged["rows"]] == [S.KEYS["gpt2"], S.KEYS["linear"], S.KEYS["kda"],
                                                          S.EXTRA_KEYS["gpt2_nope"]]
    assert merged["complete"] is False and len(merged["merged_from"]) == 3
    assert set(merged["prediction_check"]["mqar"]) == {S.KEYS["linear"]}  # re-checked over the joined rows
    assert (tmp_path / "m" / "scorecard" / "scorecard.png").is_file()
    with pytest.raises(ValueError, match="more than one record"):
        S.run(out=str(tmp_path / "m2"), merge=[str(tmp_path), str(tmp_path)])
    other = json.loads(second.read_text())
    other["budget"]["steps"] = 4
    (tmp_path / "other.json").write_text(json.dumps(other))
    with pytest.raises(ValueError, match="steps"):
        S.run(out=str(tmp_path / "m3"), merge=[str(tmp_path), str(tmp_path / "other.json")])
    with pytest.raises(ValueError, match="no scorecard record"):
        S.run(out=str(tmp_path / "m4"), merge=[str(tmp_path / "nowhere")])


def test_scorecard_structure(tmp_path):
    """The card from the CLI, then ``--merge`` with a record standing for a second call: the CLI's
    record with its GPT-2 row renamed to linear attention (a record of the same budget with
    another architecture; the merge reads records, not models). A real second call is
    test_scorecard_merges_a_second_call (-m slow)."""
    rec = _card_from_the_cli(tmp_path)
    second = dict(rec, rows=[dict(rec["rows"][0], architecture=S.KEYS["linear"])])
    (tmp_path / "second.json").write_text(json.dumps(second))
    _check_merge(tmp_path, tmp_path / "second.json")


@pytest.mark.slow  # the card's columns and the merge are test_scorecard_structure
def test_scorecard_merges_a_second_call(tmp_path):
    """As test_scorecard_structure, the second record from a real in-process call (linear attention)."""
    _card_from_the_cli(tmp_path)
    S.run(quick=True, out=str(tmp_path / "b"), steps=3, only=["linear"], eval_sequences=EVAL_ROWS)
    _check_merge(tmp_path, tmp_path / "b" / "scorecard" / "scorecard.json")


def test_decode_only_times_untrained_models_without_touching_the_card(tmp_path, capsys):
    # The CLI's main in this process (`python -m experiments.scorecard` itself is test_scorecard_structure)
    S.main(["--quick", "--decode-only", "--only", "deltanet,gdn_nogate", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert "decode ms/tok" in out and "untrained" in out
    rec = json.loads((tmp_path / "scorecard_decode" / "scorecard_decode.json").read_text())
    assert rec["decode_only"] and rec["complete"] and not (tmp_path / "scorecard").exists()
    assert [r["architecture"] for r in rec["rows"]] == [S.KEYS["deltanet"], S.EXTRA_KEYS["gdn_nogate"]]
    assert all(np.isfinite(r["decode_ms_per_token"]) and r["decode_ms_per_token"] > 0 for r in rec["rows"])
    assert (tmp_path / "scorecard_decode" / "scorecard_decode.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("kwargs", [dict(merge=["a"]), dict(steps=5), dict(eval_sequences=8)])
def test_decode_only_rejects_training_arguments(tmp_path, kwargs):
    with pytest.raises(ValueError, match="decode_only"):
        S.run(quick=True, out=str(tmp_path), decode_only=True, **kwargs)


def test_cli_bad_argument_is_an_error_message_not_a_traceback(tmp_path, capsys):
    # In this process: a ValueError escaping the CLI would fail pytest.raises(SystemExit) (as in
    # tests/train/test_cli.py); the argparse error is exit status 2 with the message on stderr.
    with pytest.raises(SystemExit) as e:
        S.main(["--quick", "--only", "mamba", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "Traceback" not in err
    assert "error: only: unknown architecture(s) ['mamba']" in err


def test_scorecard_rejects_unknown_architecture(tmp_path):
    with pytest.raises(ValueError, match="only"):
        S.run(quick=True, out=str(tmp_path), steps=1, only=["mamba"])



def test_kind_masks_partition_the_scored_positions():
    b = S.QUICK
    for p, task in S.make_probes(b, 7).items():
        rows = T.stack_rows(task, 6)
        masks = S.kind_masks(task, rows)
        total = sum(masks.values())
        np.testing.assert_array_equal(total, rows["mask"])
        assert all(m.sum() > 0 for m in masks.values()), p


def test_pressure_budget_fills_fade_exactly_once():
    """The pressure budget's fade probe writes and queries doc B once (no re-write passes)."""
    task = S.make_probes(S.PRESSURE, 0)["fade"]
    kinds = task.info(0)["kinds"]
    b = S.PRESSURE
    assert (kinds == 2).sum() == b.num_facts and (kinds == 1).sum() == b.fade_facts_a
    with pytest.raises(ValueError, match="budget"):
        S.run(out="unused", budget="huge")


def test_evict_budget_overloads_every_head_and_fills_fade_once():
    """``--budget evict``: PRESSURE's model with more live facts than a layer has key dims."""
    b = S.EVICT
    assert (b.d_model, b.head_dim) == (S.PRESSURE.d_model, S.PRESSURE.head_dim)
    assert b.batch * b.seq_len == S.PRESSURE.batch * S.PRESSURE.seq_len  # same tokens per step
    probes = S.make_probes(b, 0)
    kinds = {name: task.info(0)["kinds"] for name, task in probes.items()}
    assert (kinds["mqar"] == 1).sum() == b.num_facts >= b.d_model  # every key dim of a layer's heads, 4x a head's
    assert (kinds["fade"] == 1).sum() == b.fade_facts_a and (kinds["fade"] == 2).sum() == b.num_facts
    assert 4 * (b.fade_facts_a + b.num_facts) == b.seq_len  # doc B written and queried once
    assert (kinds["mixed_half_lives"] == 1).sum() == b.mixed_facts


def _row(name, acc):
    return {"architecture": name, "accuracy": dict.fromkeys(S.PROBES, acc), "decode_ms_per_token": 0.1,
            "memory_per_layer_1k": 1.0, "memory_per_layer_1m": 1.0}


def test_verdicts_in_words_and_untaught_rows_excluded():
    rows = [_row(S.KEYS["linear"], 0.07), _row(S.KEYS["deltanet"], 0.99), _row(S.KEYS["gdn"], 0.97),
            _row(S.KEYS["gpt2"], 0.10)]
    assert S.untaught(rows) == [S.KEYS["gpt2"]]
    check = S.check_predictions(rows)
    v = check["mqar"][S.KEYS["linear"]]
    assert v["confirmed"] and v["median"] == 0.97 and v["best"] == S.KEYS["deltanet"]  # GPT-2 not in the median
    rec = {"rows": rows, "prediction_check": check, "quick": True, "budget_name": "quick",
           "budget": {"d_model": 64, "steps": 800, "batch": 32, "seq_len": 64, "layers": 2},
           "device": {"description": "cpu"}}
    text = S.table(rec)
    assert "predicted: Linear attention fails recall — confirmed: 0.07 vs median 0.97 (best: DeltaNet 0.99)" in text
    assert "predicted: DeltaNet fails fade — not confirmed" in text
    assert "Not taught in this budget" in text and "GPT-2 (softmax + KV cache)" in text
    assert "MiB" in text and " MB" not in text and "2 layers" in text


def test_quick_help_and_readme_agree_on_the_time(capsys):
    import re
    from pathlib import Path

    readme = (Path(S.__file__).resolve().parent.parent / "README.md").read_text()
    line = next(l for l in readme.splitlines() if "scorecard --quick" in l)
    minutes = re.search(r"(\d+) minutes", line).group(1)
    with pytest.raises(SystemExit):
        S.main(["--help"])
    parser_help = capsys.readouterr().out
    assert f"about {minutes} minutes" in " ".join(parser_help.split())
