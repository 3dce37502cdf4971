"""The device benchmark's parts run end to end on the CPU (Pallas interpret mode, tiny sizes).

The benchmark times GPU kernels; these tests call the same code paths on the CPU so that a
broken part (a stale call into the kernels' internals, say) fails here, not on the GPU.
"""

import os

import pytest

from experiments import kernel_bench as kb


@pytest.fixture
def tiny(monkeypatch):
    monkeypatch.setattr(kb, "H", 2)
    monkeypatch.setattr(kb, "D", 16)
    orig = kb.time_jax
    monkeypatch.setattr(kb, "time_jax", lambda f, *a, reps=1, warmup=0, rounds=1: orig(f, *a, reps=1, warmup=0,
                                                                                     rounds=1))


@pytest.mark.slow  # the script's per-kernel timing loop; the kernels' values are test_check_... and tests/kernels
@pytest.mark.parametrize("split", [1, 2])
def test_stages_times_every_kernel(tiny, monkeypatch, split):
    """Every kernel timed alone; with ``state_split=2`` the state passes as the split rule runs them."""
    monkeypatch.setitem(kb.PALLAS_TUNING, "state_split", split)
    res = {}
    kb.part_stages(res, B=1, T=64, rules=("delta", "gdn", "kdab"), chunk_size=32)
    assert set(res["stages"]) == {"delta/warps4", "gdn/warps4", "kdab/warps4"}
    for name, r in res["stages"].items():
        assert "error" not in r, (name, r)
        assert set(r) == {"intra_fwd", "state_fwd", "output", "state_fwd_output", "state_fwd_output_no_h",
                          "state_bwd", "intra_bwd"}
        assert all(t > 0 for t in r.values())


def test_check_compares_pallas_with_xla(tiny, monkeypatch):
    res = {}
    assert kb.part_check(res, rules=("gdn",), chunk_size=32)  # (the kernels' own tests cover every rule)
    assert set(res["check"]) == {"gdn/float32", "gdn/bfloat16"}
    # gradients of the inputs GDN reads only, named by input (not the per-channel gate g)
    assert {"o", "dq", "dk", "dv", "dgs", "dbeta"} <= set(res["check"]["gdn/float32"])
    assert "dg" not in res["check"]["gdn/float32"]
    for dtype, tol in (("float32", 1e-4), ("bfloat16", 2e-2)):  # every recorded error, within the kernel tests'
        errors = {k: v for k, v in res["check"][f"gdn/{dtype}"].items() if isinstance(v, float)}
        assert errors and all(0 <= e < tol for e in errors.values()), (dtype, errors)


@pytest.mark.parametrize("rule", ["delta", "gdn", "kda"])
def test_fwdbwd_call_differentiates_the_rules_inputs_only(tiny, rule):
    """The timed fwd+bwd call returns one gradient per input the rule reads (as fla's call computes),
    equal to the full vjp's gradients at those positions."""
    import numpy as np
    x = kb.make_inputs(1, 32)
    f, args = kb.rule_call(kb.rule_fn(rule, "xla"), "fwdbwd", x, rule)
    o, S, grads = f(*args)
    assert len(grads) == len(kb.RULE_ARGS[rule])
    _, _, full = kb.jax_fwdbwd(kb.rule_fn(rule, "xla"))(*args)
    for i, gr in zip(kb.RULE_ARGS[rule], grads):
        np.testing.assert_allclose(np.asarray(gr, np.float32), np.asarray(full[i], np.float32), rtol=0, atol=0)
    unread = set(range(6)) - set(kb.RULE_ARGS[rule])
    assert all(float(np.max(np.abs(np.asarray(full[i], np.float32)))) == 0 for i in unread)


@pytest.mark.parametrize("tuning, message", [("anchored_bwd=all", "anchored_bwd must be one of"),
                                             ("anchored_fwd=both", "anchored_fwd must be one of"),
                                             ("qk_arrays=yes", "qk_arrays must be 0 or 1"),
                                             ("state_pairs=2", "state_pairs must be 0 or 1"),
                                             ("chunk_size=x", "chunk_size must be an integer"),
                                             ("bv=x", "bv must be an integer"), ("bv", "knob=value"),
                                             ("warps=8", "unknown knob"),
                                             ("state_split=half", "state_split must be an integer")])
def test_bad_tuning_flags_are_named(tuning, message, capsys):
    with pytest.raises(SystemExit):
        kb.main(["--pallas_tuning", tuning, "--out", "unused"])
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("scale", ["0", "-1", "nan", "inf"])
def test_bad_ab_gate_scale_is_named(scale, capsys):
    with pytest.raises(SystemExit):
        kb.main(["--parts", "ab", "--ab", "bv=64", "--ab_gate_scale", scale, "--out", "unused"])
    assert "--ab_gate_scale must be > 0" in capsys.readouterr().err


