"""The training CLI over two processes (``jax.distributed`` on the CPU, gloo collectives), two fake
devices each: the multi-node path of a GPU cluster or a multi-host TPU run, on one machine.

``--mesh fsdp=2 --mesh-dcn data=2``: the data axis spans the two processes. A SIGTERM to one of them
stops both at the same logged step, saved; the same command resumes them, and the run logs what one
process with four devices logs for the same global mesh, once a step; a resume by one process is
refused by name (each process reads its own shard of the data, and the checkpoint holds the iterator
state of each)."""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

from tests._fake_devices import fake_device_xla_flags

STEPS = 30
ARGS = ["--set", "batch_size=4", "--set", "seq_len=32", "--set", "progress=false", "--set", "log_every=2",
        "--set", "eval_batches=1", "--set", f"save_every={STEPS}"]
TIMEOUT = 300


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(devices: int, **extra) -> dict:
    """This process's environment (the suite's compilation cache and fast-compile flags included) for a CLI run on
    ``devices`` fake CPU devices; ``extra`` sets the distributed variables."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "JAX_COORDINATOR_ADDRESS", "JAX_PLATFORMS")}
    env.update(XLA_FLAGS=fake_device_xla_flags(devices, os.environ.get("XLA_FLAGS", "")), JAX_PLATFORMS="cpu", **extra)
    return env


def _start_processes(args, n: int = 2, devices: int = 2) -> list:
    """The CLI in ``n`` processes of ``devices`` CPU devices each (``jax.distributed`` from the environment);
    ``args`` a list, or a function of the process index giving each its own."""
    port = _free_port()
    procs = []
    for i in range(n):
        env = _env(devices, JAX_NUM_PROCESSES=str(n), JAX_PROCESS_ID=str(i),
                   JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_CPU_COLLECTIVES_IMPLEMENTATION="gloo")
        own = args(i) if callable(args) else args
        procs.append(subprocess.Popen([sys.executable, "-m", "lineage_jax.train", *own], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    return procs


def _finish(procs: list) -> list:
    """Each process's (returncode, output)."""
    out = []
    try:
        for p in procs:
            text, _ = p.communicate(timeout=TIMEOUT)
            out.append((p.returncode, text))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return out


def _logged_steps(path) -> list:
    try:
        return [json.loads(line)["step"] for line in open(path) if line.strip()]
    except (FileNotFoundError, json.JSONDecodeError):
        return []


def _run_one(args: list, devices: int):
    p = subprocess.run([sys.executable, "-m", "lineage_jax.train", *args], env=_env(devices), capture_output=True,
                       text=True, timeout=TIMEOUT)
    return p.returncode, p.stdout + p.stderr


def _train_lines(path):
    return [json.loads(line) for line in open(path) if "loss" in json.loads(line)]


def test_two_processes_preempted_resumed_match_one(tmp_path):
    wd, ref = str(tmp_path / "two"), str(tmp_path / "one")
    metrics = os.path.join(wd, "metrics.jsonl")
    procs = _start_processes(["--config", "tiny_gpt2", "--steps", str(STEPS), "--workdir", wd, "--mesh", "fsdp=2",
                              "--mesh-dcn", "data=2", *ARGS])
    deadline = time.monotonic() + TIMEOUT
    while not _logged_steps(metrics) and time.monotonic() < deadline and procs[1].poll() is None:
        time.sleep(0.02)
    procs[1].send_signal(signal.SIGTERM)   # one process only, as a preemption may reach them at different steps
    first = _finish(procs)
    assert all(rc == 0 for rc, _ in first), first
    stops = [re.search(r"SIGTERM: saved step (\d+)", text) for _, text in first]
    assert all(stops), first                                        # both stopped, saved ...
    at = int(stops[0].group(1))
    assert int(stops[1].group(1)) == at and at < STEPS and at % 2 == 0, first   # ... at one logged step
    assert json.load(open(os.path.join(wd, "config.json")))["train"]["mesh_dcn"] == "data=2"

    resumed = _finish(_start_processes(["--steps", str(STEPS), "--workdir", wd]))   # the recorded settings
    assert all(rc == 0 and f"resumed {wd} at step {at}" in text for rc, text in resumed), resumed
    assert [f"step {STEPS}: loss" in text for _, text in resumed] == [True, False]   # one summary line

    rc, text = _run_one(["--config", "tiny_gpt2", "--steps", str(STEPS), "--workdir", ref, "--mesh", "data=2,fsdp=2",
                         *ARGS], devices=4)
    assert rc == 0, text
    two, one = _train_lines(metrics), _train_lines(os.path.join(ref, "metrics.jsonl"))
    assert [r["step"] for r in two] == list(range(2, STEPS + 1, 2))   # written by one process, once a step
    assert [r["step"] for r in one] == list(range(2, STEPS + 1, 2))
    for a, b in zip(two, one):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5), (a, b)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4), (a, b)

    # one process cannot resume the two processes' run (its mesh spans two)
    rc, text = _run_one(["--steps", str(STEPS + 2), "--workdir", wd], devices=4)
    assert rc == 2 and "--mesh-dcn" in text and "slices/processes" in text, text
    assert len(_train_lines(metrics)) == STEPS // 2   # nothing written


