"""The train and generate CLIs: a smoke run of every tiny config, resume, generation, bad input."""

import json
import os

import pytest

from lineage_jax import generate as G
from lineage_jax.models import config_names
from lineage_jax.train.__main__ import main as train_main

TINY = [n for n in config_names() if n.startswith("tiny_")]
SMALL = ["--set", "seq_len=64", "--set", "batch_size=2", "--set", "log_every=1", "--set", "progress=false",
         "--set", "eval_batches=1"]


@pytest.mark.parametrize("name", TINY)
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
    assert draws <= {0, 1}  # 0.5 + 0.3 reaches 0.7: the nucleus is the two most likely tokens


@pytest.mark.parametrize("argv, msg", [
    (["--config", "gpt5", "--steps", "1", "--workdir", "w"], "valid names"),
    (["--config", "tiny_gpt2", "--steps", "1", "--workdir", "w", "--set", "nope=1"], "valid keys"),
    (["--config", "tiny_gpt2", "--steps", "1", "--workdir", "w", "--set", "lr=fast"], "type float"),
    (["--config", "tiny_gpt2", "--steps", "0", "--workdir", "w"], "steps"),
    (["--config", "tiny_kimi_linear", "--steps", "1", "--workdir", "w", "--set", "top_k=99"], "top_k"),
    (["--config", "tiny_gpt2", "--steps", "1", "--workdir", "w", "--data", "mqar", "--set", "seq_len=8"], "seq_len"),
    (["--config", "tiny_gpt2", "--steps", "1", "--workdir", "w", "--mesh", "data=2,pipeline=2"], "--mesh"),
    (["--config", "tiny_gpt2", "--steps", "1", "--workdir", "w", "--mesh", "data=2"], "2 devices"),
    (["--config", "tiny_gpt2", "--steps", "1", "--workdir", "w", "--mesh", "data=x"], "--mesh"),
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
    wd = tmp_path / "bf16"
    assert train_main(["--config", "tiny_kda", "--steps", "2", "--workdir", str(wd), "--data", "mqar", *SMALL,
                       "--set", "dtype=bfloat16"]) == 0
    rec = json.load(open(wd / "config.json"))
    assert rec["model"]["dtype"] == "bfloat16"
    losses = [json.loads(l)["loss"] for l in open(wd / "metrics.jsonl") if "loss" in json.loads(l)]
    assert len(losses) == 2 and all(l == l and l > 0 for l in losses)  # finite, not NaN
