"""The functional training state and the jitted train / eval steps.

The model lives as ``graphdef`` + pure pytrees (``params``: every ``nnx.Param``;
``rest``: non-trainable variables such as MoE router biases), so the whole state
is one pytree that optax updates, orbax saves and ``jax.jit`` shards.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

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


def init_state(model_cfg: ModelConfig, train_cfg: TrainConfig):
    """Build the model and optimizer; returns ``(graphdef, state, tx)``."""
    model = Decoder(model_cfg, rngs=nnx.Rngs(train_cfg.seed))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    tx = make_optimizer(train_cfg, params)
    state = TrainState(jnp.zeros((), jnp.int32), params, rest, tx.init(params),
                       jax.random.key_data(jax.random.key(train_cfg.seed + 1)))
    return graphdef, state, tx


def cross_entropy(logits: Array, targets: Array, mask: Array) -> tuple[Array, Array]:
    """Mean next-token cross-entropy over ``mask`` and the masked argmax accuracy."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    denom = jnp.maximum(jnp.sum(mask), 1.0)
    acc = jnp.sum((jnp.argmax(logits, -1) == targets) * mask) / denom
    return jnp.sum(nll * mask) / denom, acc


def loss_fn(params, rest, graphdef, batch: dict[str, Array]):
    model = nnx.merge(graphdef, params, rest)
    logits, aux = model.forward(batch["tokens"], segment_ids=batch.get("segment_ids"))
    mask = batch.get("mask", jnp.ones(batch["targets"].shape, jnp.float32))
    loss, acc = cross_entropy(logits, batch["targets"], mask)
    return loss, (acc, aux)


def make_train_step(graphdef, tx: optax.GradientTransformation, train_cfg: TrainConfig):
    lr = schedule(train_cfg)

    def train_step(state: TrainState, batch: dict[str, Array]):
        (loss, (acc, aux)), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params, state.rest, graphdef, batch)
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


def make_eval_step(graphdef):
    def eval_step(state: TrainState, batch: dict[str, Array]):
        loss, (acc, _) = loss_fn(state.params, state.rest, graphdef, batch)
        return {"loss": loss, "accuracy": acc}

    return eval_step
