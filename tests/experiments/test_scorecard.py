"""The scorecard runs end to end (two architectures, a few steps) and reports every column."""

import json

import pytest

from experiments import scorecard as S


def test_scorecard_structure(tmp_path):
    rec = S.run(quick=True, out=str(tmp_path), steps=3, only=["GPT-2 (softmax + KV cache)", "KDA"])
    assert [r["architecture"] for r in rec["rows"]] == ["GPT-2 (softmax + KV cache)", "KDA"]
    for r in rec["rows"]:
        assert set(r["accuracy"]) == set(S.PROBES)
        assert all(0.0 <= a <= 1.0 for a in r["accuracy"].values())
        assert r["decode_ms_per_token"] > 0
    gpt, kda = rec["rows"]
    assert gpt["memory_per_layer_1m"] > 500 * gpt["memory_per_layer_1k"]  # the cache grows with context
    assert kda["memory_per_layer_1m"] == kda["memory_per_layer_1k"]  # the state does not
    saved = json.loads(open(rec["files"]["json"]).read())
    assert saved["rows"][0]["architecture"] == gpt["architecture"]
    assert "Seeds' predictions" in S.table(rec)


def test_scorecard_rejects_unknown_architecture(tmp_path):
    with pytest.raises(ValueError, match="only"):
        S.run(quick=True, out=str(tmp_path), steps=1, only=["Mamba"])
