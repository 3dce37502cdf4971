"""The train and generate CLIs: a smoke run of every tiny config, resume, generation, bad input."""

import json

import pytest

from lineage_jax import generate as G
from lineage_jax.models import config_names
from lineage_jax.train.__main__ import main as train_main

TINY = [n for n in config_names() if n.startswith("tiny_")]
SMALL = ["--set", "seq_len=64", "--set", "batch_size=2", "--set", "log_every=1", "--set", "progress=false",
         "--set", "eval_batches=1"]


# The default suite trains one config through the CLI (GPT-2; the CLI is the same for every model, and
# the Kimi Linear hybrid trains through the same loop in tests/train/test_loop.py's exact resume);
# every tiny config's forward, prefill and decode are in tests/layers/test_models.py, and `-m slow`
# trains the rest here too.
CLI_DEFAULT = ("tiny_gpt2",)


@pytest.mark.parametrize("name", [n if n in CLI_DEFAULT else pytest.param(n, marks=pytest.mark.slow) for n in TINY])
def test_cli_smoke_every_tiny_config(name, tmp_path, capsys):
    rc = train_main(["--config", name, "--steps", "2", "--workdir", str(tmp_path / name), "--data", "mqar", *SMALL])
    assert rc == 0
    lines = [json.loads(l) for l in open(tmp_path / name / "metrics.jsonl")]
    steps = [l["step"] for l in lines if "loss" in l]
    assert steps == [1, 2] and all(l["loss"] > 0 for l in lines if "loss" in l)
    assert "val loss" in capsys.readouterr().out


def test_stdlib_training_then_generation(tmp_path, capsys):
    wd = str(tmp_path / "gpt")
    assert train_main(["--config", "tiny_gpt2", "--steps", "3", "--workdir", wd, *SMALL]) == 0
    capsys.readouterr()
    assert G.main(["--workdir", wd, "--prompt", "import os", "--max-new-tokens", "5", "--temperature", "0"]) == 0
    out = capsys.readouterr()
    assert out.out.startswith("import os") and "tok/s" in out.err


def test_sampling_filters():
    import jax
    import jax.numpy as jnp

    logits = jnp.log(jnp.asarray([[0.5, 0.3, 0.15, 0.05]]))
    assert int(G.sample_token(logits, jax.random.key(0), temperature=0)[0]) == 0
    draws = {int(G.sample_token(logits, jax.random.key(i), top_k=2)[0]) for i in range(64)}
    assert draws <= {0, 1} and len(draws) == 2
    draws = {int(G.sample_token(logits, jax.random.key(i), top_p=0.7)[0]) for i in range(64)}
    assert draws == {0, 1}  # 0.5 + 0.3 reaches 0.7: the nucleus is the two most likely tokens
    draws = {int(G.sample_token(logits, jax.random.key(i), top_p=0.4)[0]) for i in range(64)}
    assert draws == {0}  # 0.5 alone reaches 0.4
    draws = {int(G.sample_token(logits, jax.random.key(i))[0]) for i in range(64)}
    assert draws == {0, 1, 2, 3}  # no filter: every token can be drawn


