"""The decode-scaling, AttnRes and LM experiments run end to end at their smallest settings.

Checked: the JSON record's structure and finite numbers, a real PNG, the decode cache's
measured bytes equal to the accountant's prediction (exactly), the LM's parameter matching,
the AttnRes probe reproducing the model's logits, and clear errors for bad arguments.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from experiments import attnres as AR
from experiments import decode_scaling as DS
from experiments import lm as LM
from lineage_jax.models import Decoder, get_config


def _load(record: dict) -> dict:
    js, png = Path(record["files"]["json"]), Path(record["files"]["png"])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    on_disk = json.loads(js.read_text())
    for key in ("experiment", "date", "git_commit", "jax_version", "device", "budget"):
        assert key in on_disk
    return on_disk


def _finite(*values):
    for v in values:
        assert v is not None and math.isfinite(v), values


# ----------------------------------------------------------------------------- decode scaling
@pytest.fixture(scope="module")
def decode_record(tmp_path_factory):
    return DS.run(quick=True, out=str(tmp_path_factory.mktemp("results")), only=["mha", "kda", "hybrid"],
                  contexts=[64, 256], steps=2, max_batch=2)


def test_decode_scaling_structure_and_exact_bytes(decode_record):
    rec = _load(decode_record)
    assert {r["arch"] for r in rec["rows"]} == {"mha", "kda", "hybrid"}
    want = "reduce" if jax.default_backend() == "gpu" else "dot"  # how each decode reads its cache
    assert rec["archs"]["mha"]["decode_reads"] == {"softmax": want}
    assert rec["archs"]["hybrid"]["decode_reads"] == {"mla_latent": "dot"} and rec["archs"]["kda"]["decode_reads"] == {}
    assert len(rec["rows"]) == 3 * 2 * len(DS.MODES)
    for r in rec["rows"]:
        assert r["status"] == "ok", r
        assert r["cache_bytes"] == r["predicted"]["total"] and r["matches_accounting"]
        assert r["batch"] == (1 if r["mode"] == "batch1" else 2)
        _finite(r["ms_per_step"], r["ms_per_token"], r["tokens_per_s"])
        # a step reads every weight but the untied embedding table, of which it gathers its batch's rows
        b, info = rec["budget"], rec["archs"][r["arch"]]
        assert info["embedding_table_bytes"] == b["vocab"] * b["d_model"] * 4  # float32, untied
        weights = info["weight_bytes"] - info["embedding_table_bytes"] + r["batch"] * b["d_model"] * 4
        assert r["bytes_read"] == weights + r["cache_bytes"]
        assert r["read_gb_per_s"] == pytest.approx((weights + r["cache_bytes"]) / r["ms_per_step"] / 1e6)
    by = {(r["arch"], r["context"], r["mode"]): r for r in rec["rows"]}
    # The KV cache grows 4× with 4× the context; the KDA state does not grow at all.
    mha = by[("mha", 256, "batch1")]["predicted"]["growing"] / by[("mha", 64, "batch1")]["predicted"]["growing"]
    assert mha == 4
    assert by[("kda", 256, "batch1")]["cache_bytes"] == by[("kda", 64, "batch1")]["cache_bytes"]
    assert by[("mha", 64, "fill")]["cache_bytes"] == 2 * by[("mha", 64, "batch1")]["cache_bytes"]
    sp = rec["speedups"]["per_context"]["256"]
    _finite(sp["batch1"]["hybrid_vs_mha"], sp["fill"]["kda_vs_mha"])
    assert sp["batch1"]["hybrid_vs_mla"] is None  # MLA was not run
    assert rec["speedups"]["headline"]["hybrid_vs_mha"]["fill"]["context"] == 256
    # The bytes-read ratio: per token, (weights + cache) / batch of the slower over the faster.
    mha_r, kda_r = by[("mha", 256, "fill")], by[("kda", 256, "fill")]
    want = (mha_r["bytes_read"] / mha_r["batch"]) / (kda_r["bytes_read"] / kda_r["batch"])
    assert rec["speedups"]["bytes_per_context"]["256"]["fill"]["kda_vs_mha"] == pytest.approx(want)
    assert rec["speedups"]["bytes_headline"]["kda_vs_mha"]["fill"] == {"context": 256, "speedup": pytest.approx(want)}
    # a record of the earlier rule (the whole table counted, no table size recorded) rederives to this one
    assert rec["bytes_read_rule"] == DS.BYTES_READ_RULE
    old = json.loads(json.dumps(rec))
    del old["bytes_read_rule"]
    for info in old["archs"].values():
        del info["embedding_table_bytes"]
    for r in old["rows"]:
        r["bytes_read"] = old["archs"][r["arch"]]["weight_bytes"] + r["cache_bytes"]
        r["read_gb_per_s"] = DS.read_rate(r["bytes_read"], r["ms_per_step"])
    old["speedups"] = DS.speedups(old["rows"])
    again = DS.rederive(old)
    assert again["rows"] == rec["rows"] and again["speedups"] == rec["speedups"] and again["archs"] == rec["archs"]
    assert again["bytes_read_rule"] == rec["bytes_read_rule"]
    path = Path(decode_record["files"]["json"]).with_name("old.json")
    path.write_text(json.dumps(old, indent=1) + "\n")
    DS.main(["--rederive", str(path)])  # in place, the file's layout kept
    assert json.loads(path.read_text())["rows"] == rec["rows"] and path.read_text().startswith('{\n "')
    assert "Kimi Linear" in DS.table(rec) and "exact" in DS.table(rec) and "GB/s read" in DS.table(rec)


def test_decode_scaling_records_the_configured_read():
    assert DS.decode_reads(get_config("tiny_llama").replace(decode_read="reduce")) == {"softmax": "reduce"}
    assert DS.decode_reads(get_config("tiny_kimi_linear").replace(decode_read="dot")) == {"mla_latent": "dot"}
    assert DS.decode_reads(get_config("tiny_kda")) == {}


def test_decode_scaling_does_not_fit_is_recorded(tmp_path):
    rec = DS.run(quick=True, out=str(tmp_path), only=["mha"], contexts=[64], steps=2, device_memory_gb=1e-6)
    assert [r["status"] for r in rec["rows"]] == ["does not fit"] * len(DS.MODES)
    assert "does not fit" in DS.table(rec)


def test_decode_models_keep_one_cache_buffer_per_layer():
    """Unscanned layers: no decode step copies a layer's slice out of a stacked cache (module doc)."""
    b = DS.make_budget(True)
    for key in DS.ARCHS:
        model = DS.Target(DS.model_config(key, b)).model
        assert [n for _, _, n in model.groups_spec] == [1] * len(model.groups_spec)  # no scanned group
        cache = jax.eval_shape(lambda: model.init_cache(2, 64, jnp.bfloat16))
        # Each layer's growing cache / state is its own leaf, not a slice of a [layers, ...] stack.
        big = [leaf.shape for leaf in jax.tree.leaves(cache) if len(leaf.shape) >= 3]
        assert big and all(shape[0] == 2 for shape in big), big


