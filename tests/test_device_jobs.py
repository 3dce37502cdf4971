"""launch/device_jobs.sh: jobs run in order under their limits, and everything comes back in one archive."""

from __future__ import annotations

import os
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "launch" / "device_jobs.sh"


@pytest.mark.skipif(shutil.which("bash") is None or shutil.which("timeout") is None, reason="needs bash and timeout")
def test_device_jobs_runs_each_job_and_archives_partial_results(tmp_path):
    out, results = tmp_path / "out", tmp_path / "res"
    env = dict(os.environ, SKIP_WHEELS="1", OUT=str(out), RESULTS=str(results))
    write = "python3 -c \"import sys, pathlib; d = pathlib.Path(sys.argv[-1]) / 'a'; d.mkdir(); (d / 'a.json').write_text('{}')\""
    proc = subprocess.run(["bash", str(SCRIPT), "60", write, "2", "sleep 30; true"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    summary = (results / "summary.txt").read_text()
    assert "job 1" in summary and "rc=0" in summary
    assert "job 2" in summary and "rc=124" in summary and "cut by its limit" in summary
    with tarfile.open(out / "results.tgz") as tar:
        names = set(tar.getnames())
    assert {"res/a/a.json", "res/logs/job1.log", "res/logs/job2.log", "res/summary.txt"} <= names


@pytest.mark.skipif(shutil.which("bash") is None or shutil.which("timeout") is None, reason="needs bash and timeout")
def test_device_jobs_keeps_a_jobs_own_out(tmp_path):
    """A job that names its own --out (two calls of one experiment kept apart) gets no second one;
    $RESULTS is visible to the job, and its files still come back in the archive."""
    out, results = tmp_path / "out", tmp_path / "res"
    env = dict(os.environ, SKIP_WHEELS="1", OUT=str(out), RESULTS=str(results))
    write = "python3 -c \"import sys, pathlib; d = pathlib.Path(sys.argv[-1]); d.mkdir(); (d / 'b.json').write_text('{}')\""
    proc = subprocess.run(["bash", str(SCRIPT), "60", write + " --out $RESULTS/own"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert (results / "own" / "b.json").is_file()
    assert "--out $RESULTS/own" in (results / "summary.txt").read_text()
    with tarfile.open(out / "results.tgz") as tar:
        assert "res/own/b.json" in tar.getnames()


def test_device_jobs_rejects_an_odd_argument_list(tmp_path):
    proc = subprocess.run(["bash", str(SCRIPT), "60"], cwd=REPO, capture_output=True, text=True,
                          env=dict(os.environ, OUT=str(tmp_path)), timeout=30)
    assert proc.returncode == 2 and "usage" in proc.stderr
