"""launch/tpu_vm.sh and launch/multi_gpu.sh: argument handling, and what a failed run leaves behind
(with a stand-in ``gcloud`` that logs its calls); launch/device_jobs.sh's limits checked up front."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LAUNCH = REPO / "launch"
needs_bash = pytest.mark.skipif(shutil.which("bash") is None or shutil.which("timeout") is None,
                                reason="needs bash and timeout")


def _tpu_vm(tmp_path, *args, fail_train=False):
    """Run tpu_vm.sh with a fake gcloud first on PATH; returns (process, the gcloud calls in order)."""
    bin_dir, log = tmp_path / "bin", tmp_path / "gcloud.log"
    bin_dir.mkdir()
    fake = bin_dir / "gcloud"
    fake.write_text('#!/usr/bin/env bash\necho "$*" >> "$GCLOUD_LOG"\n'
                    'if [[ "$*" == *lineage_jax.train* && -n "${FAIL_TRAIN:-}" ]]; then exit 1; fi\n')
    fake.chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", GCLOUD_LOG=str(log),
               ZONE="us-east5-a", TPU_NAME="t", FETCH_DIR=str(tmp_path / "fetched"))
    env.pop("FAIL_TRAIN", None)
    if fail_train:
        env["FAIL_TRAIN"] = "1"
    proc = subprocess.run(["bash", str(LAUNCH / "tpu_vm.sh"), *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    return proc, log.read_text().splitlines() if log.exists() else []


@needs_bash
def test_tpu_vm_fetches_the_workdir_before_deleting_even_when_the_run_fails(tmp_path):
    proc, calls = _tpu_vm(tmp_path, "all", "--", "--config", "tiny_k3", "--workdir", "ckpt/k3", fail_train=True)
    assert proc.returncode == 1, proc.stderr
    kinds = [c.split()[3] for c in calls]  # compute tpus tpu-vm <kind> ...
    assert kinds[0] == "create" and kinds[-1] == "delete"
    fetches = [c for c in calls if "scp --recurse" in c]
    assert len(fetches) == 1 and f"t:lineage_jax/ckpt/k3 {tmp_path / 'fetched'}/ " in fetches[0]
    assert calls.index(fetches[0]) < len(calls) - 1  # before the delete


@needs_bash
def test_tpu_vm_fetch_takes_the_workdir_in_either_spelling(tmp_path):
    proc, calls = _tpu_vm(tmp_path, "all", "--", "--config", "tiny_k3", "--workdir=/data/run1")
    assert proc.returncode == 0, proc.stderr
    assert any("scp --recurse t:/data/run1 " in c for c in calls)
    (tmp_path / "gcloud.log").unlink()
    shutil.rmtree(tmp_path / "bin")
    proc, calls = _tpu_vm(tmp_path, "fetch")
    assert proc.returncode == 0 and any("scp --recurse t:lineage_jax/runs " in c for c in calls)


def _multi_gpu(*args):
    return subprocess.run(["bash", str(LAUNCH / "multi_gpu.sh"), *args], cwd=REPO, capture_output=True,
                          text=True, timeout=60)


@needs_bash
@pytest.mark.parametrize("args,message", [
    (["--nodes", "08", "--node-rank", "1"], "--coordinator HOST:PORT is required"),  # 08 read as 8, not octal
    (["--nodes", "09", "--node-rank", "09"], "--node-rank 9 must be < --nodes 9"),
    (["--nodes", "0", "--node-rank", "0"], "--nodes must be at least 1, got 0"),
    (["--nodes", "2x"], "--nodes and --node-rank must be integers"),
])
def test_multi_gpu_reads_node_numbers_as_decimal(args, message):
    proc = _multi_gpu(*args, "--", "--config", "tiny_kda")
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert "value too great for base" not in proc.stderr


@needs_bash
def test_device_jobs_checks_every_limit_before_the_first_job(tmp_path):
    marker = tmp_path / "ran"
    env = dict(os.environ, SKIP_WHEELS="1", OUT=str(tmp_path / "out"), RESULTS=str(tmp_path / "res"))
    proc = subprocess.run(["bash", str(LAUNCH / "device_jobs.sh"), "10", f"touch {marker}", "abc", "true"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "job 2: SECONDS must be a duration" in proc.stderr and "'abc'" in proc.stderr
    assert not marker.exists()
