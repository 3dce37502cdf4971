"""Training: config, optimizer, functional train state and step, checkpoints, the resumable loop.

CLI: ``python -m lineage_jax.train --config NAME --steps N --workdir DIR [--set key=value ...]``.
"""

from lineage_jax.train.config import TrainConfig, apply_overrides
from lineage_jax.train.loop import train
from lineage_jax.train.step import TrainState, init_state, make_eval_step, make_train_step

__all__ = ["TrainConfig", "TrainState", "apply_overrides", "init_state", "make_eval_step", "make_train_step", "train"]
