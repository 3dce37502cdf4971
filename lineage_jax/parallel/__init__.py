"""Parallelism: device meshes, one table of logical-axis sharding rules, sharded
init / train step / decode under ``jax.jit``, and expert-parallel MoE (``shard_map`` +
all-to-all). See ``docs/parallelism.md``.

The per-device memory / communication planner is ``python -m lineage_jax.parallel.plan``.
"""

from lineage_jax.parallel.expert import (ExpertParallel, ExpertParallelMoE, check_num_experts,
                                         enable_expert_parallel, expert_parallel_experts, moe_forward)
from lineage_jax.parallel.mesh import (MESH_AXES, detect_cluster, make_mesh, maybe_initialize_distributed, mesh_shape,
                                       parse_mesh_spec, resolve_axis_sizes)
from lineage_jax.parallel.rules import (DEFAULT_RULES, current_logical_sharding, local_shape, logical_sharding,
                                        logical_sharding_of, logical_to_spec, mesh_axes_of, rules_dict, sharding_table,
                                        state_shardings, state_specs, with_logical_constraint, without_mesh_axis)
from lineage_jax.parallel.sharded import (ShardedDecoder, TrainState, TrainStep, batch_sharding, init_sharded,
                                          next_token_loss, optimizer_shardings, resolve_expert_parallel,
                                          shard_batch)

__all__ = [
    "DEFAULT_RULES", "ExpertParallel", "ExpertParallelMoE", "MESH_AXES", "ShardedDecoder", "TrainState", "TrainStep",
    "batch_sharding", "check_num_experts", "current_logical_sharding", "detect_cluster", "enable_expert_parallel",
    "expert_parallel_experts", "init_sharded", "local_shape", "logical_sharding", "logical_sharding_of",
    "logical_to_spec", "make_mesh", "maybe_initialize_distributed", "mesh_axes_of", "mesh_shape", "moe_forward",
    "next_token_loss", "optimizer_shardings", "parse_mesh_spec", "resolve_axis_sizes", "resolve_expert_parallel", "rules_dict",
    "shard_batch", "sharding_table", "state_shardings", "state_specs", "with_logical_constraint", "without_mesh_axis",
]
