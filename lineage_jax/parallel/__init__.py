"""Parallelism: device meshes, one table of logical-axis sharding rules (parameters,
optimizer state, batches, activations), and expert-parallel MoE (``shard_map`` +
all-to-all). See ``docs/parallelism.md``.

The sharded training state and step are ``lineage_jax.train.step`` (``TrainState``,
``state_shardings``, ``init_sharded``, ``TrainStep``, ``next_token_loss``); sharded decoding
is ``lineage_jax.generate.ShardedDecoder``. The per-device memory / communication planner
is ``python -m lineage_jax.parallel.plan``.
"""

import importlib

from lineage_jax.parallel.expert import (ExpertParallel, ExpertParallelMoE, check_num_experts,
                                         enable_expert_parallel, expert_parallel_experts, moe_forward,
                                         resolve_expert_parallel)
from lineage_jax.parallel.mesh import (MESH_AXES, detect_cluster, make_mesh, maybe_initialize_distributed, mesh_shape,
                                       parse_mesh_spec, resolve_axis_sizes)
from lineage_jax.parallel.rules import (DEFAULT_RULES, batch_sharding, check_mesh, current_logical_sharding,
                                        local_shape, logical_sharding, logical_sharding_of, logical_to_spec,
                                        mesh_axes_of, optimizer_shardings, rules_dict, shard_batch, sharding_table,
                                        state_shardings, state_specs, with_logical_constraint, without_mesh_axis)

__all__ = [
    "DEFAULT_RULES", "ExpertParallel", "ExpertParallelMoE", "MESH_AXES", "batch_sharding", "check_mesh",
    "check_num_experts",
    "current_logical_sharding", "detect_cluster", "enable_expert_parallel", "expert_parallel_experts", "local_shape",
    "logical_sharding", "logical_sharding_of", "logical_to_spec", "make_mesh", "maybe_initialize_distributed",
    "mesh_axes_of", "mesh_shape", "moe_forward", "optimizer_shardings", "parse_mesh_spec", "resolve_axis_sizes",
    "resolve_expert_parallel", "rules_dict", "shard_batch", "sharding_table", "state_shardings", "state_specs",
    "with_logical_constraint", "without_mesh_axis",
]

# Names that live in the layers above (training, decoding), still reachable from here.
# Resolved on first use, so importing this package never imports those layers.
_ABOVE = {"TrainState": "lineage_jax.train.step", "TrainStep": "lineage_jax.train.step",
          "init_sharded": "lineage_jax.train.step", "next_token_loss": "lineage_jax.train.step",
          "ShardedDecoder": "lineage_jax.generate"}


def __getattr__(name):
    if name in _ABOVE:
        return getattr(importlib.import_module(_ABOVE[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
