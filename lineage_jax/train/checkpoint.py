"""Orbax checkpoints of the whole research state: parameters, optimizer, step, RNG, data iterator."""

from __future__ import annotations

import os
from typing import Any, Optional

import jax
import orbax.checkpoint as ocp

from lineage_jax.train.step import TrainState


class CheckpointError(ValueError):
    """A checkpoint that cannot be restored (incomplete, corrupted, or of another model); names its directory."""


class Checkpointer:
    """A thin wrapper over ``ocp.CheckpointManager`` (async saves, keeps the last ``keep``)."""

    def __init__(self, directory: str, *, keep: int = 2, async_save: bool = True):
        self.directory = os.path.abspath(directory)
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                               enable_async_checkpointing=async_save)
        self.manager = ocp.CheckpointManager(self.directory, options=options, item_names=("state", "data"))

    def latest_step(self) -> Optional[int]:
        return self.manager.latest_step()

    def save(self, step: int, state: TrainState, data_state: Any, *, force: bool = False) -> None:
        self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state._asdict()),
                                                        data=ocp.args.JsonSave(data_state)), force=force)

    def restore(self, abstract_state: TrainState, step: Optional[int] = None) -> tuple[TrainState, Any]:
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {self.directory}")
        target = jax.tree.map(ocp.utils.to_shape_dtype_struct, abstract_state._asdict())
        try:
            out = self.manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target),
                                                                     data=ocp.args.JsonRestore()))
        except Exception as e:  # orbax / tensorstore raise many types for unreadable or mismatched files
            raise CheckpointError(self._unreadable(step, e)) from e
        return TrainState(**out["state"]), out["data"]

    def _unreadable(self, step: int, error: BaseException) -> str:
        path = os.path.join(self.directory, str(step))
        detail = " ".join(str(error).split())
        detail = detail if len(detail) <= 300 else detail[:300] + "..."
        others = [s for s in self.manager.all_steps() if s != step]
        hint = (f"the other checkpoints here are of steps {sorted(others)}: move {path} aside to resume from "
                f"step {max(others)}") if others else "no other checkpoint is here"
        return (f"checkpoint {path} cannot be restored: it is incomplete, corrupted, or written by a model "
                f"with other settings ({type(error).__name__}: {detail}); nothing was changed; {hint}")

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
