"""The training loop: exact resume, SIGTERM, metrics, checkpoint round trip, overrides."""

import json
import math
import os
import signal
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lineage_jax.models import get_config
from lineage_jax.train import TrainConfig, apply_overrides, train
from lineage_jax.train.checkpoint import Checkpointer
from lineage_jax.train.loop import check_workdir
from lineage_jax.train.step import init_state
from tests.train.fake_data import factory


def losses(workdir):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return {r["step"]: r["loss"] for r in map(json.loads, f) if "loss" in r}


class _Wrap:
    """Wraps a data iterator; optionally sends SIGTERM to this process when batch ``kill_at`` is drawn."""

    def __init__(self, it, kill_at=None):
        self.it, self.kill_at, self.drawn = it, kill_at, 0

    def __iter__(self):
        return self

    def __next__(self):
        self.drawn += 1
        if self.kill_at is not None and self.drawn == self.kill_at:
            os.kill(os.getpid(), signal.SIGTERM)
        return next(self.it)

    def get_state(self):
        return self.it.get_state()

    def set_state(self, s):
        self.it.set_state(s)


def run(workdir, steps, config="tiny_kimi_linear", kill_at=None, model=None, log=lambda s: None, **kw):
    tc = TrainConfig(config=config, steps=steps, workdir=str(workdir), batch_size=2, seq_len=16, log_every=1,
                     save_every=100, progress=False, eval_batches=1, **kw)
    mc = get_config(config, **(model or {}))
    base = factory(tc, mc)
    data = lambda split: _Wrap(base(split), kill_at if split == "train" else None)
    return train(tc, mc, data, log=log)


def test_exact_resume(tmp_path):
    """The same 6-step command preempted after step 3 and rerun: steps 4-6 equal an uninterrupted run
    (bitwise: CPUs are deterministic, and ``deterministic=True`` makes GPUs so)."""
    # The Kimi Linear hybrid cut to two layers (a KDA layer with a dense FFN, an MLA layer with MoE and its
    # router bias, AttnRes): every kind of state the loop must restore, at a third of the compile time.
    small = dict(pattern="KM", attnres_block=2)
    full = run(tmp_path / "full", 6, deterministic=True, model=small)
    first = run(tmp_path / "resumed", 6, kill_at=3, deterministic=True, model=small)
    assert first["preempted"] and first["step"] == 3
    with Checkpointer(str(tmp_path / "resumed" / "checkpoints"), async_save=False) as ck:
        assert ck.latest_step() == 3
    again = run(tmp_path / "resumed", 6, deterministic=True, model=small)
    a, b = losses(tmp_path / "full"), losses(tmp_path / "resumed")
    assert sorted(a) == sorted(b) == [1, 2, 3, 4, 5, 6]
    for s in (1, 2, 3, 4, 5, 6):
        assert a[s] == b[s], (s, a[s], b[s])
    assert full["step"] == again["step"] == 6 and not again["preempted"]
    assert np.isfinite(full["eval"]["val_loss"])


def test_loss_decreases_and_metrics_logged(tmp_path):
    run(tmp_path / "w", 12, config="tiny_gpt2", lr=1e-2)
    l = losses(tmp_path / "w")
    assert l[12] < l[1]
    rec = json.loads(open(tmp_path / "w" / "metrics.jsonl").readline())
    assert {"step", "loss", "grad_norm", "lr", "tokens_per_s"} <= set(rec)
    assert os.path.isdir(tmp_path / "w" / "tb") and os.listdir(tmp_path / "w" / "tb")


def test_training_without_tensorboardx_says_so(tmp_path, monkeypatch):
    """Without tensorboardX the loop says that it writes no TensorBoard events, and logs its metrics."""
    monkeypatch.setitem(sys.modules, "tensorboardX", None)      # its import raises ImportError
    said = []
    run(tmp_path / "w", 2, config="tiny_gpt2", log=said.append)
    assert any("tensorboardX is not installed" in s for s in said), said
    assert not os.path.exists(tmp_path / "w" / "tb") and len(losses(tmp_path / "w")) == 2


