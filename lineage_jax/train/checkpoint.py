"""Orbax checkpoints of the whole research state: parameters, optimizer, step, RNG, data iterator."""

from __future__ import annotations

import json
import os
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from lineage_jax.train.step import TrainState

Array = jax.Array


class CheckpointError(ValueError):
    """A checkpoint that cannot be restored (incomplete, corrupted, or of another model); names its directory."""


class NonFiniteStateError(FloatingPointError):
    """A training state holding NaN or infinite values, refused before it is saved."""


@jax.jit
def _finite_leaves(leaves: list) -> Array:
    return jnp.stack([jnp.isfinite(x).all() for x in leaves])


def first_nonfinite(tree: Any) -> Optional[str]:
    """The path (``params/blocks/0/...``) of the first floating-point leaf of ``tree`` that holds a NaN or an
    infinity, or None. One compiled program for all the leaves (sharded ones included: a program a leaf would
    launch a collective a leaf), one small array fetched."""
    leaves = [(p, x) for p, x in jax.tree_util.tree_leaves_with_path(tree)
              if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.inexact)]
    if not leaves:
        return None
    ok = jax.device_get(_finite_leaves([x for _, x in leaves]))
    for (path, _), good in zip(leaves, ok):
        if not good:
            return "/".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)
    return None


PER_PROCESS = "per_process"  # the data item of a multi-process run: every process's iterator state, by index


def gather_json(value: Any) -> list:
    """``value`` (JSON-able) of every process, in process order (an all-gather of its UTF-8 bytes)."""
    from jax.experimental import multihost_utils

    raw = np.frombuffer(json.dumps(value).encode(), np.uint8)
    sizes = multihost_utils.process_allgather(np.array([raw.size], np.int32)).reshape(-1)
    buf = np.zeros((int(sizes.max()),), np.uint8)
    buf[:raw.size] = raw
    every = multihost_utils.process_allgather(buf).reshape(len(sizes), -1)
    return [json.loads(bytes(row[:n]).decode()) for row, n in zip(every, sizes)]


def _own_data_state(saved: Any) -> Any:
    """This process's iterator state from a checkpoint's data item: the item itself (one process wrote it) or,
    from a multi-process run, its entry by process index — refused (``ValueError``) when the run that wrote it
    had another number of processes (each process reads its own shard of the data)."""
    n, i = jax.process_count(), jax.process_index()
    if isinstance(saved, dict) and set(saved) == {PER_PROCESS}:
        states = saved[PER_PROCESS]
        if len(states) != n:
            raise ValueError(f"data: saved by {len(states)} processes, resumed by {n} (each process reads its own "
                             f"shard of the data): resume with {len(states)} processes")
        return states[i]
    if n > 1:
        raise ValueError(f"data: saved by one process, resumed by {n} (each process reads its own shard of the data): "
                         f"resume with one process")
    return saved


class Checkpointer:
    """A thin wrapper over ``ocp.CheckpointManager`` (async saves, keeps the last ``keep``). In a run of several
    processes the data item holds every process's iterator state (each reads its own shard), and a resume takes
    its own; resuming with another number of processes is refused."""

    def __init__(self, directory: str, *, keep: int = 2, async_save: bool = True):
        self.directory = os.path.abspath(directory)
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                               enable_async_checkpointing=async_save)
        self.manager = ocp.CheckpointManager(self.directory, options=options, item_names=("state", "data"))

    def latest_step(self) -> Optional[int]:
        return self.manager.latest_step()

    @staticmethod
    def latest_in(directory: str) -> Optional[int]:
        """The latest step saved in ``directory`` (None: none, or no such directory); creates nothing."""
        options = ocp.CheckpointManagerOptions(create=False)
        manager = ocp.CheckpointManager(os.path.abspath(directory), options=options, item_names=("state", "data"))
        try:
            return manager.latest_step()
        finally:
            manager.close()

    def save(self, step: int, state: TrainState, data_state: Any, *, force: bool = False) -> None:
        """Save ``state`` as step ``step`` (the oldest checkpoints beyond ``keep`` are pruned). A state with
        NaN or infinite values is refused (:class:`NonFiniteStateError`) and nothing is written or pruned:
        the last finite checkpoints stay."""
        bad = first_nonfinite(state._asdict())
        if bad is not None:
            raise self.diverged(step, f"the training state holds NaN or infinite values (first in {bad})")
        if jax.process_count() > 1:  # orbax writes the JSON item from the primary process only: gather every one's
            data_state = {PER_PROCESS: gather_json(data_state)}
        self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state._asdict()),
                                                        data=ocp.args.JsonSave(data_state)), force=force)

    def diverged(self, step: int, what: str) -> NonFiniteStateError:
        """The :class:`NonFiniteStateError` of a run that stops at ``step`` without saving (``what`` happened);
        it names the checkpoints that are kept."""
        kept = sorted(self.manager.all_steps())
        return NonFiniteStateError(f"step {step}: {what}; stopped without saving, and the checkpoints in "
                                   f"{self.directory} are kept (steps {kept if kept else 'none'})")

    def restore(self, abstract_state: TrainState, step: Optional[int] = None) -> tuple[TrainState, Any]:
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {self.directory}")
        target = jax.tree.map(ocp.utils.to_shape_dtype_struct, abstract_state._asdict())
        try:
            out = self.manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target),
                                                                     data=ocp.args.JsonRestore()))
            data_state = _own_data_state(out["data"])
        except Exception as e:  # orbax / tensorstore raise many types for unreadable or mismatched files
            raise self.refusal(step, e) from e
        bad = first_nonfinite(out["state"])  # saves refuse such states: a damaged file
        if bad is not None:
            raise self.refusal(step, ValueError(f"{bad} holds NaN or infinite values"))
        return TrainState(**out["state"]), data_state

    def refusal(self, step: int, error: BaseException) -> CheckpointError:
        """The :class:`CheckpointError` for step ``step``'s checkpoint that could not be restored (``error``
        says why): it names the checkpoint and the other steps to resume from."""
        path = os.path.join(self.directory, str(step))
        detail = " ".join(str(error).split())
        detail = detail if len(detail) <= 300 else detail[:300] + "..."
        others = [s for s in self.manager.all_steps() if s != step]
        hint = (f"the other checkpoints here are of steps {sorted(others)}: move {path} aside to resume from "
                f"step {max(others)}") if others else "no other checkpoint is here"
        return CheckpointError(f"checkpoint {path} cannot be restored: it is incomplete, corrupted, or written by a "
                               f"model with other settings ({type(error).__name__}: {detail}); nothing was changed; "
                               f"{hint}")

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
