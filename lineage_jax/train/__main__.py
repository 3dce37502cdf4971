"""``python -m lineage_jax.train --config NAME --steps N --workdir DIR [--set key=value ...]``.

``--init-from-hf DIR`` starts from a transformers checkpoint (GPT-2, Kimi Linear, DeepSeek-V3;
``lineage_jax.hf``) instead of random weights: the model config is the checkpoint's (``--config``
is then not needed; ``--set`` still overrides execution fields such as ``remat`` or ``dtype``).

Rerunning the same command resumes exactly from the latest checkpoint in DIR; a larger
``--steps`` extends a finished run; a run directory moved or copied elsewhere resumes there.
Without ``--config`` and ``--init-from-hf``, a DIR holding a run resumes with the settings its
``config.json`` records (``--steps N --workdir DIR`` is enough).
``--import MODULE`` imports a module of one's own first (recorded, and imported again on resume): one that
adds a mixer with ``lineage_jax.models.register_rule`` makes its letter a valid ``--set pattern=...``.
Every argument is checked before anything is written.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from typing import Optional

import jax

from lineage_jax.models import config_names, get_config
from lineage_jax.parallel import maybe_initialize_distributed, parse_mesh_spec
from lineage_jax.train.checkpoint import CheckpointError, NonFiniteStateError
from lineage_jax.train.config import TrainConfig, apply_overrides, import_modules
from lineage_jax.train.inputs import make_data
from lineage_jax.train.loop import (InitFromHFError, WorkdirError, check_lengths, check_workdir, run_configs,
                                    train)
from lineage_jax.train.step import make_parallel, parse_dcn_spec


# TrainConfig fields that the command line sets with their own flags (and checks there)
_FLAG_FIELDS = {"config": "--config", "init_from_hf": "--init-from-hf", "steps": "--steps", "workdir": "--workdir",
                "data": "--data", "mesh": "--mesh", "mesh_dcn": "--mesh-dcn", "imports": "--import"}


def parse(argv: Optional[list[str]] = None) -> tuple[TrainConfig, object]:
    p = argparse.ArgumentParser(prog="python -m lineage_jax.train", description=__doc__.splitlines()[0])
    p.add_argument("--config", default=None,
                   help=f"model config: {', '.join(config_names())} (not with --init-from-hf; without either, "
                        "a --workdir holding a run resumes with the settings it records)")
    p.add_argument("--init-from-hf", default=None, metavar="DIR",
                   help="start from this transformers checkpoint directory (config.json + safetensors); "
                        "its config.json gives the model config")
    p.add_argument("--steps", type=int, required=True,
                   help="total optimizer steps of the run (not additional ones), and the length of its learning-"
                        "rate schedule: rerunning with a larger N extends a finished run on the schedule of the new N "
                        "(the rate moves to that curve at the resumed step), with the same N resumes exactly or "
                        "reports a finished one")
    p.add_argument("--workdir", required=True,
                   help="the run's directory: config.json, checkpoints/, metrics.jsonl, tb/ (created if absent; "
                        "an existing one is resumed)")
    p.add_argument("--data", default=None, help="'stdlib' (default), a directory of text files, .array_record "
                                                "files (comma-separated), or a task (mqar, niah, overwrite, fade, "
                                                "mixed_half_lives)")
    p.add_argument("--mesh", default=None,
                   help="device mesh over all devices of all processes, e.g. data=2,fsdp=1,tensor=1,expert=4 "
                        "(axes left out are 1; one axis may be -1 = the rest); --set batch_size is the global batch")
    p.add_argument("--mesh-dcn", dest="mesh_dcn", default=None, metavar="AXES",
                   help="multi-slice TPU / multi-node GPU: how many slices (TPU) or processes (GPU) each mesh axis "
                        "spans, e.g. data=2 for two slices; --mesh is then the shape within one slice or node "
                        "(only these axes cross the slow links)")
    p.add_argument("--import", dest="imports", action="append", default=[], metavar="MODULE",
                   help="import this Python module before the model config is read (repeatable; recorded, and "
                        "imported again on resume), e.g. one that adds a mixer with "
                        "lineage_jax.models.register_rule")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a TrainConfig or ModelConfig field (repeatable), e.g. --set lr=1e-3 --set d_model=128")
    args = p.parse_args(argv)
    if args.steps <= 0:
        p.error(f"--steps must be a positive number of steps, got {args.steps}")
    if os.path.exists(args.workdir) and not os.path.isdir(args.workdir):
        p.error(f"--workdir {args.workdir!r} is a file, not a directory")
    imports = ",".join(args.imports)
    try:
        TrainConfig(imports=imports)  # module names checked before any is imported
        import_modules(imports)
    except ValueError as e:
        p.error(str(e).replace("TrainConfig.imports", "--import"))
    if args.init_from_hf is not None:
        if args.config is not None:
            p.error("--config and --init-from-hf exclude each other (the checkpoint's config.json is the model config)")
        from lineage_jax import hf
        try:
            base_model, family = hf.config_from_hf(hf.read_config(args.init_from_hf))
            hf.Checkpoint(args.init_from_hf)  # the files exist (tensors are checked when loaded)
        except ValueError as e:
            p.error(f"--init-from-hf: {e}")
        config_name = f"hf_{family}"
    recorded = None
    if args.init_from_hf is None and args.config is None:
        try:
            recorded = run_configs(args.workdir)
        except ValueError as e:
            p.error(str(e))
        if recorded is None:
            p.error("one of --config or --init-from-hf is required (or a --workdir holding a run: it resumes with "
                    "the settings its config.json records)")
    if recorded is not None:  # the run's own settings; --steps, --set and the flags given change them
        base_model = recorded[1]
        base = {**dataclasses.asdict(recorded[0]), "steps": args.steps, "workdir": args.workdir}
    else:
        if args.init_from_hf is None:
            if args.config not in config_names():
                p.error(f"unknown --config {args.config!r}; valid names: {', '.join(config_names())}")
            base_model, config_name = get_config(args.config), args.config
        base = {"config": config_name, "steps": args.steps, "workdir": args.workdir}
    if args.init_from_hf is not None:
        base["init_from_hf"] = os.path.abspath(args.init_from_hf)
    if args.imports:
        base["imports"] = imports
    if args.data is not None:
        base["data"] = args.data
    for flag, field, check in (("--mesh", "mesh", parse_mesh_spec), ("--mesh-dcn", "mesh_dcn", parse_dcn_spec)):
        value = getattr(args, field)
        if value is not None:
            try:
                check(value)
            except ValueError as e:
                p.error(f"{flag} {value!r}: {e}")
            base[field] = value
    for pair in args.overrides:  # fields with a flag of their own are set by that flag only
        key = pair.split("=", 1)[0].strip()
        if key in _FLAG_FIELDS:
            p.error(f"--set {pair}: `{key}` is set by {_FLAG_FIELDS[key]}, not --set")
    try:
        train_cfg = TrainConfig(**base)
        train_cfg, model_cfg = apply_overrides(train_cfg, base_model, args.overrides)
    except ValueError as e:
        p.error(str(e))
    return train_cfg, model_cfg


def _fail(msg: str, code: int = 2) -> None:
    print(f"python -m lineage_jax.train: error: {msg}", file=sys.stderr)
    raise SystemExit(code)


def _checked(argv):
    """The run's configs and data, every argument checked before any work (``SystemExit`` 2 naming it)."""
    train_cfg, model_cfg = parse(argv)
    try:
        check_lengths(train_cfg, model_cfg)
    except ValueError as e:
        _fail(str(e))
    try:
        data = make_data(train_cfg, model_cfg)
    except ValueError as e:
        _fail(f"--data {train_cfg.data}: {e}")
    try:
        make_parallel(model_cfg, train_cfg.mesh, batch_size=train_cfg.batch_size, mesh_dcn=train_cfg.mesh_dcn)
    except ValueError as e:
        _fail(f"--mesh{'/--mesh-dcn' if train_cfg.mesh_dcn else ''}: {e}")
    try:
        check_workdir(train_cfg, model_cfg)  # a workdir holding another run: refused before writing anything
    except ValueError as e:
        _fail(str(e))
    return train_cfg, model_cfg, data