def test_fla_cache_points_triton_at_the_directory(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", "unset")  # restored after the test
    monkeypatch.setenv("TRITON_CACHE_AUTOTUNING", "0")
    d = tmp_path / "fla"
    kb.use_fla_cache(str(d))
    import os
    assert d.is_dir() and os.environ["TRITON_CACHE_DIR"] == str(d)
    assert os.environ["TRITON_CACHE_AUTOTUNING"] == "1"


def test_ab_times_both_sides_in_alternating_rounds(tiny, monkeypatch):
    """``--parts ab``: A (``--pallas_tuning``) and B (A with the ``--ab`` knobs) each compiled once and
    timed in ``AB_ROUNDS`` alternating rounds; the row keeps both sides' launch knobs and each round."""
    monkeypatch.setattr(kb, "AB_ROUNDS", 2)
    monkeypatch.setattr(kb, "PALLAS_TUNING", {"inverse": "loop"})
    res = {}
    kb.part_ab(res, [(1, 64)], 1, {"fuse_output": False}, rules=("delta",), chunk_size=32)
    assert [(r["rule"], r["mode"]) for r in res["ab"]] == [("delta", "fwdbwd"), ("delta", "fwd")]
    for r in res["ab"]:
        assert r["a"] == {"inverse": "loop"} and r["b"] == {"inverse": "loop", "fuse_output": False}
        assert len(r["a_ms"]) == len(r["b_ms"]) == 2 and all(t > 0 for t in r["a_ms"] + r["b_ms"])
        lo, hi = r["b_over_a_range"]
        assert lo <= r["b_over_a"] <= hi
    assert kb.ab_table(res).count("| (1, 64) | delta |") == 2
    res = {}  # --ab_modes: the forward alone (the compiled forwards are cached)
    kb.part_ab(res, [(1, 64)], 1, {"fuse_output": False}, rules=("delta",), chunk_size=32, modes=("fwd",))
    assert [(r["rule"], r["mode"]) for r in res["ab"]] == [("delta", "fwd")]
    res = {}  # --ab_dtype f32: the f32 inputs reach the kernels, and the row says so
    seen = []
    orig = kb.rule_call
    monkeypatch.setattr(kb, "rule_call", lambda f, mode, x, rule: seen.append(x["q"].dtype) or orig(f, mode, x, rule))
    kb.part_ab(res, [(1, 64)], 1, {"fuse_output": False}, rules=("delta",), chunk_size=32, modes=("fwd",),
               dtype="f32")
    assert [r["dtype"] for r in res["ab"]] == ["f32"] and set(seen) == {kb.jnp.dtype("float32")}


def test_ab_records_a_failing_pair_and_times_the_rest(tiny, monkeypatch):
    """A launch that fails on one side (here B's chunk size, which the kernels refuse) leaves a row naming the
    side and the error; the next pair is still timed, and the table and the figure take both rows."""
    monkeypatch.setattr(kb, "AB_ROUNDS", 2)
    res = {"parts": ["ab"], "ab_knobs": {"chunk_size": 24}}
    kb.part_ab(res, [(1, 64)], 1, {"chunk_size": 24}, rules=("delta",), chunk_size=32, modes=("fwd",))
    kb.part_ab(res, [(1, 64)], 1, {"inverse": "loop"}, rules=("delta",), chunk_size=32, modes=("fwd",))
    failed, timed = res["ab"]
    assert failed["error"].startswith("B: ") and "chunk_size" in failed["error"] and "b_over_a" not in failed
    assert timed["b_over_a"] > 0 and "error" not in timed
    assert "failed: B: " in kb.ab_table(res) and kb.ab_table(res).count("| (1, 64) | delta | fwd |") == 2
    kb.plot(res)


def test_ab_ref_runs_another_checkouts_kernels_as_a(tiny, monkeypatch, tmp_path, capsys):
    """``--ab_ref DIR``: A runs the kernel package copied to DIR (imported beside this tree's), B this
    tree's; a missing package is an error naming the flag."""
    import shutil
    from kernels import delta
    ref = tmp_path / "delta"
    shutil.copytree(os.path.dirname(delta.__file__), ref, ignore=shutil.ignore_patterns("__pycache__"))
    mod = kb.load_kernels(str(ref))
    assert mod.api is not delta.api and mod.api.__file__.startswith(str(ref))
    calls = []
    orig = mod.chunk_delta_rule
    monkeypatch.setattr(mod, "chunk_delta_rule", lambda *a, **k: calls.append(1) or orig(*a, **k))
    monkeypatch.setattr(kb, "AB_ROUNDS", 2)
    res = {}
    kb.part_ab(res, [(1, 64)], 1, {}, rules=("delta",), chunk_size=32, modes=("fwd",), ref=mod)
    assert calls and [r["a_ref"] for r in res["ab"]] == [True]
    with pytest.raises(SystemExit):
        kb.main(["--parts", "ab", "--ab_ref", str(tmp_path / "nothing"), "--out", str(tmp_path / "o")])
    assert "--ab_ref: no kernel package" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [(["--parts", "ab"], "--parts ab needs --ab"),
                                           (["--parts", "ab", "--ab", "inverse=neumann"], "--ab: inverse must be"),
                                           (["--ab", "fuse_output=2"], "--ab: fuse_output must be 0 or 1"),
                                           (["--ab_modes", "bwd"], "--ab_modes: unknown mode 'bwd'"),
                                           (["--ab_dtype", "fp8"], "--ab_dtype: invalid choice: 'fp8'"),
                                           (["--profile_dtype", "f16"], "--profile_dtype: invalid choice: 'f16'")])
