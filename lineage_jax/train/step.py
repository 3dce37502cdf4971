"""The functional training state and the jitted train / eval steps.

The model lives as ``graphdef`` + pure pytrees (``params``: every ``nnx.Param``;
``rest``: non-trainable variables such as MoE router biases), so the whole state
is one pytree that optax updates, orbax saves and ``jax.jit`` shards.

On a device mesh (:class:`Parallel`, built by :func:`make_parallel` from
``TrainConfig.mesh``) the same step runs sharded: the state is born sharded by the
logical-axis rules of :mod:`lineage_jax.parallel` (parameters, optimizer moments laid
out like their parameters, router biases), activations are constrained by the same
rules, and MoE layers run expert-parallel (``shard_map`` + all-to-all) when the mesh
has an ``expert`` axis. One code path: a one-device run is the same step with
``parallel=None``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from lineage_jax.models import Decoder, ModelConfig
from lineage_jax.train.config import TrainConfig
from lineage_jax.train.optim import make_optimizer, schedule

Array = jax.Array


class TrainState(NamedTuple):
    step: Array  # int32 scalar
    params: Any  # nnx.State of nnx.Param leaves
    rest: Any  # nnx.State of the other variables (router biases)
    opt_state: Any
    rng: Array  # uint32 key data


@dataclasses.dataclass(frozen=True)
class Parallel:
    """How a step runs on a device mesh: the mesh, the logical-axis rules, expert parallelism."""

    mesh: Mesh
    rules: Any = None  # None: lineage_jax.parallel.DEFAULT_RULES
    expert_parallel: Any = None  # a lineage_jax.parallel.ExpertParallel, or None

    def context(self):
        from lineage_jax.parallel import logical_sharding

        return logical_sharding(self.mesh, self.rules)

    def shard_batch(self, batch):
        """Host batch (this process's rows) -> global arrays split over the batch mesh axes."""
        from lineage_jax.parallel import shard_batch

        return shard_batch(batch, self.mesh, self.rules)


def make_parallel(model_cfg: ModelConfig, mesh_spec: str, devices=None,
                  batch_size: Optional[int] = None) -> Optional[Parallel]:
    """``TrainConfig.mesh`` (e.g. ``"data=2,expert=4"``) -> a :class:`Parallel`, or ``None``
    when the mesh has one device (the plain single-device step).

    Raises ``ValueError`` naming ``mesh`` when it does not match the devices, when the
    model's experts do not divide over the ``expert`` axis, or when the global
    ``batch_size`` does not split evenly over the batch mesh axes (data × fsdp × expert).
    """
    from lineage_jax.parallel import (ExpertParallel, check_num_experts, make_mesh, mesh_axes_of, mesh_shape,
                                      parse_mesh_spec)

    sizes = parse_mesh_spec(mesh_spec)
    devices = list(jax.devices() if devices is None else devices)
    if all(s == 1 for s in sizes.values()):
        return None
    try:
        mesh = make_mesh(sizes, devices=devices)
    except ValueError as e:
        raise ValueError(f"mesh {mesh_spec!r}: {e}") from None
    batch_ways = math.prod(mesh_shape(mesh)[a] for a in mesh_axes_of("batch"))
    if batch_size is not None and batch_size % batch_ways:
        raise ValueError(f"batch_size={batch_size} does not split over the batch mesh axes of mesh {mesh_spec!r} "
                         f"({batch_ways} ways: data × fsdp × expert); use a multiple of {batch_ways}")
    ep = None  # a dense model's weights use the expert axis as more FSDP (the rules' table)
    if mesh_shape(mesh)["expert"] > 1 and model_cfg.num_experts > 0:
        try:
            check_num_experts(model_cfg.num_experts, mesh, None)
        except ValueError as e:
            raise ValueError(f"mesh {mesh_spec!r}: {e}") from None
        ep = ExpertParallel(mesh)
    return Parallel(mesh, None, ep)


def _abstract_model(model_cfg: ModelConfig, seed: int):
    return nnx.eval_shape(lambda: Decoder(model_cfg, rngs=nnx.Rngs(seed)))


def state_shardings(graphdef_params_rest, tx: optax.GradientTransformation, parallel: Parallel) -> TrainState:
    """``NamedSharding`` per leaf of the :class:`TrainState` for ``(params, rest)`` (abstract or not)."""
    from lineage_jax.parallel import optimizer_shardings, state_shardings as var_shardings

    params, rest = graphdef_params_rest
    replicated = NamedSharding(parallel.mesh, P())
    param_sh = var_shardings(params, parallel.mesh, parallel.rules)
    return TrainState(replicated, param_sh, var_shardings(rest, parallel.mesh, parallel.rules),
                      optimizer_shardings(tx, params, param_sh, parallel.mesh), replicated)


def init_state(model_cfg: ModelConfig, train_cfg: TrainConfig, parallel: Optional[Parallel] = None):
    """Build the model and optimizer; returns ``(graphdef, state, tx)``.

    With ``parallel`` the whole state is created inside one ``jax.jit`` whose
    ``out_shardings`` come from the rules, so no device ever holds a full copy; the
    values equal the single-device initialization.
    """
    graphdef, abstract_params, abstract_rest = nnx.split(_abstract_model(model_cfg, train_cfg.seed), nnx.Param, ...)
    tx = make_optimizer(train_cfg, abstract_params)

    def build():
        model = Decoder(model_cfg, rngs=nnx.Rngs(train_cfg.seed))
        _, params, rest = nnx.split(model, nnx.Param, ...)
        return TrainState(jnp.zeros((), jnp.int32), params, rest, tx.init(params),
                          jax.random.key_data(jax.random.key(train_cfg.seed + 1)))

    if parallel is None:
        return graphdef, build(), tx
    shardings = state_shardings((abstract_params, abstract_rest), tx, parallel)
    return graphdef, jax.jit(build, out_shardings=shardings)(), tx


def cross_entropy(logits: Array, targets: Array, mask: Array) -> tuple[Array, Array]:
    """Mean next-token cross-entropy over ``mask`` and the masked argmax accuracy."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    denom = jnp.maximum(jnp.sum(mask), 1.0)
    acc = jnp.sum((jnp.argmax(logits, -1) == targets) * mask) / denom
    return jnp.sum(nll * mask) / denom, acc


def _merge(graphdef, params, rest, parallel: Optional[Parallel]):
    model = nnx.merge(graphdef, params, rest)
    if parallel is not None and parallel.expert_parallel is not None:
        from lineage_jax.parallel import enable_expert_parallel

        enable_expert_parallel(model, parallel.expert_parallel)
    return model


def loss_fn(params, rest, graphdef, batch: dict[str, Array], parallel: Optional[Parallel] = None):
    from lineage_jax.parallel import with_logical_constraint

    model = _merge(graphdef, params, rest, parallel)
    with parallel.context() if parallel is not None else contextlib.nullcontext():
        tokens = with_logical_constraint(batch["tokens"], ("batch", "seq"))
        logits, aux = model.forward(tokens, segment_ids=batch.get("segment_ids"))
        logits = with_logical_constraint(logits, ("batch", "seq", "vocab"))
    mask = batch.get("mask", jnp.ones(batch["targets"].shape, jnp.float32))
    loss, acc = cross_entropy(logits, batch["targets"], mask)
    return loss, (acc, aux)


def make_train_step(graphdef, tx: optax.GradientTransformation, train_cfg: TrainConfig,
                    parallel: Optional[Parallel] = None):
    """``train_step(state, batch) -> (state, metrics)``, to be wrapped in ``jax.jit``
    (see :func:`jit_train_step` for the sharded wrapping)."""
    lr = schedule(train_cfg)

    def train_step(state: TrainState, batch: dict[str, Array]):
        (loss, (acc, aux)), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            state.params, state.rest, graphdef, batch, parallel)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        rest = state.rest
        if train_cfg.moe_bias_rule != "none" and jax.tree.leaves(rest):
            model = nnx.merge(graphdef, params, rest)
            model.update_router_biases(aux, rule=train_cfg.moe_bias_rule, rate=train_cfg.moe_bias_rate)
            _, _, rest = nnx.split(model, nnx.Param, ...)
        metrics = {"loss": loss, "accuracy": acc, "grad_norm": optax.tree.norm(grads), "lr": lr(state.step)}
        for s in (s for group in aux["moe"] for s in group if s is not None):
            metrics["moe_tokens_dropped"] = metrics.get("moe_tokens_dropped", 0) + jnp.sum(s.tokens_dropped)
            metrics["moe_max_load"] = jnp.maximum(metrics.get("moe_max_load", 0.0), jnp.max(s.load))
        return TrainState(state.step + 1, params, rest, opt_state, state.rng), metrics

    return train_step


def make_eval_step(graphdef, parallel: Optional[Parallel] = None):
    def eval_step(state: TrainState, batch: dict[str, Array]):
        loss, (acc, _) = loss_fn(state.params, state.rest, graphdef, batch, parallel)
        return {"loss": loss, "accuracy": acc}

    return eval_step


def compiler_options(train_cfg: TrainConfig, backend: Optional[str] = None) -> Optional[dict]:
    """XLA options of the jitted steps: ``TrainConfig.deterministic`` on a GPU turns on XLA's
    deterministic ops (``None``: nothing to set here)."""
    backend = backend or jax.default_backend()
    if train_cfg.deterministic and backend == "gpu":
        return {"xla_gpu_deterministic_ops": True}
    return None


def jit_steps(graphdef, tx, train_cfg: TrainConfig, state: TrainState, parallel: Optional[Parallel] = None):
    """The jitted ``(train_step, eval_step)``: state donated; on a mesh, the state keeps its
    shardings in and out and the metrics come back replicated."""
    train_step = make_train_step(graphdef, tx, train_cfg, parallel)
    eval_step = make_eval_step(graphdef, parallel)
    opts = compiler_options(train_cfg)
    if parallel is None:
        return (jax.jit(train_step, donate_argnums=(0,), compiler_options=opts),
                jax.jit(eval_step, compiler_options=opts))
    state_sh = jax.tree.map(lambda x: x.sharding, state)
    replicated = NamedSharding(parallel.mesh, P())
    return (jax.jit(train_step, in_shardings=(state_sh, None), out_shardings=(state_sh, replicated),
                    donate_argnums=(0,), compiler_options=opts),
            jax.jit(eval_step, in_shardings=(state_sh, None), out_shardings=replicated, compiler_options=opts))
