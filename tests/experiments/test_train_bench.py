"""Smoke runs of the training, attention and grouped-matmul benchmarks (tiny sizes on the CPU)."""

import json

import pytest

from experiments import attention_bench, gmm_bench, train_bench


def test_train_bench_quick_runs_and_compares_to_the_reference(tmp_path):
    rec = train_bench.run(quick=True, out=str(tmp_path), rows="reference,softmax", remat="dots", profile=2)
    rows = {r["row"]: r for r in rec["results"]}
    prof = rows["softmax"]["profile"]
    assert prof["calls"] == 2 and prof["busy_ms_per_call"] > 0 and prof["top"]
    assert abs(sum(k["share"] for k in prof["kinds"].values()) - 1) < 1e-6
    assert "busy" in train_bench.table(rec) and "softmax 2x64" in train_bench.table(rec)
    assert rows["reference"]["status"] == rows["softmax"]["status"] == "ok"
    assert rows["softmax"]["vs_reference"] == pytest.approx(rows["softmax"]["tokens_per_s"]
                                                           / rows["reference"]["tokens_per_s"], rel=1e-12)
    assert rows["softmax"]["tokens_per_s"] > 0 and rows["softmax"]["memory_bytes"] > 0
    assert all(l == l for l in rows["softmax"]["losses"])  # finite, not NaN
    saved = json.loads((tmp_path / "train_bench" / "train_bench.json").read_text())
    assert saved["results"][1]["row"] == "softmax" and (tmp_path / "train_bench" / "train_bench.png").stat().st_size
    # --merge joins records of the same size (here the record and a copy with one row, tagged by an
    # earlier merge: its tags stay), in order
    first = tmp_path / "train_bench" / "train_bench.json"
    tagged = [dict(r, git_commit="abc1234", date="2026-01-01") for r in saved["results"][1:]]
    (tmp_path / "b.json").write_text(json.dumps(dict(saved, results=tagged)))
    joined = train_bench.run(out=str(tmp_path / "m"), merge=[str(first), str(tmp_path / "b.json")])
    assert [r["row"] for r in joined["results"]] == ["reference", "softmax", "softmax"]
    assert len(joined["merged_from"]) == 2 and all("git_commit" in r for r in joined["results"])
    assert joined["results"][0]["git_commit"] == saved["git_commit"] and joined["results"][0]["date"] == saved["date"]
    assert joined["results"][2]["git_commit"] == "abc1234" and joined["results"][2]["date"] == "2026-01-01"
    (tmp_path / "c.json").write_text(json.dumps(dict(saved, size=dict(saved["size"], d_model=1))))
    with pytest.raises(ValueError, match="another model size"):
        train_bench.run(out=str(tmp_path / "m2"), merge=[str(first), str(tmp_path / "c.json")])


@pytest.mark.parametrize("kw, match", [(dict(rows="softmax,transformer"), "--rows"), (dict(remat="some"), "--remat"),
                                       (dict(shapes="4by4096"), "--shapes"),
                                       (dict(overrides=["no_such_field=1"]), "no_such_field")])
def test_train_bench_refuses_bad_arguments(tmp_path, kw, match):
    with pytest.raises(ValueError, match=match):
        train_bench.run(quick=True, out=str(tmp_path), **kw)


def test_train_bench_moe_row_has_the_dense_rows_active_parameters():
    size = train_bench.Size()
    dense = train_bench.model_config("hybrid", size, "dots")
    moe = train_bench.model_config("moe", size, "dots")
    from lineage_jax import accounting

    a, b = accounting.param_counts(dense)["active"], accounting.param_counts(moe)["active"]
    assert abs(a - b) / a < 0.03


def test_attention_bench_quick_checks_against_the_reference(tmp_path):
    rec = attention_bench.run(quick=True, out=str(tmp_path), impls="xla", layouts="gqa")
    assert {r["segments"] for r in rec["results"]} == {False, True}
    assert all(r["fwd_bwd_ms"] > 0 for r in rec["results"])
    assert all(c[n] < 2e-2 for c in rec["checks"] for n in ("o", "dq", "dk", "dv"))


def test_gmm_bench_quick_times_every_impl_beside_a_dense_matmul(tmp_path):
    rec = gmm_bench.run(quick=True, out=str(tmp_path))
    assert [r["impl"] for r in rec["results"]] == ["dense", *gmm_bench.IMPLS]
    assert all(r["fwd_bwd_ms"] > 0 and r["vs_dense"] > 0 for r in rec["results"])
    assert {c["impl"] for c in rec["checks"]} == set(gmm_bench.IMPLS)
    assert all(c[n] < 1e-5 for c in rec["checks"] for n in ("y", "dx", "dw"))
    with pytest.raises(ValueError, match="--shapes"):
        gmm_bench.run(out=str(tmp_path), shapes="16x2x4")