def test_bad_ab_flags_are_named(argv, message, capsys):
    with pytest.raises(SystemExit):
        kb.main(argv + ["--out", "unused"])
    assert message in capsys.readouterr().err


def test_profile_lists_the_kernels_of_one_call(tiny, monkeypatch):
    """``--parts profile``: ours read from the profiler's trace per (shape, rule, mode), busy time the
    sum of its operations; fla's beside them where torch has a GPU and fla imports, else skipped."""
    monkeypatch.setattr(kb, "PROFILE_CALLS", 1)
    monkeypatch.setattr(kb, "PALLAS_TUNING", {"inverse": "loop"})
    try:
        import torch
        methods = ("pallas", "fla") if torch.cuda.is_available() and kb.load_fla() is not None else ("pallas",)
    except ImportError:
        methods = ("pallas",)
    res = {}
    kb.part_profile(res, [(1, 64)], rules=("delta",), methods=("pallas", "fla"), chunk_size=32)
    assert set(res["profile"]) == {f"(1, 64) delta {mode} {m}" for mode in ("fwd", "fwdbwd") for m in methods}
    for r in res["profile"].values():
        assert "error" not in r, r
        assert r["top"] and r["busy_ms_per_call"] >= sum(t["ms_per_call"] for t in r["top"]) * (1 - 1e-9)
        assert all(t["ms_per_call"] >= 0 and t["launches_per_call"] > 0 for t in r["top"])
    assert "(1, 64) delta fwd pallas: busy" in kb.profile_table(res, "(1, 64) delta fwd")
    res, seen = {}, []  # --profile_dtype f32: f32 inputs reach the kernels, and the keys say so
    orig = kb.rule_call
    monkeypatch.setattr(kb, "rule_call", lambda f, mode, x, rule: seen.append(x["q"].dtype) or orig(f, mode, x, rule))
    kb.part_profile(res, [(1, 64)], rules=("delta",), methods=("pallas",), chunk_size=32, dtype="f32")
    assert set(res["profile"]) == {"(1, 64) delta fwd f32 pallas", "(1, 64) delta fwdbwd f32 pallas"}
    assert all("error" not in r for r in res["profile"].values()) and set(seen) == {kb.jnp.dtype("float32")}


def test_bench_times_steady_state_and_synchronized_calls(tiny, monkeypatch):
    """``--parts bench`` (ours only: no GPU here): every row has the steady-state time and the
    synchronized-call time, and the table shows both."""
    monkeypatch.setattr(kb, "time_jax_sync", lambda f, *a, reps=1, warmup=0: kb.C.timed_calls(f, a, 1)[0] * 1e3)
    monkeypatch.setattr(kb, "PALLAS_TUNING", {"inverse": "loop"})
    res = {}
    kb.part_bench(res, [(1, 64)], 1, ["pallas"], True, rules=("delta",), chunk_size=32)
    rows = res["bench"]
    assert [(r["method"], r["mode"]) for r in rows] == [("pallas", "fwdbwd"), ("pallas", "fwd")]
    assert all(r["ms"] > 0 and r["ms_sync"] > 0 for r in rows)
    table = kb.summarize(res)
    assert "synchronized calls" in table and "| (1, 64) | delta | fwd |" in table