def test_fill_batch():
    assert DS.fill_batch(per_sequence=10, budget_bytes=95, cap=100) == 9
    assert DS.fill_batch(per_sequence=10, budget_bytes=95, cap=4) == 4
    assert DS.fill_batch(per_sequence=10, budget_bytes=-5, cap=4) == 0


@pytest.mark.parametrize("kwargs, arg", [
    (dict(only=["mamba"]), "only"),
    (dict(contexts=[3]), "contexts"),
    (dict(layers=6), "layers"),
    (dict(device_memory_gb=-1.0), "device_memory_gb"),
])
def test_decode_scaling_rejects_bad_args(tmp_path, kwargs, arg):
    with pytest.raises(ValueError, match=arg):
        DS.run(quick=True, out=str(tmp_path), **kwargs)


# ----------------------------------------------------------------------------- LM
@pytest.mark.parametrize("quick", [True, pytest.param(False, marks=pytest.mark.slow)])  # full size: -m slow
def test_lm_parameters_matched(quick):
    b = LM.make_budget(quick, archs=LM.KEYS)
    main, ablation = LM.architecture_table(b)
    target = LM.budget_params(main[0][2], b.match)
    counts = {}
    for key, _, cfg in main + ablation:
        matched = LM.match_params(cfg, target, b.match, b.tolerance)
        counts[key] = LM.budget_params(matched, b.match)
        assert abs(counts[key] / target - 1) <= b.tolerance, (key, counts[key], target)
    assert counts["gpt2"] == target
    assert set(counts) == set(LM.KEYS) | {ratio for ratio, _ in LM.ABLATION}


def test_lm_end_to_end(tmp_path):
    rec = _load(LM.run(quick=True, out=str(tmp_path), archs=["linear"], steps=4, no_ablation=True))
    (row,) = rec["rows"]
    assert row["key"] == "linear" and row["pattern"] == "L" * 8
    assert abs(row["match_error"]) <= rec["budget"]["tolerance"]
    assert len(row["val_curve"]) == len(row["val_steps"]) == rec["budget"]["evals"]
    _finite(row["val_loss"], *row["val_curve"], *row["train_curve"])
    assert row["val_loss"] < math.log(256) + 0.5  # no worse than uniform over bytes, give or take
    assert "bits/byte" in LM.table(rec)
    # The partial record written after each run holds the same finished run.
    partial = json.loads((tmp_path / "lm" / "lm.partial.json").read_text())
    assert partial["complete"] is False and list(partial["finished"]) == [row["architecture"]]
    assert partial["finished"][row["architecture"]]["val_loss"] == row["val_loss"]