@pytest.mark.parametrize("argv, msg", [
    (["--config", "gpt5", "--steps", "1", "--workdir", "w"], "valid names"),
    (["--config", "tiny_gpt2", "--steps", "1", "--workdir", "w", "--set", "nope=1"], "unknown key 'nope'"),
    (["--config", "tiny_gpt2", "--steps", "1", "--workdir", "w", "--set", "d_modle=64"], "did you mean 'd_model'"),
    (["--config", "tiny_gpt2", "--steps", "1", "--workdir", "w", "--data", "no/such/dir"], "--data"),
    (["--config", "tiny_gpt2", "--steps", "1", "--workdir", "w", "--set", "lr=fast"], "type float"),
    (["--config", "tiny_gpt2", "--steps", "0", "--workdir", "w"], "steps"),
    (["--config", "tiny_kimi_linear", "--steps", "1", "--workdir", "w", "--set", "top_k=99"], "top_k"),
    (["--config", "tiny_gpt2", "--steps", "1", "--workdir", "w", "--data", "mqar", "--set", "seq_len=8"], "seq_len"),
    (["--config", "tiny_gpt2", "--steps", "1", "--workdir", "w", "--mesh", "data=2,pipeline=2"], "--mesh"),
    (["--config", "tiny_gpt2", "--steps", "1", "--workdir", "w", "--mesh", "data=2"], "2 devices"),
    (["--config", "tiny_gpt2", "--steps", "1", "--workdir", "w", "--mesh", "data=x"], "--mesh"),
    (["--config", "tiny_gpt2", "--steps", "1", "--workdir", "w", "--set", "config=tiny_kda"],
     "`config` is set by --config, not --set"),
    (["--config", "tiny_gpt2", "--steps", "1", "--workdir", "w", "--set", "init_from_hf=x"],
     "`init_from_hf` is set by --init-from-hf"),
    (["--config", "tiny_gpt2", "--steps", "1", "--workdir", "w", "--set", "steps=5"], "`steps` is set by --steps"),
])
def test_bad_cli_input_is_a_clear_error(argv, msg, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a wrongly accepted run must not write into the repository
    with pytest.raises(SystemExit) as e:
        train_main(argv)
    assert e.value.code == 2 and msg in capsys.readouterr().err


def test_generate_needs_a_run(tmp_path, capsys):
    with pytest.raises(SystemExit):
        G.main(["--workdir", str(tmp_path), "--prompt", "x"])
    assert "no run" in capsys.readouterr().err


def test_bf16_compute_with_fp32_master_weights(tmp_path):
    """``dtype=bfloat16``: the checkpointed (master) parameters are float32 and trained; the model's
    projections run as bf16 x bf16 products; its logits differ from the float32 model's on the same
    parameters by a bf16-sized error, not zero."""
    import collections

    import jax
    import jax.numpy as jnp
    import numpy as np
    import orbax.checkpoint as ocp
    from flax import nnx

    from lineage_jax.models import Decoder, get_config
    from lineage_jax.train import TrainConfig
    from lineage_jax.train.checkpoint import Checkpointer
    from lineage_jax.train.step import init_state
    from tests._jaxpr import calls
    from tests._numerics import rel_err

    wd = tmp_path / "bf16"
    assert train_main(["--config", "tiny_kda", "--steps", "2", "--workdir", str(wd), "--data", "mqar", *SMALL,
                       "--set", "dtype=bfloat16"]) == 0
    rec = json.load(open(wd / "config.json"))
    assert rec["model"]["dtype"] == "bfloat16"
    losses = [json.loads(l)["loss"] for l in open(wd / "metrics.jsonl") if "loss" in json.loads(l)]
    assert len(losses) == 2 and all(l == l and l > 0 for l in losses)  # finite, not NaN

    # Stored float32 (the checkpoint's own metadata), born float32, and changed by the two steps.
    stored = ocp.StandardCheckpointer().metadata(str(wd / "checkpoints" / "2" / "state")).item_metadata.tree
    stored = jax.tree.leaves(stored["params"], is_leaf=lambda x: hasattr(x, "dtype"))
    assert stored and {str(a.dtype) for a in stored} == {"float32"}
    mc = get_config("tiny_kda").replace(dtype="bfloat16")
    graphdef, init, _ = init_state(mc, TrainConfig(config="tiny_kda", steps=2))
    with Checkpointer(str(wd / "checkpoints"), async_save=False) as ck:
        state, _ = ck.restore(init)
    params, init_params = jax.tree.leaves(state.params), jax.tree.leaves(init.params)
    assert len(params) == len(stored) and all(a.dtype == jnp.float32 for a in params + init_params)
    assert sum(not np.array_equal(a, b) for a, b in zip(params, init_params)) > len(params) // 2

    tokens = jnp.asarray(np.random.default_rng(0).integers(0, mc.vocab_size, (1, 16)), jnp.int32)
    g32 = nnx.split(nnx.eval_shape(lambda: Decoder(mc.replace(dtype="float32"), rngs=nnx.Rngs(0))), nnx.Param, ...)[0]
    fwd = lambda g: lambda p, r, t: nnx.merge(g, p, r).forward(t)[0]
    jaxpr = jax.make_jaxpr(fwd(graphdef))(state.params, state.rest, tokens).jaxpr
    dots = collections.Counter(tuple(str(v.aval.dtype) for v in e.invars) for e in calls(jaxpr, ("dot_general",)))
    # q, k, v, β, the two gate and two output-gate projections, o, and the FFN's gate, up and down
    assert dots[("bfloat16", "bfloat16")] >= 12, dots
    y16, y32 = jax.jit(lambda p, r, t: (fwd(graphdef)(p, r, t), fwd(g32)(p, r, t)))(state.params, state.rest, tokens)
    assert y16.dtype == y32.dtype == jnp.float32
    err = rel_err(y16, y32)
    # Measured: 5.2e-2 (max error over the max logit; bf16 keeps 8 significant bits through 2 layers).
    assert 5e-3 < err < 0.15, err


def _no_traceback(err: str) -> None:
    assert "Traceback" not in err and len(err.strip().splitlines()) <= 6  # usage + one error line


def test_bad_data_writes_nothing_and_the_corrected_command_runs(tmp_path, capsys):
    wd = tmp_path / "run"
    with pytest.raises(SystemExit) as e:
        train_main(["--config", "tiny_gpt2", "--steps", "1", "--workdir", str(wd), "--data", str(tmp_path / "nope"),
                    *SMALL])
    assert e.value.code == 2 and "--data" in capsys.readouterr().err
    assert not wd.exists()
    assert train_main(["--config", "tiny_gpt2", "--steps", "1", "--workdir", str(wd), "--data", "mqar", *SMALL]) == 0


def test_workdir_that_is_a_file_is_a_clear_error(tmp_path, capsys):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(SystemExit) as e:
        train_main(["--config", "tiny_gpt2", "--steps", "1", "--workdir", str(f)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "is a file" in err
    _no_traceback(err)


def test_finished_run_reports_its_metrics_and_a_copied_run_resumes(tmp_path, capsys):
    import shutil

    wd = tmp_path / "a"
    args = ["--config", "tiny_gpt2", "--workdir", str(wd), "--data", "mqar", *SMALL]
    assert train_main(["--steps", "2", *args]) == 0
    first = capsys.readouterr().out.strip().splitlines()[-1]
    assert train_main(["--steps", "2", *args]) == 0  # finished: report, do not train, no NaN
    again = capsys.readouterr()
    assert again.out.strip().splitlines()[-1] == first and "nan" not in again.out
    assert "already finished 2 steps" in again.out
    moved = tmp_path / "b"
    shutil.copytree(wd, moved)
    args_b = ["--config", "tiny_gpt2", "--workdir", str(moved), "--data", "mqar", *SMALL]
    assert train_main(["--steps", "3", *args_b]) == 0  # the copy resumes and extends (steps = the total)
    steps = [json.loads(l)["step"] for l in open(moved / "metrics.jsonl") if "loss" in json.loads(l)]
    assert steps == [1, 2, 3]


def test_a_run_resumes_with_its_recorded_settings(tmp_path, capsys):
    """``--steps N --workdir DIR`` resumes a run with what its config.json records (its --config, --data and
    --set values), and gives the same result as the full command."""
    import shutil

    full = tmp_path / "full"
    args = ["--config", "tiny_gpt2", "--data", "mqar", *SMALL]
    assert train_main(["--steps", "2", "--workdir", str(full), *args]) == 0
    short = tmp_path / "short"
    shutil.copytree(full, short)
    assert train_main(["--steps", "3", "--workdir", str(full), *args]) == 0
    assert train_main(["--steps", "3", "--workdir", str(short)]) == 0
    finals = [l for l in capsys.readouterr().out.splitlines() if l.startswith("step 3:")]
    assert len(finals) == 2 and finals[0] == finals[1]  # the same step-3 metrics either way
    with pytest.raises(SystemExit) as e:  # an empty directory holds no run
        train_main(["--steps", "1", "--workdir", str(tmp_path / "none")])
    assert e.value.code == 2 and "or a --workdir holding a run" in capsys.readouterr().err
    (short / "config.json").write_text("{")
    with pytest.raises(SystemExit) as e:
        train_main(["--steps", "4", "--workdir", str(short)])
    assert e.value.code == 2 and "config.json is unreadable" in capsys.readouterr().err


def test_help_describes_every_option(capsys):
    with pytest.raises(SystemExit):
        train_main(["--help"])
    out = capsys.readouterr().out
    assert "total optimizer steps" in out and "the run's directory" in out


def test_a_mixer_of_ones_own_trains_resumes_and_generates(tmp_path, monkeypatch, capsys):
    """`--import` a module that registers a mixer: its letter trains, the run records the import, and a
    resume from the run directory alone (tables and module gone, as in a new process) imports it again."""
    from flax import nnx

    from lineage_jax.layers.memory_mixer import MemoryMixer
    from tests._registry import SavedTables

    (tmp_path / "my_rules.py").write_text(
        "from lineage_jax.layers.memory_mixer import Rule\n"
        "from lineage_jax.models import register_rule\n"
        "register_rule('gla_cli', Rule('Q', gate='channel', erase=False, output_gate='full'))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    forget = SavedTables(modules=["my_rules"]).restore  # a new process: the library's tables, no module
    wd = str(tmp_path / "run")
    try:
        assert train_main(["--config", "tiny_gdn", "--steps", "2", "--workdir", wd, "--import", "my_rules",
                           "--set", "pattern=QG", "--data", "mqar", *SMALL]) == 0
        assert json.load(open(tmp_path / "run" / "config.json"))["train"]["imports"] == "my_rules"
        forget()
        assert train_main(["--steps", "3", "--workdir", wd]) == 0
        steps = [l["step"] for l in map(json.loads, open(tmp_path / "run" / "metrics.jsonl")) if "loss" in l]
        assert steps == [1, 2, 3]
        forget()
        model, _ = G.load(wd)
        assert model.cfg.pattern == "QG"
        assert [m.rule for _, m in nnx.iter_graph(model) if isinstance(m, MemoryMixer)] == ["gla_cli", "gdn"]
        forget()
        capsys.readouterr()
        assert G.main(["--workdir", wd, "--prompt-ids", "1,2,3", "--max-new-tokens", "3", "--temperature", "0"]) == 0
        assert "decode 3 tok" in capsys.readouterr().err
    finally:
        forget()
    capsys.readouterr()
    for module, match in (("no_such_module_here", "--import: importing 'no_such_module_here' failed"),
                          ("two words", "--import: 'two words' is not a module name")):
        with pytest.raises(SystemExit):
            train_main(["--config", "tiny_gdn", "--steps", "1", "--workdir", str(tmp_path / "x"), "--import", module])
        assert match in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_a_run_whose_import_is_gone_is_refused_by_name(tmp_path, capsys):
    wd = tmp_path / "run"
    wd.mkdir()
    (wd / "config.json").write_text(json.dumps({"train": {"imports": "gone_module_of_a_run"}, "model": {}}))
    with pytest.raises(SystemExit):
        train_main(["--steps", "2", "--workdir", str(wd)])
    assert "the run's TrainConfig.imports: importing 'gone_module_of_a_run' failed" in capsys.readouterr().err


def test_a_validation_split_too_short_is_refused_before_training(tmp_path, capsys):
    """The validation split is read up front: too short for one row, the run is refused before anything is
    written (it was read after the last step, and the failure recurred on every resume)."""
    from lineage_jax.data import text

    docs = tmp_path / "docs"
    docs.mkdir()
    val_name = text.split_files(["a.txt", "b.txt"], "val")[0]
    for name in ("a.txt", "b.txt"):
        (docs / name).write_text("tiny" if name == val_name else "plenty of training text here. " * 200)
    wd = tmp_path / "run"
    with pytest.raises(SystemExit):
        train_main(["--config", "tiny_gpt2", "--steps", "2", "--workdir", str(wd), "--data", str(docs), *SMALL])
    assert "its validation split: seq_len: 64 leaves no full row" in capsys.readouterr().err
    assert not wd.exists()
