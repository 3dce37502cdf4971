"""Former home of the sharded training step and decoder, kept so that existing imports work.

The training state, its shardings, born-sharded initialisation and the train step are in
``lineage_jax.train.step``; sharded decoding is ``lineage_jax.generate.ShardedDecoder``;
batch and optimizer layouts are in ``lineage_jax.parallel.rules``; ``resolve_expert_parallel``
is in ``lineage_jax.parallel.expert``.
"""

from lineage_jax.generate import ShardedDecoder
from lineage_jax.parallel.expert import resolve_expert_parallel
from lineage_jax.parallel.rules import batch_sharding, optimizer_shardings, shard_batch
from lineage_jax.train.step import TrainState, TrainStep, init_sharded, next_token_loss

__all__ = ["ShardedDecoder", "TrainState", "TrainStep", "batch_sharding", "init_sharded", "next_token_loss",
           "optimizer_shardings", "resolve_expert_parallel", "shard_batch"]
