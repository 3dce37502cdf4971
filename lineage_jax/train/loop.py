"""The training loop: resumable, preemption-safe, logged.

Rerunning the same command in the same workdir resumes from the latest
checkpoint — parameters, optimizer, step, RNG *and* the data iterator — so the
losses after a restart equal those of an uninterrupted run. SIGTERM (preemption)
finishes the current step, saves, and exits cleanly.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
import time
from typing import Any, Callable, Iterator, Optional

import jax
from flax import nnx
import numpy as np

from lineage_jax import accounting
from lineage_jax.models import ModelConfig
from lineage_jax.train.checkpoint import Checkpointer, gather_json
from lineage_jax.train.config import TrainConfig, import_modules
from lineage_jax.train.step import init_state, jit_steps, make_parallel

# Dense bf16 peak FLOP/s by device kind, for MFU (None: unknown -> MFU not reported). The first name found in
# the device kind wins: libtpu names a v5e "TPU v5 lite", a v5p "TPU v5", a v6e "TPU v6 lite".
PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "TPU v5p": 459e12, "TPU v5e": 197e12,
              "TPU v5 lite": 197e12, "TPU v6e": 918e12, "TPU v6 lite": 918e12, "TPU v5": 459e12, "TPU v4": 275e12}


def peak_flops() -> Optional[float]:
    kind = jax.devices()[0].device_kind
    for name, flops in PEAK_FLOPS.items():
        if name.lower() in kind.lower():
            return flops * jax.device_count()
    return None


def _any_process(flag: bool) -> bool:
    """Whether ``flag`` holds in any process (every process calls this at the same step)."""
    from jax.experimental import multihost_utils

    return bool(np.any(multihost_utils.process_allgather(np.array([flag]))))


class _Preemption:
    """Turns SIGTERM into a flag the loop checks between steps."""

    def __init__(self):
        self.requested = False
        self._previous = None

    def __enter__(self):
        def handler(signum, frame):
            self.requested = True
        try:
            self._previous = signal.signal(signal.SIGTERM, handler)
        except ValueError:  # not the main thread: no handler, no preemption support
            self._previous = None
        return self

    def __exit__(self, *exc):
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)


# TrainConfig fields that may change between the calls of one run: the workdir's own path (a run
# directory moved or copied elsewhere resumes there), the total steps and the logging cadence.
RESUMABLE_CHANGES = {"workdir", "steps", "progress", "eval_every", "log_every", "save_every", "deterministic"}
# ModelConfig fields likewise: how a scanned group runs (looped or unrolled) leaves the parameters
# and the checkpoints as they are.
RESUMABLE_MODEL_CHANGES = {"scan_unroll"}


def run_configs(workdir: str) -> Optional[tuple[TrainConfig, ModelConfig]]:
    """The configs a run directory records in its ``config.json`` (None: no run there); ``ValueError`` naming
    the directory where that file is unreadable. The run's ``imports`` are imported before its model config
    is read (a mixer they register is a letter of its pattern)."""
    path = os.path.join(workdir, "config.json")
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            record = json.load(f)
        train_cfg = TrainConfig(**record["train"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"--workdir {workdir!r}: its config.json is unreadable ({type(e).__name__}: {e})") from None
    try:
        import_modules(train_cfg.imports)
    except ValueError as e:
        raise ValueError(f"--workdir {workdir!r}: the run's {e}") from None
    try:
        return train_cfg, ModelConfig(**record["model"])
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"--workdir {workdir!r}: its config.json is unreadable ({type(e).__name__}: {e})") from None


def check_workdir(train_cfg: TrainConfig, model_cfg: ModelConfig) -> None:
    """Refuse (``ValueError``) a workdir that is a file, or holds a run with other settings.

    Writes nothing: the train CLI calls it before any file is created."""
    workdir = train_cfg.workdir
    if os.path.exists(workdir) and not os.path.isdir(workdir):
        raise ValueError(f"--workdir {workdir!r} is a file, not a directory")
    path = os.path.join(workdir, "config.json")
    if not os.path.exists(path):
        return
    try:
        with open(path) as f:
            old = json.load(f)
        old_train, old_model = old["train"], old["model"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"--workdir {workdir!r}: its config.json is unreadable ({type(e).__name__}); "
                         "use a new --workdir") from None
    new_model = dataclasses.asdict(model_cfg)
    old_model = dict(old_model)
    if isinstance(old_model.get("remat"), bool):  # older runs spelled the remat policy as a bool
        old_model["remat"] = "full" if old_model["remat"] else "none"
    train_rec = dataclasses.asdict(train_cfg)
    # a field a run's config.json lacks was added later: that run had its default
    defaults = {f.name: f.default for f in dataclasses.fields(TrainConfig)}
    diff = sorted(k for k in train_rec
                  if k not in RESUMABLE_CHANGES and old_train.get(k, defaults[k]) != train_rec[k])
    diff += sorted(f"model.{k}" for k in new_model
                   if k in old_model and k not in RESUMABLE_MODEL_CHANGES and old_model[k] != new_model[k])
    if diff:
        raise ValueError(f"--workdir {workdir!r} holds a run with different settings ({', '.join(diff)}); "
                         "use a new --workdir, or the same settings to resume")


def check_lengths(train_cfg: TrainConfig, model_cfg: ModelConfig) -> None:
    """Refuse (``ValueError``) rows longer than a learned position table."""
    if model_cfg.positions == "learned" and train_cfg.seq_len > model_cfg.max_seq_len:
        raise ValueError(f"TrainConfig.seq_len: {train_cfg.seq_len} exceeds the model's learned position table "
                         f"(max_seq_len={model_cfg.max_seq_len}); lower --set seq_len or raise --set max_seq_len")


def _write_configs(workdir: str, train_cfg: TrainConfig, model_cfg: ModelConfig) -> None:
    """Record the run's configs; refuse to resume a workdir with different ones."""
    check_workdir(dataclasses.replace(train_cfg, workdir=workdir), model_cfg)
    record = {"train": dataclasses.asdict(train_cfg), "model": dataclasses.asdict(model_cfg)}
    with open(os.path.join(workdir, "config.json"), "w") as f:
        json.dump(record, f, indent=2)


