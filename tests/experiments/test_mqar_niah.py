"""MQAR and NIAH experiments end to end at the smallest sizes, and the learning-rate sweep's exactness.

The sweep test is the one that matters for the results: training four learning rates as
one vmapped program must be the same as training each alone.
"""

import dataclasses
import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from experiments import architectures as A
from experiments import mqar as M
from experiments import niah as N
from experiments import trainer as T
from lineage_jax import accounting
from lineage_jax import data as D
from lineage_jax.models import Decoder, ModelConfig
from lineage_jax.train.step import init_state, make_train_step


def _rel(a, b) -> float:
    a, b = (np.concatenate([np.ravel(np.asarray(x)) for x in jax.tree.leaves(t)]) for t in (a, b))
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def test_lr_sweep_equals_sequential_single_lr_training():
    # One softmax layer with an MoE FFN: its router biases (`rest`) are updated outside the optimizer.
    cfg = ModelConfig(vocab_size=64, d_model=32, pattern="S", num_heads=2, head_dim=16, max_seq_len=16,
                      num_experts=4, top_k=2, moe_hidden=16)
    data = T.stack_rows(D.get_task("mqar", vocab_size=64, seq_len=16, num_kv_pairs=2), 24)
    lrs, steps, batch = (1e-3, 1e-2), 4, 8
    sweep = T.LRSweep(cfg, lrs=lrs, steps=steps, batch=batch, seed=3, log_every=1)
    losses = sweep.train(data)
    assert losses.shape == (steps, len(lrs))
    order = T.epoch_batches(len(data["tokens"]), batch, steps, seed=3)
    for i, lr in enumerate(lrs):
        tc = dataclasses.replace(sweep.tc, lr=lr)
        graphdef, state, tx = init_state(cfg, tc)
        step = jax.jit(make_train_step(graphdef, tx, tc))
        single = []
        for idx in order:
            state, metrics = step(state, {k: v[idx] for k, v in data.items()})
            single.append(float(metrics["loss"]))
        np.testing.assert_allclose(losses[:, i], single, rtol=1e-5)
        copy = jax.tree.map(lambda x: x[i], sweep.states)
        assert _rel(copy.params, state.params) <= 1e-5
        assert _rel(copy.rest, state.rest) <= 1e-5
        assert _rel(copy.opt_state[0], state.opt_state) <= 1e-5
    first, second = (jax.tree.map(lambda x: x[i], sweep.states.params) for i in range(2))
    assert _rel(first, second) > 1e-3  # the copies really trained at different rates


def test_lr_sweep_scores_what_each_copys_model_predicts():
    """``evaluate`` / ``accuracy`` against a plain argmax over each trained copy's own ``Decoder``: per row the
    answer positions predicted right, per copy the share of all scored positions, in the order of ``lrs``."""
    cfg = ModelConfig(vocab_size=64, d_model=32, pattern="S", num_heads=2, head_dim=16, max_seq_len=16)
    task = D.get_task("mqar", vocab_size=64, seq_len=16, num_kv_pairs=2)
    data, held = T.stack_rows(task, 24), T.stack_rows(task, 10, start=24)
    sweep = T.LRSweep(cfg, lrs=(1e-3, 3e-2), steps=12, batch=8, seed=3, log_every=4)
    sweep.train(data)
    hits, scored = sweep.evaluate(held)
    accuracy = sweep.accuracy(held)
    mask = np.asarray(held["mask"])
    np.testing.assert_array_equal(scored, mask.sum(-1))
    for i in range(2):
        logits = sweep.model(i)(jnp.asarray(held["tokens"]))
        right = (np.argmax(np.asarray(logits), -1) == np.asarray(held["targets"])) * mask
        np.testing.assert_array_equal(hits[i], right.sum(-1))
        assert accuracy[i] == right.sum() / mask.sum()
    assert hits.shape == (2, 10) and mask.sum() > 0 and np.any(hits[0] != hits[1])  # the copies differ


def test_lm_sweep_val_loss_is_each_copys_masked_cross_entropy():
    """``LMSweep.val_loss`` against the mean masked next-token cross-entropy (optax) of each trained copy's
    ``Decoder`` on the same rows, in the order of ``lrs``."""
    import optax

    cfg = ModelConfig(vocab_size=64, d_model=32, pattern="S", num_heads=2, head_dim=16, max_seq_len=16)
    task = D.get_task("mqar", vocab_size=64, seq_len=16, num_kv_pairs=2)
    data, held = T.stack_rows(task, 24), T.stack_rows(task, 10, start=24)
    sweep = T.LMSweep(cfg, lrs=(1e-3, 3e-2), steps=8, batch=8, seed=3, log_every=4)
    sweep.train(data)
    got = sweep.val_loss(held)
    mask = np.asarray(held["mask"], np.float64)
    for i in range(2):
        logits = sweep.model(i)(jnp.asarray(held["tokens"])).astype(jnp.float32)
        nll = np.asarray(optax.softmax_cross_entropy_with_integer_labels(logits, jnp.asarray(held["targets"])))
        np.testing.assert_allclose(got[i], (nll * mask).sum() / mask.sum(), rtol=1e-5)
    assert abs(got[0] - got[1]) > 1e-4  # the copies differ


