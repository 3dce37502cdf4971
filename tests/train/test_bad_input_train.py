"""Bad training input: clear errors naming the argument or file, and nothing lost."""

import dataclasses
import json
import math
import os
import shutil

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
import pytest

from lineage_jax.models import get_config
from lineage_jax.train import TrainConfig, apply_overrides, train
from lineage_jax.train.__main__ import main as train_main
from lineage_jax.train.checkpoint import CheckpointError, Checkpointer, NonFiniteStateError, first_nonfinite
from lineage_jax.train.step import init_state
from tests.train.fake_data import factory


def _cfg(workdir, steps=2, **kw):
    return TrainConfig(config="tiny_gpt2", steps=steps, workdir=str(workdir), batch_size=2, seq_len=16, log_every=1,
                       save_every=1, progress=False, eval_batches=1, **kw)


def _train(workdir, steps=2, model=None, **kw):
    tc, mc = _cfg(workdir, steps, **kw), model or get_config("tiny_gpt2")
    return train(tc, mc, factory(tc, mc), log=lambda s: None)


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A 2-step tiny_gpt2 run with checkpoints of steps 1 and 2."""
    wd = tmp_path_factory.mktemp("bad_in") / "base"
    _train(wd)
    return wd


def _copy(finished, tmp_path):
    wd = tmp_path / "run"
    shutil.copytree(finished, wd)
    return wd


def _restores(wd, step, model=None):
    tc, mc = _cfg(wd), model or get_config("tiny_gpt2")
    _, state, _ = init_state(mc, tc)
    with Checkpointer(os.path.join(wd, "checkpoints"), async_save=False) as ckpt:
        restored, _ = ckpt.restore(state, step)
    return int(restored.step) == step


def test_corrupted_latest_checkpoint_names_its_directory_and_changes_nothing(finished, tmp_path):
    wd = _copy(finished, tmp_path)
    step2 = wd / "checkpoints" / "2"
    (step2 / "state" / "_METADATA").write_text("")
    before = sorted(os.listdir(wd / "checkpoints"))
    with pytest.raises(CheckpointError, match=r"checkpoints/2 cannot be restored.*resume from step 1"):
        _train(wd, steps=3)
    assert sorted(os.listdir(wd / "checkpoints")) == before == ["1", "2"]
    assert _restores(wd, 1)
    shutil.move(str(step2), str(tmp_path / "aside"))  # the hint's remedy resumes from step 1
    assert _train(wd, steps=3)["step"] == 3


def test_corrupted_checkpoint_is_a_one_line_cli_error(tmp_path, capsys):
    wd = tmp_path / "run"
    args = ["--config", "tiny_gpt2", "--workdir", str(wd), "--data", "mqar", "--set", "batch_size=2",
            "--set", "seq_len=64", "--set", "progress=false", "--set", "eval_batches=1"]
    assert train_main(["--steps", "1", *args]) == 0
    shutil.rmtree(wd / "checkpoints" / "1" / "state")
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        train_main(["--steps", "2", *args])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "cannot be restored" in err and str(wd / "checkpoints" / "1") in err
    assert os.listdir(wd / "checkpoints") == ["1"]


def _poison(wd, step, leaf=0):
    """Rewrite step ``step``'s checkpoint (in place, as orbax saved it) with a NaN in one float leaf of its
    optimizer state: what damaged bytes that still parse look like."""
    tc, mc = _cfg(wd), get_config("tiny_gpt2")
    _, state, _ = init_state(mc, tc)
    with Checkpointer(os.path.join(wd, "checkpoints"), async_save=False) as ckpt:
        restored, data_state = ckpt.restore(state, step)
    leaves, tree = jax.tree.flatten(restored.opt_state)
    floats = [i for i, x in enumerate(leaves) if jnp.issubdtype(x.dtype, jnp.floating) and x.size > 1]
    i = floats[leaf]
    leaves[i] = leaves[i].at[(0,) * leaves[i].ndim].set(jnp.nan)
    bad = restored._replace(opt_state=jax.tree.unflatten(tree, leaves))
    shutil.rmtree(wd / "checkpoints" / str(step))
    with Checkpointer(os.path.join(wd, "checkpoints"), async_save=False) as ckpt:
        ckpt.manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(bad._asdict()),
            data=ocp.args.JsonSave(data_state)))


def test_checkpoint_with_nan_values_is_refused_and_kept_with_the_others(finished, tmp_path):
    wd = _copy(finished, tmp_path)
    _poison(wd, 2)
    with pytest.raises(CheckpointError, match=r"checkpoints/2 cannot be restored.*opt_state.*NaN or infinite.*"
                                              r"resume from step 1"):
        _train(wd, steps=3)
    assert sorted(os.listdir(wd / "checkpoints")) == ["1", "2"] and _restores(wd, 1)


def test_a_diverged_run_stops_without_saving_and_keeps_its_checkpoints(tmp_path):
    # a learning rate of 1e30 takes the parameters to ~1e29 at step 2 and the loss to NaN at step 3
    wd = tmp_path / "run"
    with pytest.raises(NonFiniteStateError, match=r"step 3: the training loss is nan; stopped without saving.*"
                                                  r"kept \(steps \[1, 2\]\)"):
        _train(wd, steps=4, lr=1e30)
    assert sorted(os.listdir(wd / "checkpoints")) == ["1", "2"] and _restores(wd, 2)


def test_saving_a_nonfinite_state_writes_nothing(tmp_path):
    tc, mc = _cfg(tmp_path / "r"), get_config("tiny_gpt2")
    _, state, _ = init_state(mc, tc)
    assert first_nonfinite(state._asdict()) is None
    params = jax.tree.map(lambda a: a.at[(0,) * a.ndim].set(jnp.inf) if a.ndim else a, state.params)
    with Checkpointer(os.path.join(tmp_path, "ck"), async_save=False) as ckpt:
        ckpt.save(1, state, {"i": 1})
        with pytest.raises(NonFiniteStateError, match=r"step 2: the training state holds NaN or infinite values "
                                                      r"\(first in params/"):
            ckpt.save(2, state._replace(params=params), {"i": 2})
        assert ckpt.manager.all_steps() == [1]


def test_a_cut_short_metrics_line_is_dropped_on_resume(finished, tmp_path):
    wd = _copy(finished, tmp_path)
    with open(wd / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "accura')  # a crash in the middle of a write
    logs = []
    tc, mc = _cfg(wd, 3), get_config("tiny_gpt2")
    assert train(tc, mc, factory(tc, mc), log=logs.append)["step"] == 3
    assert any("metrics.jsonl: dropped 1 line(s) that are not JSON records (line" in m for m in logs)
    steps = [json.loads(l)["step"] for l in (wd / "metrics.jsonl").read_text().splitlines()]
    assert steps[-2:] == [3, 3] and 2 in steps  # step 3's training and evaluation lines, the old ones kept


def test_a_bad_data_state_in_a_checkpoint_names_the_checkpoint(finished, tmp_path):
    wd = _copy(finished, tmp_path)
    (wd / "checkpoints" / "2" / "data" / "metadata").write_text('{"next_index": 2}')
    with pytest.raises(CheckpointError, match=r"checkpoints/2 cannot be restored.*resume from step 1"):
        _train(wd, steps=3)
    assert sorted(os.listdir(wd / "checkpoints")) == ["1", "2"]


def test_checkpoint_of_another_model_keeps_the_workdir_as_it_was(finished, tmp_path):
    wd = _copy(finished, tmp_path)
    os.remove(wd / "config.json")  # no record to compare against: the checkpoint itself must refuse
    other = get_config("tiny_gpt2").replace(d_model=96)
    with pytest.raises(CheckpointError, match=r"checkpoints/2 cannot be restored.*other settings"):
        _train(wd, steps=3, model=other)
    assert not (wd / "config.json").exists()  # not relabelled with the refused model's config
    assert sorted(os.listdir(wd / "checkpoints")) == ["1", "2"] and _restores(wd, 2)


def test_seq_len_beyond_the_learned_positions_is_refused_before_writing(tmp_path, capsys):
    wd = tmp_path / "run"
    with pytest.raises(ValueError, match=r"TrainConfig.seq_len: 600 exceeds .*max_seq_len=512"):
        train(dataclasses.replace(_cfg(wd, 1), seq_len=600), get_config("tiny_gpt2"), lambda split: None)
    assert not wd.exists()
    with pytest.raises(SystemExit) as e:
        train_main(["--config", "tiny_gpt2", "--steps", "1", "--workdir", str(wd), "--data", "mqar",
                    "--set", "seq_len=600"])
    assert e.value.code == 2 and "seq_len" in capsys.readouterr().err and not wd.exists()


@pytest.mark.parametrize("field,value", [
    ("lr", math.nan), ("lr", math.inf), ("lr", 0.0), ("min_lr_ratio", math.nan), ("weight_decay", math.nan),
    ("weight_decay", -0.1), ("b1", 1.0), ("b2", math.nan), ("grad_clip", math.nan), ("grad_clip", -1.0),
    ("grad_clip", 0.0), ("moe_bias_rate", math.nan), ("warmup_steps", -1), ("warmup_steps", 2.5),
    ("eval_every", -1), ("seed", -1), ("batch_size", 2.5), ("seq_len", True), ("steps", "10"),
    ("deterministic", "false"), ("progress", "no"), ("progress", 1), ("mesh", 3), ("mesh_dcn", 3), ("workdir", None),
    ("data", None), ("init_from_hf", 5), ("optimizer", None), ("workdir", " "), ("config", ""),
])
def test_train_config_refuses_bad_values_naming_the_field(field, value):
    with pytest.raises(ValueError, match=rf"TrainConfig\.{field}: must be"):
        TrainConfig(**{field: value})


def test_set_nan_is_a_cli_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        train_main(["--config", "tiny_gpt2", "--steps", "1", "--workdir", str(tmp_path / "r"), "--set", "lr=nan"])
    assert e.value.code == 2 and "TrainConfig.lr: must be finite" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


def test_set_model_prefix_with_a_train_field_says_so():
    with pytest.raises(ValueError, match=r"'model\.lr'; 'lr' is a TrainConfig field \(--set lr=\.\.\.\)"):
        apply_overrides(TrainConfig(), get_config("tiny_gpt2"), ["model.lr=1e-3"])


def test_valid_configs_still_accepted():
    TrainConfig(lr=1, warmup_steps=0, eval_every=0, b1=0.0, b2=0.999, weight_decay=0, min_lr_ratio=1, seed=2**32 - 1)
    tc, mc = apply_overrides(TrainConfig(), get_config("tiny_gpt2"), ["lr=1e-3", "model.d_model=128"])
    assert tc.lr == 1e-3 and mc.d_model == 128


def test_train_step_refuses_bfloat16_parameters():
    """A model loaded with ``hf.load(dtype="bfloat16")`` holds 16-bit parameters (for inference): a
    ``TrainStep`` over it would keep bf16 optimizer moments and round small updates away, so it is refused
    naming ``model``; the same checkpoint in float32 trains."""
    from lineage_jax import hf
    from lineage_jax.parallel.mesh import make_mesh
    from lineage_jax.train.step import TrainStep

    path = os.path.join(os.path.dirname(__file__), os.pardir, "fixtures", "hf", "kimi_linear")
    mesh = make_mesh({"data": 1}, devices=jax.devices()[:1])
    with pytest.raises(ValueError, match=r"`model` must hold float32 master weights.*bfloat16"):
        TrainStep(hf.load(path, dtype="bfloat16"), mesh)
    assert TrainStep(hf.load(path), mesh) is not None


@pytest.mark.parametrize("kind,peak", [("TPU v5 lite", 197e12), ("TPU v5", 459e12), ("TPU v5p", 459e12),
                                       ("TPU v6 lite", 918e12), ("TPU v4", 275e12), ("NVIDIA H200", 989e12),
                                       ("Some accelerator", None)])
def test_peak_flops_knows_the_names_libtpu_gives(kind, peak, monkeypatch):
    """MFU's peak by ``device_kind`` as the runtimes spell it (libtpu: "TPU v5 lite" for a v5e, "TPU v5" for
    a v5p, "TPU v6 lite" for a v6e), times the device count; an unknown kind gives None (no MFU)."""
    from types import SimpleNamespace

    from lineage_jax.train import loop

    monkeypatch.setattr(jax, "devices", lambda *a: [SimpleNamespace(device_kind=kind)] * 4)
    monkeypatch.setattr(jax, "device_count", lambda *a: 4)
    assert loop.peak_flops() == (None if peak is None else 4 * peak)