def test_checkpoint_round_trip(tmp_path):
    tc = TrainConfig(config="tiny_k3", steps=1)
    mc = get_config("tiny_k3")
    _, template, _ = init_state(mc, tc)
    # The saved state differs from the restore target in every leaf (random floats, shifted integers):
    # a restore that handed back its target, or left any leaf as it was, fails below.
    keys = iter(jax.random.split(jax.random.key(7), len(jax.tree.leaves(template))))
    state = jax.tree.map(lambda a: a + (jax.random.normal(next(keys), a.shape, a.dtype)
                                        if jnp.issubdtype(a.dtype, jnp.floating) else jnp.ones_like(a)), template)
    ck = Checkpointer(str(tmp_path / "c"))
    ck.save(7, state, {"pos": 11}, force=True)
    ck.wait()
    assert ck.latest_step() == 7
    restored, data_state = ck.restore(template)
    assert data_state == {"pos": 11}
    assert jax.tree.structure(restored) == jax.tree.structure(state)
    for a, b, t in zip(jax.tree.leaves(state), jax.tree.leaves(restored), jax.tree.leaves(template)):
        np.testing.assert_array_equal(b, a)
        assert b.dtype == a.dtype and not np.array_equal(b, t)
    ck.close()


def test_resume_refuses_different_settings(tmp_path):
    run(tmp_path / "w", 1, config="tiny_gpt2")
    with pytest.raises(ValueError, match="different settings"):
        run(tmp_path / "w", 2, config="tiny_gpt2", lr=0.5)
    # how a scanned group runs is not a setting of the run: the same parameters, the same checkpoints
    tc = TrainConfig(config="tiny_gpt2", steps=1, workdir=str(tmp_path / "w"), batch_size=2, seq_len=16, log_every=1,
                     save_every=100, progress=False, eval_batches=1)
    check_workdir(tc, get_config("tiny_gpt2").replace(scan_unroll=True))
    with pytest.raises(ValueError, match=r"different settings \(model.d_model\)"):
        check_workdir(tc, get_config("tiny_gpt2").replace(scan_unroll=True, d_model=48))


def test_overrides_parse_types_and_reject_unknown_keys():
    tc, mc = apply_overrides(TrainConfig(), get_config("tiny_gpt2"),
                             ["lr=0.01", "steps=7", "d_model=32", "model.remat=true", "moe_bias_rule=none"])
    assert tc.lr == 0.01 and tc.steps == 7 and mc.d_model == 32 and mc.remat == "full" and tc.moe_bias_rule == "none"
    with pytest.raises(ValueError, match="unknown key 'learning_rate'"):
        apply_overrides(TrainConfig(), get_config("tiny_gpt2"), ["learning_rate=1"])
    with pytest.raises(ValueError, match="type int"):
        apply_overrides(TrainConfig(), get_config("tiny_gpt2"), ["steps=ten"])
    with pytest.raises(ValueError, match="key=value"):
        apply_overrides(TrainConfig(), get_config("tiny_gpt2"), ["steps"])


def _named_states(state, name):
    """The optimiser-state nodes of type ``name`` (named tuples, nested in tuples and dicts)."""
    if type(state).__name__ == name:
        return [state]
    children = state.values() if isinstance(state, dict) else state if isinstance(state, (tuple, list)) else ()
    return [found for child in children for found in _named_states(child, name)]


def test_muon_option_trains(tmp_path):
    """``optimizer="muon"``: the run trains, and its checkpointed optimiser state is Muon's, counted three
    steps with a momentum they moved (the loop's steps went through Muon)."""
    out = run(tmp_path / "m", 3, config="tiny_kda", optimizer="muon")
    assert np.isfinite(out["metrics"]["loss"])
    tc = TrainConfig(config="tiny_kda", steps=3, optimizer="muon", batch_size=2, seq_len=16)
    _, init, _ = init_state(get_config("tiny_kda"), tc)
    with Checkpointer(str(tmp_path / "m" / "checkpoints"), async_save=False) as ck:
        assert ck.latest_step() == 3
        state, _ = ck.restore(init)
    muon = _named_states(state.opt_state, "MuonState")
    assert len(muon) == 1 and int(muon[0].count) == 3
    moments = [np.asarray(m) for m in jax.tree.leaves(muon[0].mu)]
    assert moments and sum(bool(np.any(m != 0)) for m in moments) > len(moments) // 2


