"""Training: config, optimizer, functional train state and step, checkpoints, the resumable loop.

CLI: ``python -m lineage_jax.train --config NAME --steps N --workdir DIR [--set key=value ...]``.
"""

from lineage_jax.train.config import TrainConfig, apply_overrides
from lineage_jax.train.loop import train
from lineage_jax.train.step import (Parallel, TrainState, TrainStep, init_sharded, init_state, jit_steps,
                                    make_eval_step, make_parallel, make_train_step, next_token_loss, state_shardings)

__all__ = ["Parallel", "TrainConfig", "TrainState", "TrainStep", "apply_overrides", "init_sharded", "init_state",
           "jit_steps", "make_eval_step", "make_parallel", "make_train_step", "next_token_loss", "state_shardings",
           "train"]