def test_epoch_batches_cover_each_epoch_once():
    order = T.epoch_batches(rows=10, batch=3, steps=7, seed=0)
    assert order.shape == (7, 3)
    for epoch in order[:6].reshape(2, 9):  # 3 batches (9 of 10 rows) per epoch, no repeats within one
        assert len(set(epoch.tolist())) == 9
    assert T.largest_divisor(12, 5) == 4 and T.largest_divisor(7, 3) == 1


def _mqar_cli(tmp_path, archs: dict):
    """The CLI at its smallest (one length, one width, two learning rates, 4 steps) for ``archs``
    (key -> pattern); checks the record, the plot and ``--merge``."""
    out = subprocess.run([sys.executable, "-m", "experiments.mqar", "--quick", "--steps", "4",
                          "--archs", ",".join(archs), "--lengths", "32:2", "--widths", "32", "--lrs", "1e-3,1e-2",
                          "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "DeltaNet" in out.stdout and "32/2" in out.stdout
    rec = json.loads((tmp_path / "mqar" / "mqar.json").read_text())
    assert (tmp_path / "mqar" / "mqar.png").stat().st_size > 10_000
    assert [r["arch"] for r in rec["runs"]] == list(archs) and rec["complete"]
    assert [r["pattern"] for r in rec["runs"]] == list(archs.values())
    for r in rec["runs"]:
        assert (r["seq_len"], r["num_kv_pairs"], r["d_model"]) == (32, 2, 32)
        assert len(r["accuracy_per_lr"]) == 2 and all(0.0 <= a <= 1.0 for a in r["accuracy_per_lr"])
        assert r["best_accuracy"] == max(r["accuracy_per_lr"])
        assert r["best_lr"] == r["lrs"][int(np.argmax(r["accuracy_per_lr"]))]
        assert r["train_s"] > 0 and r["params"] > 0

    # Split calls join with --merge (here: the same record with its runs relabelled to another width).
    other = dict(rec, runs=[dict(r, d_model=48) for r in rec["runs"]])
    (tmp_path / "other" / "mqar").mkdir(parents=True)
    (tmp_path / "other" / "mqar" / "mqar.json").write_text(json.dumps(other))
    both = M.run(merge=[str(tmp_path), str(tmp_path / "other")], out=str(tmp_path / "joined"))
    assert len(both["runs"]) == 2 * len(archs) and both["budget"]["widths"] == [32, 48]
    assert (tmp_path / "joined" / "mqar" / "mqar.png").stat().st_size > 10_000
    assert "d=48" in M.table(both)
    with pytest.raises(ValueError, match="^merge:"):
        M.run(merge=[str(tmp_path), str(tmp_path)], out=str(tmp_path / "twice"))


def test_mqar_cli_smallest(tmp_path):
    """One architecture: the sweep over learning rates, the record, the plot and the merge. (The
    softmax model trains through the same sweep in test_lr_sweep_equals_... and test_niah_smallest.)"""
    _mqar_cli(tmp_path, {"deltanet": "DD"})


def test_a_mixer_of_ones_own_runs_in_the_experiments(tmp_path, monkeypatch, capsys):
    """`--import` a module that registers a mixer and a row: `--archs` names it, it trains in the sweep next to
    a library row, and the record names the module; a module that fails to import is named."""
    from experiments import common as C
    from tests._registry import SavedTables

    (tmp_path / "my_exp_rules.py").write_text(
        "from experiments.architectures import register_architecture\n"
        "from lineage_jax.layers.memory_mixer import Rule\n"
        "from lineage_jax.models import register_rule\n"
        "register_rule('gla_exp', Rule('Q', gate='channel', erase=False, output_gate='full'))\n"
        "register_architecture('gla', 'GLA (registered)', 'QQQQ')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with SavedTables(A.EXTRA_KEYS, A.EXTRA_ARCHITECTURES, C.IMPORTED, modules=["my_exp_rules"]):
        rec = M.main(["--quick", "--steps", "4", "--import", "my_exp_rules", "--archs", "deltanet,gla",
                      "--lengths", "32:2", "--widths", "32", "--lrs", "1e-3,1e-2", "--out", str(tmp_path / "r")])
        assert [(r["arch"], r["pattern"]) for r in rec["runs"]] == [("deltanet", "DD"), ("gla", "QQ")]
        assert all(0.0 <= r["best_accuracy"] <= 1.0 for r in rec["runs"]) and rec["imports"] == ["my_exp_rules"]
        assert json.loads((tmp_path / "r" / "mqar" / "mqar.json").read_text())["imports"] == ["my_exp_rules"]
    capsys.readouterr()
    with pytest.raises(SystemExit):
        M.main(["--quick", "--import", "no_module_like_this", "--out", str(tmp_path / "x")])
    assert "--import no_module_like_this: ModuleNotFoundError" in capsys.readouterr().err


def test_register_architecture_refuses_what_it_cannot_run(monkeypatch):
    monkeypatch.setattr(A, "EXTRA_KEYS", dict(A.EXTRA_KEYS))
    monkeypatch.setattr(A, "EXTRA_ARCHITECTURES", list(A.EXTRA_ARCHITECTURES))
    for args, match in ((("kda", "New", "KKKK"), "`key` 'kda' is taken"), (("new", "KDA", "KKKK"), "`label`"),
                        (("new", "New", "KKZK"), "`pattern` must be mixer letters"),
                        (("new", "New", "KKKK", ["x"]), "`extra`"), (("a b", "New", "KKKK"), "`key`")):
        with pytest.raises(ValueError, match=match):
            A.register_architecture(*args)
    A.register_architecture("kda_twice", "KDA again", "KKKK", {"kda_gate": "bounded"})
    A.register_architecture("kda_twice", "KDA again", "KKKK", {"kda_gate": "bounded"})  # the same row: nothing
    assert A.select(["kda_twice"], 2) == [("kda_twice", "KDA again", "KK", {"kda_gate": "bounded"})]


@pytest.mark.slow  # the CLI's record, plot and merge are test_mqar_cli_smallest
def test_mqar_cli_two_architectures(tmp_path):
    _mqar_cli(tmp_path, {"gpt2": "SS", "deltanet": "DD"})


def test_niah_smallest(tmp_path):
    rec = N.run(quick=True, out=str(tmp_path), steps=2, archs=["gpt2"], d_model=32, train_len=256,
                eval_lens=[256, 384])
    assert (tmp_path / "niah" / "niah.png").stat().st_size > 10_000
    assert json.loads((tmp_path / "niah" / "niah.json").read_text())["runs"] == rec["runs"]
    (r,) = rec["runs"]
    assert r["pattern"] == "SSSS" and set(r["by_length"]) == {"256", "384"}
    for s in r["by_length"].values():
        assert 0.0 <= s["passkey_accuracy"] <= s["digit_accuracy"] + 1e-9 <= 1.0 + 1e-9
        assert len(s["by_depth"]) == rec["budget"]["depth_bins"]
        assert all(a is None or 0.0 <= a <= 1.0 for a in s["by_depth"])
    assert "256" in N.table(rec).replace(" ", "") and "GPT-2" in N.table(rec)


def test_two_layer_architectures():
    table = {key: pattern for key, _, pattern, _ in A.select(None, 2)}
    assert table == {"gpt2": "SS", "linear": "LL", "deltanet": "DD", "gdn": "GG", "kda": "KK", "mla": "MM",
                     "kimi_linear": "KM", "k3": "KM"}
    assert [p for _, _, p, _ in A.select(["kimi_linear"], 4)] == ["KKKM"]
    (_, label, pattern, extra), = A.select(["k3"], 2)
    cfg = A.wide_head_config(label, pattern, extra, 128, 64, 8192)
    assert (cfg.num_heads, cfg.resolved_head_dim, cfg.attnres_block, cfg.num_experts) == (2, 64, 2, 8)
    # The diagnostic GDN row (not in the default sweep): the same model without its output gate.
    (_, label, pattern, extra), = A.select(["gdn_nogate"], 2)
    nogate = A.wide_head_config(label, pattern, extra, 64, 64, 8192)
    gated = A.wide_head_config(*A.select(["gdn"], 2)[0][1:], 64, 64, 8192)
    assert pattern == "GG" and nogate.gdn_output_gate == "none" and gated.gdn_output_gate == "silu"
    n_gate = accounting.param_counts(gated)["total"] - accounting.param_counts(nogate)["total"]
    assert n_gate == 2 * 64 * 64  # one d × (H·V) gate projection per layer, no bias
    # ... and KDA without its low-rank sigmoid output gate (d -> V -> H·V per layer).
    (_, label, pattern, extra), = A.select(["kda_nogate"], 2)
    kda_nogate = A.wide_head_config(label, pattern, extra, 64, 64, 8192)
    kda = A.wide_head_config(*A.select(["kda"], 2)[0][1:], 64, 64, 8192)
    assert pattern == "KK" and kda_nogate.kda_output_gate == "none" and kda.kda_output_gate == "lowrank"
    n_gate = accounting.param_counts(kda)["total"] - accounting.param_counts(kda_nogate)["total"]
    assert n_gate == 2 * (64 * 64 + 64 * 64)
    # GPT-2 without positions / with RoPE: GPT-2 less its 64 x 64 position table, GPT-2's init kept.
    for key, positions in (("gpt2_nope", "none"), ("gpt2_rope", "rope")):
        (_, label, pattern, extra), = A.select([key], 2)
        cfg = A.wide_head_config(label, pattern, extra, 64, 64, 8192)
        gpt2 = A.wide_head_config(*A.select(["gpt2"], 2)[0][1:], 64, 64, 8192)
        assert pattern == "SS" and cfg.positions == positions and gpt2.positions == "learned"
        assert accounting.param_counts(gpt2)["total"] - accounting.param_counts(cfg)["total"] == 64 * 64
        q = np.asarray(Decoder(cfg, rngs=nnx.Rngs(0)).groups[0].blocks[0].mixer.q.kernel[...])
        assert abs(q.std() / 0.02 - 1) < 0.1, q.std()  # GPT-2's std 0.02, not the default fan-in init
    # KDA with A = 1 at init: the same parameters, the decay scale starts at exp(0).
    (_, label, pattern, extra), = A.select(["kda_unit_a"], 2)
    unit = A.wide_head_config(label, pattern, extra, 64, 64, 8192)
    assert pattern == "KK" and unit.decay_a_init == "unit" and kda.decay_a_init == "default"
    assert accounting.param_counts(unit)["total"] == accounting.param_counts(kda)["total"]
    np.testing.assert_array_equal(Decoder(unit, rngs=nnx.Rngs(0)).groups[0].blocks[0].mixer.A_log[...], 0.0)


def test_plot_legend_names_every_architecture_drawn():
    """A diagnostic row run at one length only is still named (the legend was the last panel's)."""
    def run(arch, label, L, d, acc):
        return {"arch": arch, "architecture": label, "seq_len": L, "num_kv_pairs": M.ZOOLOGY_PAIRS[L],
                "d_model": d, "best_accuracy": acc}
    runs = [run("deltanet", "DeltaNet", L, d, 1.0) for L in (64, 128) for d in (64, 128)]
    runs += [run("kda_nogate", "KDA, no output gate", 64, 64, 0.9)]
    fig = M.plot(runs, dataclasses.replace(M.FULL, lengths=((64, 4), (128, 8)), widths=(64, 128)))
    legend = fig.axes[-1].get_legend()
    assert [t.get_text() for t in legend.get_texts()] == ["DeltaNet", "KDA, no output gate"]
    handles = legend.legend_handles
    assert [h.get_linestyle() for h in handles] == ["-", "--"]  # the diagnostic row is dashed ...
    assert handles[0].get_color() != handles[1].get_color() == M._style("kda", M.KEYS)["color"]  # ... in KDA's colour
    kda_rows = [M._style(k, ["kda", "kda_nogate", "kda_unit_a"]) for k in ("kda_nogate", "kda_unit_a")]
    assert kda_rows[0]["color"] == kda_rows[1]["color"] and kda_rows[0]["marker"] != kda_rows[1]["marker"]
    assert len(fig.axes[0].lines) == 2 and len(fig.axes[1].lines) == 1  # nothing drawn where it has no runs


@pytest.mark.parametrize("module, kwargs, arg", [
    (M, dict(archs=["mamba"]), "archs"),
    (M, dict(widths=[0]), "widths"),
    (M, dict(widths=[-64]), "widths"),
    (M, dict(widths=[96]), "widths"),
    (M, dict(lengths=["100"]), "lengths"),
    (M, dict(lengths=["16:8"]), "lengths"),
    (M, dict(lengths=["1024:256"]), "lengths"),  # the quick vocab of 512 has 255 keys
    (M, dict(lrs=[0.0]), "lrs"),
    (N, dict(archs=["mamba"]), "archs"),
    (N, dict(d_model=0), "d_model"),
    (N, dict(eval_lens=[64]), "eval_lens"),
    (N, dict(steps=0), "steps"),
])
def test_bad_arguments_name_the_argument(tmp_path, module, kwargs, arg):
    with pytest.raises(ValueError, match=f"^{arg}:"):
        module.run(quick=True, out=str(tmp_path), **kwargs)
    assert not (tmp_path / module.NAME).exists()  # rejected before any work
