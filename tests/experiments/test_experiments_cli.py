"""The experiment scripts' command lines: bad options are refused by name before anything runs,
``--quick`` keeps the options given explicitly, ``--merge`` refuses measuring options, and the
library modules say what uses them. Nothing here measures anything for real (the measuring
functions are replaced where a run would start)."""

import json
import runpy
import warnings

import pytest

from experiments import attention_bench, gmm_bench, kernel_bench, kv_read, train_bench
from experiments import architectures, ep_scaling, mqar, niah, scorecard


def _error_line(capsys, prog: str) -> str:
    """The ``<prog>: error: ...`` line of an argparse error (the usage line above it names every flag)."""
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith(f"python -m experiments.{prog}: error:")]
    assert lines, err
    return lines[-1]


def _refused(capsys, main, argv, prog: str) -> str:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    return _error_line(capsys, prog)


# ----------------------------------------------------------------------------------------- train_bench
@pytest.fixture
def no_training(monkeypatch):
    """``train_bench.measure`` replaced by a stand-in that records its calls and trains nothing."""
    calls = []

    def fake(row, B, T, size, *, remat, steps, warmup, window, bar=None, **kw):
        calls.append(dict(row=row, B=B, T=T, steps=steps, warmup=warmup, window=window))
        if bar is not None:
            bar.update(max(1, steps // window) * window)
        return {"row": row, "batch": B, "seq_len": T, "remat": remat, "status": "ok", "step_s": 1.0,
                "tokens_per_s": float(B * T), "mfu": None, "memory_bytes": None, "compile_s": 0.0, "losses": []}

    monkeypatch.setattr(train_bench, "measure", fake)
    return calls


@pytest.mark.parametrize("argv, flag", [(["--attention-impl", "bogus"], "--attention-impl"),
                                        (["--memory-backend", "bogus"], "--memory-backend")])
def test_train_bench_refuses_a_bad_impl_before_running(tmp_path, capsys, no_training, argv, flag):
    line = _refused(capsys, train_bench.main, ["--quick", "--rows", "softmax", "--out", str(tmp_path)] + argv,
                    "train_bench")
    assert flag in line and "bogus" in line
    kw = {flag.lstrip("-").replace("-", "_"): "bogus"}
    with pytest.raises(ValueError, match=flag):
        train_bench.run(quick=True, out=str(tmp_path), rows="softmax", **kw)
    assert not no_training and not (tmp_path / "train_bench").exists()


def test_train_bench_quick_keeps_explicit_sizes(tmp_path, capsys, no_training):
    train_bench.main(["--quick", "--rows", "softmax", "--shapes", "3x32", "--steps", "6", "--warmup", "2",
                      "--window", "3", "--out", str(tmp_path)])
    rec = json.loads((tmp_path / "train_bench" / "train_bench.json").read_text())
    assert rec["shapes"] == [[3, 32]] and (rec["steps"], rec["warmup"], rec["window"]) == (6, 2, 3)
    assert no_training == [dict(row="softmax", B=3, T=32, steps=6, warmup=2, window=3)]
    no_training.clear()
    train_bench.run(quick=True, out=str(tmp_path), rows="softmax", steps=6)  # the unset ones: --quick's
    assert no_training == [dict(row="softmax", B=2, T=64, steps=6, warmup=1, window=2)]


@pytest.mark.parametrize("item, says", [("lr=1e-3", "unknown key 'lr'"),
                                        ("warmup_steps=5", "unknown key 'warmup_steps'"),
                                        ("moe_dispatch", "expected FIELD=VALUE, got 'moe_dispatch'")])
def test_train_bench_set_takes_model_config_fields_only(tmp_path, capsys, no_training, item, says):
    line = _refused(capsys, train_bench.main, ["--rows", "softmax", "--set", item, "--out", str(tmp_path)],
                    "train_bench")
    assert "--set" in line and says in line and "model." not in line
    if "unknown key" in line:
        assert "ModelConfig fields only" in line and "did you mean 'lr'" not in line
        assert "warmup_steps'?" not in line  # no TrainConfig field suggested for itself
    assert not no_training


def test_train_bench_set_is_checked_against_every_row_asked_for(tmp_path, no_training):
    """A field only one row's config checks (MoE's dispatch: the moe row) is refused before any row runs."""
    with pytest.raises(ValueError, match=r"--set moe_dispatch=bogus \(row moe\)"):
        train_bench.run(quick=True, out=str(tmp_path), rows="softmax,moe", overrides=["moe_dispatch=bogus"])
    assert not no_training


def test_train_bench_bar_does_not_count_a_failed_row(tmp_path, monkeypatch, no_training):
    """A failed row's steps leave the bar's total instead of being counted as done."""
    from experiments import common

    bars, make, fake = [], common.progress, train_bench.measure

    def failing(row, *a, **kw):
        if row == "mla":
            raise RuntimeError("unsupported here")
        return fake(row, *a, **kw)

    monkeypatch.setattr(common, "progress", lambda *a, **kw: bars.append(make(*a, **kw)) or bars[-1])
    monkeypatch.setattr(train_bench, "measure", failing)
    rec = train_bench.run(quick=True, out=str(tmp_path), rows="softmax,mla", steps=4, window=2)
    assert [r["status"] for r in rec["results"]] == ["ok", "error"]
    assert bars[0].n == bars[0].total == 4  # the softmax row's 4 steps; the mla row's 4 dropped
    assert "1 failed" in str(bars[0].postfix)


def test_train_bench_merge_refuses_measuring_options(tmp_path, capsys, no_training):
    line = _refused(capsys, train_bench.main, ["--merge", str(tmp_path), "--steps", "5", "--out", str(tmp_path)],
                    "train_bench")
    assert "--merge" in line and "got --steps" in line


# ------------------------------------------------------------------------------ gmm / attention benches
@pytest.fixture
def no_timing(monkeypatch):
    from experiments import common

    monkeypatch.setattr(common, "timed_calls", lambda fn, args, reps, warmup=0: [1e-3] * reps)
    monkeypatch.setattr(gmm_bench, "check", lambda impl, shape: {"y": 0.0, "dx": 0.0, "dw": 0.0})
    monkeypatch.setattr(attention_bench, "check", lambda *a, **k: {"o": 0.0, "dq": 0.0, "dk": 0.0, "dv": 0.0})


def test_gmm_bench_quick_keeps_explicit_shapes_and_reps(tmp_path, capsys, no_timing):
    gmm_bench.main(["--quick", "--shapes", "32x2x4x16x8", "--reps", "3", "--impls", "ragged_dot",
                    "--out", str(tmp_path)])
    rec = json.loads((tmp_path / "gmm_bench" / "gmm_bench.json").read_text())
    assert rec["shapes"] == [[32, 2, 4, 16, 8]] and rec["reps"] == 3
    rec = gmm_bench.run(quick=True, out=str(tmp_path), impls="ragged_dot", reps=3)  # shapes unset: --quick's
    assert rec["shapes"] == [[64, 2, 4, 64, 48]] and rec["reps"] == 3


def test_attention_bench_quick_keeps_explicit_shapes_and_reps(tmp_path, capsys, no_timing):
    attention_bench.main(["--quick", "--shapes", "2x32", "--reps", "3", "--impls", "xla", "--layouts", "mha",
                          "--out", str(tmp_path)])
    rec = json.loads((tmp_path / "attention_bench" / "attention_bench.json").read_text())
    assert rec["shapes"] == [[2, 32]] and rec["reps"] == 3


@pytest.mark.parametrize("shapes", ["foo", "4x4096x2", "0x64", ","])
def test_attention_bench_names_shapes_in_its_error(tmp_path, capsys, shapes):
    line = _refused(capsys, attention_bench.main, ["--shapes", shapes, "--out", str(tmp_path)], "attention_bench")
    assert "--shapes" in line
    assert not (tmp_path / "attention_bench").exists()


# --------------------------------------------------------------------------------------- kernel_bench
@pytest.mark.parametrize("argv, flag", [
    (["--parts", "bench", "--shapes", "foo"], "--shapes"),
    (["--parts", "bench", "--shapes", "2,8192,1"], "--shapes"),
    (["--parts", "stages", "--stages_shapes", "2x8192"], "--stages_shapes"),
    (["--parts", "bench", "--methods", "bogus", "--shapes", "1,64", "--rules", "delta"], "--methods"),
    (["--parts", "bench", "--methods", ",", "--shapes", "1,64", "--rules", "delta"], "--methods"),
    (["--parts", "foo"], "--parts"),
    (["--parts", "bench", "--methods", "cudnn", "--shapes", "1,64", "--reps", "0"], "--reps"),
    (["--parts", "bench", "--methods", "cudnn", "--shapes", "1,64", "--reps", "-5"], "--reps"),
    (["--parts", "bench", "--methods", "cudnn", "--shapes", "1,64", "--pallas_chunk", "0"], "--pallas_chunk"),
    (["--parts", "ab", "--ab", "fuse_output=0", "--ab_modes", ","], "--ab_modes"),
    (["--parts", "bench", "--methods", "cudnn", "--shapes", "1,64", "--budget_s", "-1"], "--budget_s"),
    (["--parts", "bench", "--methods", "cudnn", "--shapes", "1,64", "--budget_s", "nan"], "--budget_s")])
def test_kernel_bench_refuses_bad_options_before_creating_anything(tmp_path, capsys, argv, flag):
    line = _refused(capsys, kernel_bench.main, argv + ["--out", str(tmp_path / "o")], "kernel_bench")
    assert flag in line
    assert not (tmp_path / "o").exists()


def test_kernel_bench_writes_the_common_layout(tmp_path, capsys, monkeypatch):
    """``<out>/kernel_bench/kernel_bench.{json,png}`` with the common provenance (here a bench of cuDNN
    attention alone, which fails on the CPU: an error row, and a figure that says nothing was timed); the
    saved record names its files relative to ``--out``, no machine's folder."""
    monkeypatch.setattr(kernel_bench, "H", 2)
    monkeypatch.setattr(kernel_bench, "D", 16)
    monkeypatch.setattr(kernel_bench, "PALLAS_TUNING", {})
    rec = kernel_bench.main(["--parts", "bench", "--methods", "cudnn", "--shapes", "1,64", "--rules", "delta",
                             "--reps", "1", "--out", str(tmp_path)])
    folder = tmp_path / "kernel_bench"
    saved = json.loads((folder / "kernel_bench.json").read_text())
    assert saved["experiment"] == "kernel_bench" and {"git_commit", "git_dirty", "jax_version"} <= set(saved)
    assert saved["reps"] == 1 and saved["methods"] == ["cudnn"] and rec["files"]["png"].endswith("kernel_bench.png")
    assert (folder / "kernel_bench.png").read_bytes()[:4] == b"\x89PNG"
    assert not (tmp_path / "kernel_bench.json").exists()
    assert saved["files"] == {"json": "kernel_bench/kernel_bench.json", "png": "kernel_bench/kernel_bench.png"}
    assert rec["files"]["json"] == str(folder / "kernel_bench.json")
    assert str(tmp_path) not in (folder / "kernel_bench.json").read_text()


def test_kernel_bench_help_names_the_script_and_its_defaults(capsys):
    with pytest.raises(SystemExit) as exc:
        kernel_bench.main(["--help"])
    assert exc.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert out.startswith("usage: python -m experiments.kernel_bench")
    assert "files go to <out>/kernel_bench/ (default: results)" in out
    assert "pallas,xla,fla,cudnn" in out and "(default: 20)" in out


def test_kernel_bench_profile_runs_all_of_ours_before_any_of_fla(tmp_path, capsys, monkeypatch):
    """``--parts profile --methods pallas,fla`` at two shapes: every jax.profiler trace of ours comes before
    torch's profiler first runs (after it, jax.profiler's tracer cannot subscribe to CUPTI), and each
    (shape, rule, mode, method) gets its record. torch, fla and both profilers are stand-ins here."""
    import sys
    import types

    from experiments import op_profile

    calls = []
    torch = types.SimpleNamespace(cuda=types.SimpleNamespace(is_available=lambda: True))
    monkeypatch.setitem(sys.modules, "torch", torch)
    monkeypatch.setattr(kernel_bench, "H", 2)
    monkeypatch.setattr(kernel_bench, "D", 16)
    monkeypatch.setattr(kernel_bench, "load_fla", lambda: {"delta": None})
    monkeypatch.setattr(kernel_bench, "torch_inputs", lambda x: x)
    monkeypatch.setattr(kernel_bench, "fla_call", lambda fla, rule, mode, tx: (rule, mode, tx["q"].shape[:2]))
    monkeypatch.setattr(kernel_bench, "torch_profile",
                        lambda run: calls.append(("fla", *run)) or {"busy_ms_per_call": 2.0, "top": []})
    monkeypatch.setattr(kernel_bench, "rule_call", lambda fn, mode, x, rule: (lambda: x["q"].shape[:2], ()))
    monkeypatch.setattr(op_profile, "profile", lambda fn, **kw: calls.append(("pallas", fn())) or
                        {"busy_ms_per_call": 1.0, "source": "device streams", "top": []})
    rec = kernel_bench.main(["--parts", "profile", "--methods", "pallas,fla", "--shapes", "1,64;1,32",
                             "--rules", "delta", "--out", str(tmp_path)])
    methods = [c[0] for c in calls]
    assert methods == ["pallas"] * 4 + ["fla"] * 4, calls
    assert set(rec["profile"]) == {f"({b}, {t}) delta {mode} {m}" for b, t in ((1, 64), (1, 32))
                                   for mode in ("fwd", "fwdbwd") for m in ("pallas", "fla")}
    assert (tmp_path / "kernel_bench" / "kernel_bench.png").is_file()


@pytest.fixture
def fla_inputs_fail_once(monkeypatch):
    """Stand-ins for torch and fla (tiny H, D) whose input building fails once, as out of memory would."""
    import sys
    import types

    torch = types.SimpleNamespace(cuda=types.SimpleNamespace(is_available=lambda: True))
    monkeypatch.setitem(sys.modules, "torch", torch)
    monkeypatch.setattr(kernel_bench, "H", 2)
    monkeypatch.setattr(kernel_bench, "D", 16)
    monkeypatch.setattr(kernel_bench, "load_fla", lambda: {"delta": None})
    failures = [RuntimeError("CUDA out of memory")]

    def torch_inputs(x):
        if failures:
            raise failures.pop()
        return x

    monkeypatch.setattr(kernel_bench, "torch_inputs", torch_inputs)


def test_kernel_bench_fla_inputs_failing_once_cost_one_record(tmp_path, capsys, monkeypatch, fla_inputs_fail_once):
    """fla's inputs are built inside each record's try: when building them fails (say, out of memory), that
    (shape, rule, mode) records the error and the next one builds them again and is profiled."""
    from experiments import op_profile

    monkeypatch.setattr(kernel_bench, "fla_call", lambda fla, rule, mode, tx: (rule, mode))
    monkeypatch.setattr(kernel_bench, "torch_profile", lambda run: {"busy_ms_per_call": 2.0, "top": []})
    monkeypatch.setattr(kernel_bench, "rule_call", lambda fn, mode, x, rule: (lambda: None, ()))
    monkeypatch.setattr(op_profile, "profile", lambda fn, **kw: {"busy_ms_per_call": 1.0, "source": "s", "top": []})
    rec = kernel_bench.main(["--parts", "profile", "--methods", "pallas,fla", "--shapes", "1,64",
                             "--rules", "delta", "--out", str(tmp_path)])
    fla = {k: v for k, v in rec["profile"].items() if k.endswith(" fla")}
    assert ["out of memory" in v.get("error", "") for v in fla.values()] == [True, False], fla
    assert [v.get("busy_ms_per_call") for v in fla.values()] == [None, 2.0]


def test_kernel_bench_fla_inputs_failing_once_cost_one_bench_row(monkeypatch, fla_inputs_fail_once):
    """The bench part likewise: fla's inputs failing once leave that row without a time, and the next mode
    builds them again and is timed."""
    monkeypatch.setattr(kernel_bench, "fla_call", lambda fla, rule, mode, tx: (lambda: None))
    monkeypatch.setattr(kernel_bench, "time_torch", lambda run, reps=1: 2.0)
    monkeypatch.setattr(kernel_bench, "time_torch_sync", lambda run, reps=1: 2.5)
    res = {}
    kernel_bench.part_bench(res, [(1, 64)], 1, ["fla"], False, rules=("delta",))
    assert [(r["method"], r["mode"], r["ms"]) for r in res["bench"]] == [("fla", "fwd", None), ("fla", "fwdbwd", 2.0)]


# --------------------------------------------------------------------------------------------- kv_read
def test_kv_read_names_a_bad_dtype(capsys):
    line = _refused(capsys, kv_read.main, ["--dtype", "int8"], "kv_read")
    assert "--dtype" in line


def test_kv_read_quick_keeps_explicit_sizes_and_writes_json_and_png(tmp_path, capsys):
    rows = kv_read.main(["--quick", "--context", "64", "--heads", "2", "--head-dim", "8", "--steps", "1",
                         "--mla-rank", "8", "--mla-rope", "8", "--out", str(tmp_path)])
    rec = json.loads((tmp_path / "kv_read" / "kv_read.json").read_text())
    assert rec["rows"] == rows and rec["quick"] and "git_commit" in rec and "git_dirty" in rec
    assert (rec["args"]["context"], rec["args"]["heads"], rec["args"]["dtype"]) == (64, 2, "float32")
    assert rows[0]["bytes_read"] == 64 * 2 * 2 * 8 * 4  # float32: --quick's dtype, the one option left unset
    assert (tmp_path / "kv_read" / "kv_read.png").read_bytes()[:4] == b"\x89PNG"
    assert "wrote" in capsys.readouterr().out


# ------------------------------------------------------------------------------------ scorecard, mqar
def test_scorecard_merge_refuses_training_options(tmp_path, capsys):
    line = _refused(capsys, scorecard.main, ["--merge", str(tmp_path), "--only", "gpt2", "--out", str(tmp_path)],
                    "scorecard")
    assert "--merge" in line and "got --only" in line


def test_mqar_merge_refuses_training_options(tmp_path, capsys):
    line = _refused(capsys, mqar.main, ["--merge", str(tmp_path), "--quick", "--steps", "3", "--out", str(tmp_path)],
                    "mqar")
    assert "--merge" in line and "got --quick, --steps" in line


# ----------------------------------------------------------------------------------------- help texts
@pytest.mark.parametrize("main, says", [(mqar.main, "gdn_nogate"), (niah.main, "kda_unit_a"),
                                        (ep_scaling.main, "ep_rep"), (ep_scaling.main, "fsdp")])
def test_help_lists_every_accepted_value(capsys, main, says):
    with pytest.raises(SystemExit):
        main(["--help"])
    assert says in capsys.readouterr().out


@pytest.mark.parametrize("main", [scorecard.main, mqar.main, niah.main, ep_scaling.main])
def test_seed_has_help(capsys, main):
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "random seed" in capsys.readouterr().out


# ------------------------------------------------------------------------------------ library modules
@pytest.mark.parametrize("module, used_by", [("op_profile", "train_bench"), ("trainer", "scorecard")])
def test_library_modules_say_what_uses_them(capsys, module, used_by):
    with pytest.raises(SystemExit) as exc, warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # runpy: the module is imported already
        runpy.run_module(f"experiments.{module}", run_name="__main__")
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "library module" in err and used_by in err


def test_architectures_lists_the_command_line_keys(capsys):
    architectures.main([])
    out = capsys.readouterr().out
    assert "gpt2" in out and "KKKM" in out and "gdn_nogate" in out
    with pytest.raises(SystemExit) as exc:
        architectures.main(["--help"])
    assert exc.value.code == 0 and "usage: python -m experiments.architectures" in capsys.readouterr().out