def _agree_to_start(stop: Optional[SystemExit]) -> None:
    """Several processes: every one learns whether all passed their checks (a data directory missing on one
    host, say) and stops with the first one that did not, instead of waiting for it in the first collective."""
    if jax.process_count() < 2:
        return
    from lineage_jax.train.checkpoint import gather_json

    code = None if stop is None else (stop.code if isinstance(stop.code, int) else 2)
    codes = gather_json(code)
    first = next((i for i, c in enumerate(codes) if c is not None), None)
    if stop is None and first is not None:
        _fail(f"process {first} stopped before training (exit code {codes[first]}; its output says why)",
              code=codes[first] or 2)


def main(argv: Optional[list[str]] = None) -> int:
    # multi-host (TPU VM slices, SLURM, JAX_* env; a no-op on one host): before anything asks JAX for its
    # backend, which the model config's checks do ("auto" settings resolve by platform)
    maybe_initialize_distributed()
    try:
        train_cfg, model_cfg, data = _checked(argv)
    except SystemExit as stop:  # an argument refused (or --help): the other processes must not wait for this one
        _agree_to_start(stop)
        raise
    _agree_to_start(None)
    try:
        out = train(train_cfg, model_cfg, data)
    except CheckpointError as e:
        _fail(str(e))
    except (InitFromHFError, WorkdirError) as e:
        _fail(str(e))
    except NonFiniteStateError as e:  # the run diverged: a failure of the run, not of its arguments
        _fail(str(e), code=1)
    ev = out["eval"]
    loss = out["metrics"].get("loss")
    msg = f"step {out['step']}: " + (f"loss {loss:.4f}" if loss is not None else "no training loss logged")
    if ev:
        msg += f", val loss {ev['val_loss']:.4f} (ppl {ev['val_perplexity']:.2f}, acc {ev['val_accuracy']:.3f})"
    if jax.process_index() == 0:  # one line for a run of several processes
        print(msg)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