def test_op_profile_sums_device_streams_per_call_by_kind():
    """A GPU-shaped Perfetto trace: kernels on the device's streams count (per call, by kind); the
    'XLA Ops' line (the same time, annotated) and host events do not."""
    from experiments import op_profile
    M = lambda pid, tid, what, name: {"ph": "M", "pid": pid, "tid": tid, "name": what, "args": {"name": name}}
    X = lambda pid, tid, name, dur: {"ph": "X", "pid": pid, "tid": tid, "name": name, "dur": dur, "ts": 0}
    trace = {"traceEvents": [
        M(1, 0, "process_name", "/host:CPU"), M(2, 0, "process_name", "/device:GPU:0 (pid 2)"),
        M(2, 7, "thread_name", "Stream #13(Compute)"), M(2, 9, "thread_name", "XLA Ops"),
        X(2, 7, "nvjet_tst_128x64_64x4_1x2_h_bz_TNT", 600.0), X(2, 7, "cudnn_generated_fusion_12", 300.0),
        X(2, 7, "loop_multiply_fusion_3", 80.0), X(2, 7, "delta_state_fwd_triton", 20.0),
        X(2, 7, "intra_bwd_scores", 40.0),  # a Pallas kernel named by its Python function
        X(2, 9, "fusion.12", 999.0), X(1, 0, "PjitFunction(step)", 5000.0)]}
    s = op_profile.summarize(trace, calls=2)
    assert s["source"] == "device streams" and s["busy_ms_per_call"] == 0.52
    assert {k: round(v["ms_per_call"], 3) for k, v in s["kinds"].items()} == {
        "matmul": 0.3, "attention": 0.15, "fusion": 0.04, "pallas": 0.03}
    assert s["top"][0]["kind"] == "matmul" and s["top"][0]["launches_per_call"] == 0.5


def test_op_profile_names_what_each_fusion_computes():
    """With the executable's HLO, the profile's fusions name the JAX operations and the source lines they
    fused: on the CPU end to end (the trace names a fusion as its HLO instruction), and on an XLA:GPU-style
    module, whose kernels are named ``loop_select_fusion_77`` for the instruction ``loop_select_fusion.77``."""
    import inspect

    import jax
    import jax.numpy as jnp
    from experiments import op_profile

    def f(x, idx):
        y = jnp.take(x, idx, axis=0, mode="fill")
        return jnp.where(y > 0, y * 2.0, 0.0)
    line = inspect.getsourcelines(f)[1]
    x, idx = jnp.ones((512, 64)), jnp.arange(1024) % 520
    compiled = jax.jit(f).lower(x, idx).compile()
    s = op_profile.profile(lambda: compiled(x, idx), 2, 5, hlo=compiled.as_text())
    fused = [t for t in s["top"] if t.get("source")]
    assert fused, s["top"]
    src = fused[0]["source"]
    assert src["ops"][0].endswith("select_n") and any(o.endswith("gather") for o in src["ops"]), src
    assert set(src["at"]) == {f"tests/experiments/test_train_bench.py:{line + n}" for n in (1, 2)}, src

    gpu = """HloModule jit_step

%fused_computation.77 (param_0: bf16[8,4], param_1: s32[16]) -> bf16[16,4] {
  %param_0 = bf16[8,4]{1,0} parameter(0)
  %param_1 = s32[16]{0} parameter(1)
  %constant.1 = s32[] constant(0), metadata={op_name="jit(step)/jit(_take)" source_file="/x/lineage_jax/layers/grouped_pallas.py" source_line=502}
  %gather.3 = bf16[16,4]{1,0} gather(%param_0, %param_1), metadata={op_name="jit(step)/jvp(MoE)/jit(_take)/gather" source_file="/x/lineage_jax/layers/grouped_pallas.py" source_line=502}
  ROOT %select.2 = bf16[16,4]{1,0} select(%gather.3, %gather.3, %gather.3), metadata={op_name="jit(step)/jvp(MoE)/select_n" source_file="/x/lineage_jax/layers/grouped_pallas.py" source_line=503}
}

ENTRY %main (p0: bf16[8,4], p1: s32[16]) -> bf16[16,4] {
  %p0 = bf16[8,4]{1,0} parameter(0)
  %p1 = s32[16]{0} parameter(1)
  ROOT %loop_select_fusion.77 = bf16[16,4]{1,0} fusion(%p0, %p1), kind=kLoop, calls=%fused_computation.77
}
"""
    assert op_profile.hlo_sources(gpu) == {"loop_select_fusion_77": {
        "ops": ["jvp(MoE)/select_n", "jit(_take)/gather"],
        "at": ["lineage_jax/layers/grouped_pallas.py:503", "lineage_jax/layers/grouped_pallas.py:502"]}}
    trace = {"traceEvents": [{"ph": "M", "pid": 2, "tid": 0, "name": "process_name", "args": {"name": "/device:GPU:0"}},
                             {"ph": "X", "pid": 2, "tid": 0, "name": "loop_select_fusion_77", "dur": 10.0, "ts": 0}]}
    top = op_profile.summarize(trace, 1, hlo=gpu)["top"][0]
    assert top["source"]["ops"][0] == "jvp(MoE)/select_n"
    assert "jvp(MoE)/select_n" in op_profile.table(op_profile.summarize(trace, 1, hlo=gpu))


def test_op_profile_names_every_delta_kernel_pallas():
    """Every kernel of ``kernels.delta`` (named after its Python function on GPUs) counts as Pallas."""
    import inspect
    from experiments import op_profile
    from kernels.delta import kernels as kn
    names = [n for n, f in inspect.getmembers(kn, inspect.isfunction)
             if f.__module__ == kn.__name__ and n.startswith(("intra_", "state_fwd", "state_bwd"))]
    assert "intra_fwd_fixup" in names and "intra_bwd_scores" in names
    assert {n: op_profile.kind_of(n) for n in names} == {n: "pallas" for n in names}