def _last_logged(path: str) -> tuple[dict[str, float], dict[str, float], Optional[int]]:
    """The last training metrics, the last evaluation and its step in ``metrics.jsonl`` (a finished run
    re-run reports them instead of training nothing)."""
    last, ev, ev_step = {}, {}, None
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                if line.strip():
                    rec = json.loads(line)
                    if "loss" in rec:
                        last = {k: v for k, v in rec.items() if k != "step"}
                    if "val_loss" in rec:
                        ev = {k: v for k, v in rec.items() if k != "step"}
                        ev_step = rec.get("step")
    return last, ev, ev_step


def _trim_metrics(path: str, last_step: int, log: Callable[[str], None] = print) -> None:
    """Drop metric lines past the restored step (they will be recomputed identically), and lines that are
    not JSON records — a write cut short by a crash ends the file with one (said in the log)."""
    if not os.path.exists(path):
        return
    keep, unreadable = [], []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                step = rec.get("step", 0)
            except (ValueError, AttributeError):
                unreadable.append(number)
                continue
            if step <= last_step:
                keep.append(line if line.endswith("\n") else line + "\n")
    if unreadable:
        log(f"{path}: dropped {len(unreadable)} line(s) that are not JSON records (line {unreadable[0]}"
            f"{'' if len(unreadable) == 1 else ', ...'}; a write cut short)")
    with open(path, "w") as f:
        f.writelines(keep)


def evaluate(eval_step, state, batches: Iterator[dict], n: int, put: Callable = lambda b: b) -> dict[str, float]:
    losses, accs = [], []
    for _ in range(n):
        try:
            batch = next(batches)
        except StopIteration:
            break
        m = eval_step(state, put(batch))
        losses.append(float(m["loss"]))
        accs.append(float(m["accuracy"]))
    if not losses:
        return {}
    loss = float(np.mean(losses))
    return {"val_loss": loss, "val_perplexity": float(math.exp(min(loss, 50.0))), "val_accuracy": float(np.mean(accs))}


class InitFromHFError(ValueError):
    """``init_from_hf`` names a checkpoint whose parameters do not fit the run's model config."""


class WorkdirError(ValueError):
    """The processes of a run do not share its ``workdir`` (each host's own disk): their checkpoints could
    never be completed."""


def check_shared_workdir(workdir: str) -> None:
    """With several processes: every one must see the files process 0 writes in ``workdir`` (one directory
    on a shared filesystem). Orbax writes each process's share of a checkpoint and completes it on process 0;
    on each host's own disk the first save waits for the others forever. A :class:`WorkdirError` naming the
    processes that do not see it, raised on every process alike."""
    if jax.process_count() < 2:
        return
    path = os.path.join(workdir, ".lineage_shared_check")
    token = None
    if jax.process_index() == 0:
        token = os.urandom(8).hex()
        with open(path, "w") as f:
            f.write(token)
    token = gather_json(token)[0]          # process 0's, once it is written
    try:
        with open(path) as f:
            seen = f.read().strip() == token
    except OSError:
        seen = False
    seen_by = gather_json(seen)
    if jax.process_index() == 0:
        os.remove(path)
    blind = [i for i, ok in enumerate(seen_by) if not ok]
    if blind:
        raise WorkdirError(f"--workdir {workdir}: processes {blind} do not see the files process 0 writes there; "
                           f"every process of a run needs the same directory on a shared filesystem (NFS, "
                           f"Filestore, a gcsfuse mount), not each host's own disk")


