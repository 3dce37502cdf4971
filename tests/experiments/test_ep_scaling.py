"""experiments/ep_scaling.py end to end on 4 fake CPU devices, and its argument errors.

The sweep runs in a fresh subprocess (``XLA_FLAGS=--xla_force_host_platform_device_count=4``
must be set before JAX creates its CPU backend, which this pytest process already did),
like ``tests/parallel/test_multi_device.py``. Checked: every run trains, the data-parallel
and expert-parallel runs' per-step losses equal the one-device run's to float32 rounding
(a sharding or dispatch bug moves them by far more than 1e-4), the all-to-all program's
round trip is exact, expert parallelism really cuts the per-device memory, and the JSON /
PNG are written.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from experiments import ep_scaling as EPS
from tests._fake_devices import fake_device_xla_flags

ROOT = Path(__file__).resolve().parents[2]


def _env(devices: int) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env["XLA_FLAGS"] = fake_device_xla_flags(devices, env.get("XLA_FLAGS", ""))  # as tests/parallel
    return env


# The end-to-end run (1, 2 and 4 fake devices x four layouts, ~2 minutes on 2 cores) is marked slow:
# the layouts' equality with one device is the default suite's tests/parallel; here the default
# suite keeps the argument checks.
@pytest.fixture(scope="module")
def record(tmp_path_factory):
    out = tmp_path_factory.mktemp("results")
    proc = subprocess.run([sys.executable, "-m", "experiments.ep_scaling", "--quick", "--gpus", "1,2,4",
                           "--layouts", "dp,ep,ep_rep,fsdp", "--steps", "4", "--warmup", "1", "--a2a-reps", "2", "--out", str(out)],
                          cwd=ROOT, env=_env(4), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"exit {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    js = out / EPS.NAME / f"{EPS.NAME}.json"
    rec = json.loads(js.read_text())
    rec["_stdout"], rec["_out"] = proc.stdout, out
    return rec


@pytest.mark.slow
def test_every_run_trains_and_matches_one_device(record):
    rows = {(r["n"], r["layout"]): r for r in record["rows"]}
    assert set(rows) == {(1, "1 device"), *((n, lay) for n in (2, 4) for lay in ("dp", "ep", "ep_rep", "fsdp"))}
    assert record["activation_dtype"] == "float32" and record["tolerance"] == 1e-4
    steps = record["budget"]["steps"]
    base = rows[(1, "1 device")]["losses"]
    for key, r in rows.items():
        assert r["status"] == "ok", (key, r.get("note"))
        assert len(r["losses"]) == steps and all(math.isfinite(v) for v in r["losses"]), key
        assert r["losses"][-1] < r["losses"][0], (key, r["losses"])          # it trains
        assert r["max_abs_dloss"] <= 1e-4 and r["max_abs_dloss_all"] <= 1e-4 and r["loss_ok"], (key, r["losses"], base)
        assert r["tokens_dropped"] == 0, key                                   # dropless
        for v in (r["step_ms"], r["tokens_per_s_per_device"], r["compile_s"]):
            assert v is not None and v > 0, key
        assert r["xla_bytes_per_device"] > 0, key
        assert r["measured_peak_bytes_per_device"] is None                     # CPU: no allocator stats
    for n in (2, 4):
        ep, dp = rows[(n, "ep")], rows[(n, "dp")]
        assert ep["expert_parallel"] and ep["impl"] == "dense" and not dp["expert_parallel"]
        assert ep["collectives_in_step"]["all_to_all"] > 0 and dp["collectives_in_step"]["all_to_all"] == 0
        assert 0 < ep["a2a_share"] < 1 and dp["a2a_share"] is None
        rep = rows[(n, "ep_rep")]                   # experts split, dense weights replicated
        assert rep["expert_parallel"] and rep["mesh"] == f"expert={n}" and 0 < rep["a2a_share"] < 1
        assert rep["xla_bytes_per_device"] < dp["xla_bytes_per_device"]
        # without the FSDP split of the dense weights GSPMD needs far fewer collectives (CPU: 13 vs 196)
        assert sum(rep["collectives_in_step"].values()) < sum(ep["collectives_in_step"].values()) / 4
        fsdp = rows[(n, "fsdp")]
        assert fsdp["mesh"] == f"fsdp={n}" and not fsdp["expert_parallel"] and fsdp["a2a_share"] is None
        assert fsdp["xla_bytes_per_device"] < dp["xla_bytes_per_device"]     # weights and AdamW state split
        ex = ep["exchange"]
        assert ex["roundtrip_ok"] and ex["tokens_per_device"] == 8 * 64 // n and ex["experts_per_device"] == 8 // n
        assert ex["collectives"]["all_to_all"] >= 5                            # 3 forward + 2 backward (+ ids)
        # Experts (and the dense weights' width) split over the expert axis: less memory per device.
        assert ep["xla_bytes_per_device"] < dp["xla_bytes_per_device"] < rows[(1, "1 device")]["xla_bytes_per_device"]
    assert rows[(4, "ep")]["xla_bytes_per_device"] < rows[(2, "ep")]["xla_bytes_per_device"]


@pytest.mark.slow
def test_files_and_table(record):
    png = record["_out"] / record["files"]["png"]  # the saved record names its files relative to --out
    assert record["files"]["png"] == f"{EPS.NAME}/{EPS.NAME}.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    for key in ("date", "git_commit", "jax_version", "device", "model", "methods", "budget"):
        assert key in record
    assert record["device"]["count"] == 4 and record["model"]["params_total"] > 0
    assert record["data_source"].startswith("stdlib bytes")
    out = record["_stdout"]
    assert "tok/s/dev" in out and "a2a share" in out and "expert=4" in out and "EXCEEDS" not in out
    assert out.rstrip().splitlines()[-1].startswith("wrote ")


@pytest.mark.parametrize("kwargs, needle", [
    (dict(warmup=6), "--warmup"),
    (dict(top_k=9), "--top-k"),
    (dict(d_model=72), "--d-model"),
    (dict(dtype="float16"), "--dtype"),
    (dict(gpus=[2]), "--gpus"),                 # this process has one CPU device
    (dict(gpus=[]), "--gpus"),
    (dict(layouts=["tp"]), "--layouts"),
    (dict(impl="nccl"), "--impl"),
    (dict(memory_backend="triton"), "--memory-backend"),
])
def test_bad_arguments_name_the_flag(tmp_path, kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        EPS.run(quick=True, out=str(tmp_path), **kwargs)


def test_one_device_says_how_to_get_more(tmp_path, capsys):
    """On one device only the baseline can run: the script says so and how to fake 4 CPU devices."""
    with pytest.raises(ValueError, match="--layouts"):  # stops right after the note, before any work
        EPS.run(quick=True, out=str(tmp_path), layouts=["tp"])
    assert "xla_force_host_platform_device_count=4" in capsys.readouterr().err


def test_divisibility_errors(monkeypatch):
    """Checked before any work, as if 4 devices were present."""
    import jax

    monkeypatch.setattr(jax, "device_count", lambda: 4)
    with pytest.raises(ValueError, match="--experts=6 is not divisible by the expert axis 4"):
        EPS.planned_runs([1, 4], ["dp", "ep"], EPS.make_budget(True, experts=6))
    with pytest.raises(ValueError, match="--batch=6"):
        EPS.planned_runs([1, 4], ["dp"], EPS.make_budget(True, batch=6))
    runs = EPS.planned_runs([4, 1, 2], ["dp", "ep", "dp2ep"], EPS.make_budget(True))
    assert [(r["n"], r["mesh"]) for r in runs] == [(1, "-"), (2, "data=2"), (2, "expert=2"), (4, "data=4"),
                                                   (4, "expert=4"), (4, "data=2,expert=2")]
    assert [r["mesh"] for r in EPS.planned_runs([2], ["fsdp"], EPS.make_budget(True))] == ["fsdp=2"]


@pytest.mark.slow  # the model-level equality is tests/layers/test_models.py::test_pallas_memory_backend_*
def test_pallas_memory_backend_trains_the_same_losses(tmp_path):
    """``--memory-backend pallas`` (the kernels.delta kernels, interpret mode here) trains the
    same 1-device losses as the XLA chunked form."""
    runs = {mb: EPS.run(quick=True, out=str(tmp_path / mb), gpus=[1], memory_backend=mb)["rows"][0]
            for mb in ("xla", "pallas")}
    assert runs["pallas"]["status"] == runs["xla"]["status"] == "ok"
    for a, b in zip(runs["xla"]["losses"], runs["pallas"]["losses"], strict=True):
        assert abs(a - b) <= 1e-4 * max(1.0, abs(a))
