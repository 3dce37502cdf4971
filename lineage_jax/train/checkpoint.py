"""Orbax checkpoints of the whole research state: parameters, optimizer, step, RNG, data iterator."""

from __future__ import annotations

import os
from typing import Any, Optional

import jax
import orbax.checkpoint as ocp

from lineage_jax.train.step import TrainState


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
        out = self.manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target),
                                                                 data=ocp.args.JsonRestore()))
        return TrainState(**out["state"]), out["data"]

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