def _init_from_hf(state, path: str, model_cfg: ModelConfig, parallel):
    """``state`` with its parameters (and router biases) replaced by a transformers checkpoint's,
    placed in the same shardings. The optimizer's initial state does not depend on the parameters'
    values (zero moments), so it stays."""
    from lineage_jax import hf

    loaded = hf.load(path, mesh=None if parallel is None else parallel.mesh,
                     rules=None if parallel is None else parallel.rules, scan_layers=model_cfg.scan_layers)
    _, params, rest = nnx.split(loaded, nnx.Param, ...)
    for name, new, old in (("parameters", params, state.params), ("state", rest, state.rest)):
        want = jax.tree.map(lambda a: (a.shape, str(a.dtype)), old)
        got = jax.tree.map(lambda a: (a.shape, str(a.dtype)), new)
        if jax.tree.structure(want) != jax.tree.structure(got) or jax.tree.leaves(want) != jax.tree.leaves(got):
            raise InitFromHFError(f"--init-from-hf {path}: the checkpoint's {name} do not fit the run's model "
                                  "config (change only execution fields such as remat or dtype with --set); "
                                  "nothing was written")
    return state._replace(params=params, rest=rest)


def train(train_cfg: TrainConfig, model_cfg: ModelConfig, data: Callable[[str], Any], *,
          log: Callable[[str], None] = print) -> dict[str, Any]:
    """Train ``model_cfg`` for ``train_cfg.steps`` steps in ``train_cfg.workdir``.

    Args:
      data: ``data(split)`` for split "train" / "val" returns an iterator of batch dicts
        (``tokens``, ``targets``, ``segment_ids``, ``mask``) holding this process's rows;
        the train iterator must have ``get_state() -> JSON-able`` and ``set_state(state)``.

    ``train_cfg.mesh`` (e.g. ``"data=2,expert=4"``) runs the same step sharded over the
    devices (``lineage_jax.train.step.make_parallel``): parameters and optimizer state
    born sharded, batches split over the batch mesh axes, MoE expert-parallel. Checkpoints
    are saved and restored in those shardings. With several processes (``jax.distributed``; the
    CLI starts it from the environment) the first one writes ``config.json``, ``metrics.jsonl``,
    the TensorBoard events and the progress bar; the checkpoints hold every process's data
    iterator state; a SIGTERM stops every process at the next logged step.
    Returns:
      a summary with the final step, last metrics and evaluation.
    """
    from tqdm.auto import tqdm

    check_lengths(train_cfg, model_cfg)
    workdir = os.path.abspath(train_cfg.workdir)
    check_workdir(dataclasses.replace(train_cfg, workdir=workdir), model_cfg)
    parallel = make_parallel(model_cfg, train_cfg.mesh, batch_size=train_cfg.batch_size, mesh_dcn=train_cfg.mesh_dcn)
    put = parallel.shard_batch if parallel is not None else (lambda b: b)
    graphdef, state, tx = init_state(model_cfg, train_cfg, parallel)
    if parallel is not None:
        log(f"mesh {dict(parallel.mesh.shape)} over {parallel.mesh.size} devices"
            + (" (expert-parallel MoE)" if parallel.expert_parallel is not None else ""))
    ckpt_dir = os.path.join(workdir, "checkpoints")
    if train_cfg.init_from_hf and Checkpointer.latest_in(ckpt_dir) is None:
        # before the workdir is written: weights that do not fit the model config change nothing
        state = _init_from_hf(state, train_cfg.init_from_hf, model_cfg, parallel)
        log(f"initialised from the transformers checkpoint {train_cfg.init_from_hf}")
    os.makedirs(workdir, exist_ok=True)
    check_shared_workdir(workdir)
    ckpt = Checkpointer(ckpt_dir, keep=train_cfg.keep_checkpoints)
    try:
        train_iter = data("train")
        start = 0
        step = ckpt.latest_step()
        if step is not None:
            state, data_state = ckpt.restore(state, step)
            try:
                train_iter.set_state(data_state)
            except (ValueError, KeyError, TypeError) as e:  # the data pipeline's state is part of the checkpoint
                raise ckpt.refusal(step, e) from e
            start = int(state.step)
            log(f"resumed {workdir} at step {start}")
        # one process writes the run's files (config, metrics, TensorBoard events, the bar); every one saves and
        # restores its share of the checkpoints
        primary, several = jax.process_index() == 0, jax.process_count() > 1
        metrics_path = os.path.join(workdir, "metrics.jsonl")
        if primary:
            _write_configs(workdir, train_cfg, model_cfg)  # after a successful restore: a failed one changes nothing
            _trim_metrics(metrics_path, start, log)

        train_step, eval_step = jit_steps(graphdef, tx, train_cfg, state, parallel)
        tokens_per_step = train_cfg.batch_size * train_cfg.seq_len  # the global batch
        flops_per_step = 3 * accounting.flops_per_token(model_cfg, train_cfg.seq_len) * tokens_per_step
        peak = peak_flops()

        writer = None
        try:
            from tensorboardX import SummaryWriter
            if primary:
                writer = SummaryWriter(os.path.join(workdir, "tb"))
        except ImportError:  # tensorboardX is a dependency, but an environment may lack it
            log("tensorboardX is not installed: no TensorBoard events (metrics.jsonl is written as always)")

        last: dict[str, float] = {}
        evaluation: dict[str, float] = {}
        evaluated = None  # the step of the last evaluation logged
        if start >= train_cfg.steps:
            # process 0's reading for every process (each decides from it whether to evaluate: a collective)
            logged = _last_logged(metrics_path) if primary else None
            last, evaluation, evaluated = gather_json(logged)[0] if several else logged
            log(f"{workdir} already finished {start} steps (--steps is the total: pass a larger --steps to extend it)")
        bar = tqdm(total=train_cfg.steps, initial=start, disable=not (train_cfg.progress and primary), unit="step",
                   dynamic_ncols=True)
        t_last, step_last = time.perf_counter(), start
        stopped = False
        metrics_file = open(metrics_path if primary else os.devnull, "a")
        with _Preemption() as preempt, metrics_file as mfile:
            def log_evaluation(at: int) -> None:
                mfile.write(json.dumps({"step": at, **evaluation}) + "\n")
                mfile.flush()
                if writer is not None:
                    for k, v in evaluation.items():
                        writer.add_scalar(f"eval/{k}", v, at)

            for step in range(start, train_cfg.steps):
                batch = put(next(train_iter))
                state, metrics = train_step(state, batch)
                done = step + 1
                at_log = done % train_cfg.log_every == 0 or done == train_cfg.steps
                # several processes stop together, at a logged step: a SIGTERM may reach them at different steps,
                # and a save one process starts alone would wait forever for the others
                stop = preempt.requested if not several else at_log and _any_process(preempt.requested)
                if at_log or stop:
                    last = {k: float(v) for k, v in jax.device_get(metrics).items()}
                    if not math.isfinite(last["loss"]):
                        raise ckpt.diverged(done, f"the training loss is {last['loss']}")
                    now = time.perf_counter()
                    rate = (done - step_last) * tokens_per_step / max(now - t_last, 1e-9)
                    t_last, step_last = now, done
                    last["tokens_per_s"] = rate
                    if peak:
                        last["mfu"] = rate / tokens_per_step * flops_per_step / peak
                    record = {"step": done, **last}
                    mfile.write(json.dumps(record) + "\n")
                    mfile.flush()
                    if writer is not None:
                        for k, v in last.items():
                            writer.add_scalar(f"train/{k}", v, done)
                    post = {"loss": f"{last['loss']:.4f}", "tok/s": f"{rate:,.0f}"}
                    post["MFU"] = f"{100 * last['mfu']:.1f}%" if peak else f"unknown device ({jax.devices()[0].device_kind})"
                    bar.set_postfix(post)
                bar.update(1)
                if train_cfg.eval_every and done % train_cfg.eval_every == 0 and done != train_cfg.steps:
                    evaluation = evaluate(eval_step, state, data("val"), train_cfg.eval_batches, put)
                    log_evaluation(done)
                if done % train_cfg.save_every == 0 or done == train_cfg.steps or stop:
                    ckpt.save(done, state, train_iter.get_state(), force=True)
                if stop:
                    log(f"SIGTERM: saved step {done} in {workdir}; rerun the same command to resume")
                    stopped = True
                    break
            # the final evaluation, unless the log holds it (a finished run re-run); a run stopped during its
            # last step gets it on the rerun
            if not stopped and int(state.step) == train_cfg.steps and evaluated != train_cfg.steps:
                evaluation = evaluate(eval_step, state, data("val"), train_cfg.eval_batches, put)
                if evaluation:
                    log_evaluation(int(state.step))
        bar.close()
        if writer is not None:
            writer.close()
        return {"step": int(state.step), "metrics": last, "eval": evaluation, "preempted": stopped, "workdir": workdir}
    finally:
        ckpt.close()