def test_muon_dims_are_per_head_and_skip_tables():
    import optax
    from flax import nnx

    from lineage_jax.models import Decoder
    from lineage_jax.train.optim import muon_dims

    model = Decoder(get_config("tiny_kimi_linear"), rngs=nnx.Rngs(0))
    _, params, _ = nnx.split(model, nnx.Param, ...)
    dims = muon_dims(params)
    blk = dims["groups"][0]["blocks"][0]
    q = blk["mixer"]["q"]["kernel"].get_value()  # [D, H, hd]: per head, input D -> output hd
    assert q == optax.contrib.MuonDimensionNumbers(reduction_axis=(0,), output_axis=(2,))
    o = blk["mixer"]["o"].get_value()  # [H, V, D]
    assert o == optax.contrib.MuonDimensionNumbers(reduction_axis=(1,), output_axis=(2,))
    assert dims["embed"].get_value() is None and dims["head"].get_value() is None
    assert blk["norm1"]["scale"].get_value() is None
    moe = dims["groups"][1]["blocks"][0]["ffn"]["w_gate"].get_value()  # [E, D, hidden]: per expert
    assert moe == optax.contrib.MuonDimensionNumbers(reduction_axis=(1,), output_axis=(2,))


def test_deterministic_sets_xla_deterministic_ops_on_gpus_only():
    from lineage_jax.train.step import compiler_options
    assert compiler_options(TrainConfig(deterministic=True), "gpu") == {"xla_gpu_deterministic_ops": True}
    assert compiler_options(TrainConfig(deterministic=False), "gpu") is None
    assert compiler_options(TrainConfig(deterministic=True), "cpu") is None


class _Scalars:
    """A stand-in for tensorboardX's SummaryWriter that records every scalar as ``(tag, step)``."""
    written: list = []

    def __init__(self, logdir):
        del logdir

    def add_scalar(self, tag, value, step):
        assert math.isfinite(value)
        _Scalars.written.append((tag, step))

    def close(self):
        pass


def _val_steps(workdir):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [r["step"] for r in map(json.loads, f) if "val_loss" in r]


def test_evaluations_reach_the_log_and_tensorboard_once_each(tmp_path, monkeypatch):
    """``eval_every``: each evaluation is one metrics.jsonl line and one TensorBoard point (``eval/*``); a
    finished run re-run evaluates nothing more; a run stopped during its last step (SIGTERM) is evaluated on
    its rerun, once."""
    import tensorboardX

    monkeypatch.setattr(tensorboardX, "SummaryWriter", _Scalars)
    monkeypatch.setattr(_Scalars, "written", [])
    out = run(tmp_path / "a", 4, config="tiny_gpt2", eval_every=2)
    assert _val_steps(tmp_path / "a") == [2, 4]
    assert sorted(s for tag, s in _Scalars.written if tag == "eval/val_loss") == [2, 4]
    again = run(tmp_path / "a", 4, config="tiny_gpt2", eval_every=2)
    assert _val_steps(tmp_path / "a") == [2, 4] and again["eval"] == out["eval"]
    assert sorted(s for tag, s in _Scalars.written if tag == "eval/val_loss") == [2, 4]
    stopped = run(tmp_path / "b", 3, config="tiny_gpt2", kill_at=3)
    assert stopped["preempted"] and stopped["step"] == 3 and _val_steps(tmp_path / "b") == []
    resumed = run(tmp_path / "b", 3, config="tiny_gpt2")
    assert not resumed["preempted"] and _val_steps(tmp_path / "b") == [3] and resumed["eval"]["val_loss"] > 0
    run(tmp_path / "b", 3, config="tiny_gpt2")
    assert _val_steps(tmp_path / "b") == [3]