@pytest.mark.slow
def test_lm_quick_with_ablation(tmp_path):
    rec = _load(LM.run(quick=True, out=str(tmp_path), archs=["kda"], steps=4))
    abl = [r for r in rec["rows"] if r["section"] == "ablation"]
    assert [r["key"] for r in abl] == [ratio for ratio, _ in LM.ABLATION]
    assert "best ratio here" in LM.table(rec)


@pytest.mark.parametrize("kwargs, arg", [
    (dict(archs=["mamba"]), "archs"),
    (dict(match="some"), "match"),
    (dict(lrs=[-1.0]), "lrs"),
    (dict(steps=1), "steps"),
])
def test_lm_rejects_bad_args(tmp_path, kwargs, arg):
    with pytest.raises(ValueError, match=arg):
        LM.run(quick=True, out=str(tmp_path), **kwargs)


# ----------------------------------------------------------------------------- AttnRes
@pytest.mark.parametrize("attnres, layers", [(True, 4), (False, 4), (True, 5)])
def test_attnres_probe_reproduces_the_forward(attnres, layers):
    b = AR.make_budget(True, layers=layers, block=2)
    model = Decoder(AR.model_config(b, attnres), rngs=nnx.Rngs(0))
    tokens = jax.random.randint(jax.random.key(1), (2, 16), 0, LM.VOCAB)
    profile = AR.residual_rms(model, tokens)
    logits = nnx.jit(lambda m, t: m(t))(model, tokens)
    np.testing.assert_allclose(np.asarray(profile["logits"]), np.asarray(logits), rtol=1e-5, atol=1e-5)
    assert profile["hidden"].shape == (layers + 1,) and profile["ffn_out"].shape == (layers,)
    assert np.all(np.isfinite(profile["hidden"])) and np.all(profile["hidden"] > 0)


def test_attnres_width_flag():
    """--d-model widens both models (heads stay head_dim wide, FFN 4x); a width that is not a
    whole number of heads is refused, naming the argument."""
    b = AR.make_budget(False, d_model=256)
    assert (b.d_model, b.layers, b.steps) == (256, AR.FULL.layers, AR.FULL.steps)
    for attnres in (True, False):
        cfg = AR.model_config(b, attnres)
        assert (cfg.d_model, cfg.num_heads, cfg.resolved_head_dim, cfg.ffn_hidden) == (256, 8, 32, 1024)
    for bad in (100, 0, -32):
        with pytest.raises(ValueError, match="d_model"):
            AR.make_budget(False, d_model=bad)


def test_steps_to_reach():
    assert AR.steps_to_reach([10, 20, 30], [3.0, 2.0, 1.0], 1.5) == pytest.approx(25.0)
    assert AR.steps_to_reach([10, 20], [3.0, 2.0], 3.5) == 10.0
    assert AR.steps_to_reach([10, 20], [3.0, 2.0], 1.0) is None


def test_attnres_end_to_end(tmp_path):
    rec = _load(AR.run(quick=True, out=str(tmp_path), layers=2, block=1, steps=6, baseline_budgets=[1.5]))
    assert set(rec["models"]) == {"plain", "attnres"}
    for m in rec["models"].values():
        assert len(m["hidden"]) == 3 and len(m["val_curve"]) == rec["budget"]["evals"]
        _finite(m["val_loss"], *m["hidden"], *m["val_curve"])
    adv = rec["advantage"]
    assert (adv["advantage"] is None) != (adv["advantage_at_least"] is None)
    assert adv["baseline_steps"][-1] == 9  # 1.5 × 6 steps
    assert "compute advantage" in AR.table(rec)
    partial = json.loads((tmp_path / "attnres" / "attnres.partial.json").read_text())  # saved after each run
    assert partial["complete"] is False and set(partial["finished"]) == {"attnres", "plain", "plain x1.5"}
    assert partial["finished"]["plain"]["val_loss"] == rec["models"]["plain"]["val_loss"]
    # The depth profiles are in the partial record too (probed before the baseline extensions train).
    assert set(partial["profiles"]) == {"plain", "attnres"}
    for name, m in rec["models"].items():
        np.testing.assert_allclose(partial["profiles"][name]["hidden"], m["hidden"], rtol=1e-6)


@pytest.mark.parametrize("kwargs, arg", [
    (dict(block=99), "block"),
    (dict(baseline_budgets=[0.5]), "baseline_budgets"),
    (dict(layers=1), "layers"),
    (dict(steps=2), "steps"),
])
def test_attnres_rejects_bad_args(tmp_path, kwargs, arg):
    with pytest.raises(ValueError, match=arg):
        AR.run(quick=True, out=str(tmp_path), **kwargs)


def test_cli_rejects_bad_flag(capsys):
    with pytest.raises(SystemExit):
        DS.main(["--quick", "--steps", "0"])
    assert "--steps" in capsys.readouterr().err