def test_plot_says_which_bench_mode_timed_nothing():
    """A bench mode whose every row failed (``ms`` None) gets a panel that says so, not an empty legend
    (matplotlib warns on a legend without labels)."""
    import warnings
    row = dict(B=1, T=64, rule="delta", method="pallas", flops=1.0, bytes=1.0, ms_sync=None)
    res = {"parts": ["bench"], "bench": [dict(row, mode="fwd", ms=0.5), dict(row, mode="fwdbwd", ms=None)]}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fig = kb.plot(res)
    texts = [t.get_text() for ax in fig.axes for t in ax.texts]
    assert "no fwdbwd row timed" in texts and "no fwd row timed" not in texts


def test_ab_knobs_may_set_the_chunk_size(monkeypatch):
    """``--ab chunk_size=64,...`` pairs 64-token chunks against the default: a ``chunk_size`` knob
    overrides ``--pallas_chunk`` in the call the rule's function makes."""
    import argparse

    knobs = kb.parse_tuning(argparse.ArgumentParser(), "--ab", "chunk_size=64,num_warps_fwd=8,state_pairs=1")
    assert knobs == {"chunk_size": 64, "num_warps_fwd": 8, "state_pairs": True}
    seen = {}

    class FakeKernels:
        @staticmethod
        def chunk_delta_rule(q, k, v, beta, **kw):
            seen.update(kw)

    kb.rule_fn("delta", "pallas", chunk_size=32, tuning=knobs, kd=FakeKernels)(1, 2, 3, None, None, 4)
    assert seen["chunk_size"] == 64 and seen["state_pairs"] is True


def test_intra_knob_is_parsed_and_checked():
    """``--pallas_tuning intra=...`` / ``--ab intra=...`` take the kernels' forms by name (and ``state_dot=...``
    its two forms); another value is an argparse error naming the flag."""
    import argparse

    assert kb.parse_tuning(argparse.ArgumentParser(), "--ab", "intra=whole") == {"intra": "whole"}
    assert kb.parse_tuning(argparse.ArgumentParser(), "--pallas_tuning", "intra=tiles") == {"intra": "tiles"}
    with pytest.raises(SystemExit):
        kb.parse_tuning(argparse.ArgumentParser(), "--ab", "intra=rows")
    assert kb.parse_tuning(argparse.ArgumentParser(), "--ab", "state_dot=tensor") == {"state_dot": "tensor"}
    with pytest.raises(SystemExit):
        kb.parse_tuning(argparse.ArgumentParser(), "--ab", "state_dot=trace")


def test_transposed_state_knob_takes_passes(capsys):
    """``--ab transposed_state=...``: 0 / 1 (every pass), ``none``, or passes joined by ``+``; an unknown
    pass is an argparse error naming the flag and the passes."""
    import argparse

    parse = lambda text: kb.parse_tuning(argparse.ArgumentParser(), "--ab", text)  # noqa: E731
    assert parse("transposed_state=1") == {"transposed_state": True}
    assert parse("transposed_state=0") == {"transposed_state": False}
    assert parse("transposed_state=fwd+bwd") == {"transposed_state": ("fwd", "bwd")}
    assert parse("transposed_state=none") == {"transposed_state": ()}
    with pytest.raises(SystemExit):
        parse("transposed_state=fwd+sideways")
    assert "--ab: transposed_state" in capsys.readouterr().err


def test_mosaic_part_times_the_triton_backward_pass(monkeypatch):
    """``--parts mosaic``: the Triton column's backward is the Triton pass at every shape, not the
    default lowering (``state_bwd="auto"`` picks the Mosaic GPU pass at 256 programs or more)."""
    import jax.numpy as jnp

    from kernels.delta import api
    from kernels.delta import mosaic_gpu as mg

    seen = []
    out = lambda *a, **k: (jnp.ones(3), jnp.ones(3), jnp.ones(3))  # noqa: E731
    monkeypatch.setattr(mg, "state_fwd", out)
    monkeypatch.setattr(mg, "state_bwd", out)
    monkeypatch.setattr(api, "_state_fwd", lambda s, *a, **k: out())
    monkeypatch.setattr(api, "_state_bwd", lambda s, *a, **k: (seen.append(s.state_bwd), out())[1])
    monkeypatch.setattr(kb, "time_jax", lambda f, *a, **k: 1.0)
    monkeypatch.setattr(api, "default_state_bwd", lambda *a, **k: "mosaic")  # as on a Hopper GPU at 256 programs
    results = {}
    kb.part_mosaic(results, [(8, 2048)], reps=1)
    assert seen == ["triton"], (seen, results)
    assert results["mosaic"]["8x2048"]["bwd_rel_diff"] == [0.0, 0.0, 0.0]