def test_two_processes_refuse_what_would_hang_or_diverge(tmp_path):
    """Every process exits 2 with the same message, before training: no mesh (each process would train a copy of
    its own), a mesh whose batch axes do not split the batch between the processes (each reads rows of its own),
    and a workdir each process has to itself (a checkpoint would wait for the others forever); and a process
    whose own argument is refused stops the others."""
    base = ["--config", "tiny_gpt2", "--steps", "2", *ARGS]
    cases = [
        (lambda i: [*base, "--workdir", str(tmp_path / "a")], "belong to 2 processes"),
        (lambda i: [*base, "--workdir", str(tmp_path / "b"), "--mesh", "tensor=2", "--mesh-dcn", "tensor=2"],
         "do not split the batch between the 2 processes"),
        (lambda i: [*base, "--workdir", str(tmp_path / f"c{i}"), "--mesh", "fsdp=2", "--mesh-dcn", "data=2"],
         "processes [1] do not see the files process 0 writes there"),
    ]
    for args, message in cases:
        out = _finish(_start_processes(args))
        assert all(rc == 2 and message in text for rc, text in out), (message, out)
    # an argument only one host refuses (its data directory is missing): the other stops too, naming it
    out = _finish(_start_processes(lambda i: [*base, "--workdir", str(tmp_path / "d"), "--mesh", "fsdp=2", "--mesh-dcn",
                                              "data=2"] + (["--data", str(tmp_path / "missing")] if i else [])))
    assert [rc for rc, _ in out] == [2, 2] and "--data" in out[1][1], out
    assert "process 1 stopped before training" in out[0][1], out
    assert not any((tmp_path / d / "checkpoints").exists() for d in ("a", "b", "c0", "c1", "d"))


def test_data_state_per_process(monkeypatch):
    """A checkpoint's data item from a run of several processes gives each its own iterator state; another
    number of processes (same mesh settings, e.g. ``data=-1`` on other hosts) is refused, naming both counts."""
    import jax

    from lineage_jax.train import checkpoint as ck

    saved = {ck.PER_PROCESS: [{"shard_index": 0}, {"shard_index": 1}]}
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(jax, "process_index", lambda: 1)
    assert ck._own_data_state(saved) == {"shard_index": 1}
    with pytest.raises(ValueError, match="saved by one process, resumed by 2"):
        ck._own_data_state({"shard_index": 0})
    monkeypatch.setattr(jax, "process_count", lambda: 1)
    monkeypatch.setattr(jax, "process_index", lambda: 0)
    with pytest.raises(ValueError, match="saved by 2 processes, resumed by 1"):
        ck._own_data_state(saved)
    assert ck._own_data_state({"shard_index": 0}) == {"shard_index": 0}


def test_mesh_dcn_refused_by_name(tmp_path):
    rc, text = _run_one(["--config", "tiny_gpt2", "--steps", "1", "--workdir", str(tmp_path / "w"),
                         "--mesh-dcn", "data=-1"], devices=1)
    assert rc == 2 and "--mesh-dcn" in text and "positive" in text, text
    rc, text = _run_one(["--config", "tiny_gpt2", "--steps", "1", "--workdir", str(tmp_path / "w"),
                         "--mesh-dcn", "data=2"], devices=1)   # one process: no second slice or node
    assert rc == 2 and "--mesh-dcn" in text and "slices/processes" in text, text
    assert not os.path.exists(tmp_path / "w")
