"""Sharded init, train step and decode: ``jax.jit`` with ``NamedSharding`` in/out shardings.

* :func:`init_sharded` — parameters are *born* sharded: the constructor runs under
  ``jax.jit`` with ``out_shardings`` derived (by the rules) from ``nnx.eval_shape``, so
  no device ever holds a full copy.
* :class:`TrainStep` — ``loss_fn(model, batch)`` (default :func:`next_token_loss`) +
  ``optax`` (default AdamW), parameters / optimizer state / router biases kept in the
  shardings of the rules, the batch split over the ``batch`` mesh axes, and MoE layers
  expert-parallel (``parallel.expert``) when the mesh has an expert axis.
* :class:`ShardedDecoder` — ``init_cache`` / ``prefill`` / ``decode`` with the cache split
  over the batch.

Typical use::

    mesh = make_mesh(parse_mesh_spec("data=2,expert=4"))
    model = init_sharded(get_config("tiny_kimi_linear"), mesh)
    trainer = TrainStep(model, mesh, optax.adamw(3e-4))
    state = trainer.init(model)
    state, metrics = trainer(state, trainer.shard_batch({"tokens": tokens}))
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from lineage_jax.layers.moe import RouterStats
from lineage_jax.parallel.expert import ExpertParallel, check_num_experts, enable_expert_parallel
from lineage_jax.parallel.mesh import mesh_shape
from lineage_jax.parallel.rules import (Rules, logical_sharding, logical_to_spec, mesh_axes_of, state_shardings,
                                        with_logical_constraint)

Array = jax.Array
LossFn = Callable[[nnx.Module, dict], tuple[Array, dict]]


# ----------------------------------------------------------------------------- loss
def next_token_loss(model: nnx.Module, batch: dict) -> tuple[Array, dict]:
    """Mean next-token cross-entropy of ``model.forward``.

    ``batch``: ``tokens [B, T]`` int; optional ``segment_ids [B, T]`` (packed documents: no
    prediction across a boundary) and ``loss_mask [B, T]`` (1 where the *target* token counts).
    Returns ``(loss, aux)`` with ``aux = {"moe": router stats, "num_tokens": predicted tokens}``.
    """
    tokens = batch["tokens"]
    if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise ValueError(f"next_token_loss: `batch['tokens']` must be an integer array [B, T], got "
                         f"{tokens.dtype}{tuple(tokens.shape)}")
    if tokens.shape[1] < 2:
        raise ValueError(f"next_token_loss: `batch['tokens']` needs T >= 2 to predict a next token, got {tokens.shape}")
    segment_ids = batch.get("segment_ids")
    tokens = with_logical_constraint(tokens, ("batch", "seq"))
    logits, aux = model.forward(tokens, segment_ids=segment_ids)
    logits = with_logical_constraint(logits, ("batch", "seq", "vocab"))[:, :-1].astype(jnp.float32)
    targets = tokens[:, 1:]
    mask = jnp.ones(targets.shape, jnp.float32)
    if segment_ids is not None:
        mask = mask * (segment_ids[:, 1:] == segment_ids[:, :-1])
    if batch.get("loss_mask") is not None:
        mask = mask * batch["loss_mask"][:, 1:].astype(jnp.float32)
    target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    nll = jax.nn.logsumexp(logits, axis=-1) - target_logit
    count = jnp.sum(mask)
    loss = jnp.sum(nll * mask) / jnp.maximum(count, 1.0)
    return loss, {"moe": aux.get("moe", ()), "num_tokens": count}


def _tokens_dropped(moe_aux) -> Array:
    stats = [s for s in jax.tree.leaves(moe_aux, is_leaf=lambda x: isinstance(x, RouterStats))
             if isinstance(s, RouterStats)]
    return sum((jnp.sum(s.tokens_dropped) for s in stats), jnp.zeros((), jnp.int32))


# ----------------------------------------------------------------------------- init
def _factory(model: Union[Callable[[], nnx.Module], Any], seed: int) -> Callable[[], nnx.Module]:
    from lineage_jax.models.config import ModelConfig
    from lineage_jax.models.decoder import Decoder

    if isinstance(model, ModelConfig):
        return lambda: Decoder(model, rngs=nnx.Rngs(seed))
    if callable(model) and not isinstance(model, nnx.Module):
        return model
    raise ValueError(f"init_sharded: `model` must be a ModelConfig or a zero-argument constructor, got {type(model)}")


def init_sharded(model: Union[Callable[[], nnx.Module], Any], mesh: Mesh, *, rules: Optional[Rules] = None,
                 strict: bool = False, seed: int = 0) -> nnx.Module:
    """Build a model with every variable born sharded on ``mesh``.

    ``model`` is a ``ModelConfig`` (a ``Decoder`` seeded with ``seed``) or a zero-argument
    constructor. Shardings come from :func:`~lineage_jax.parallel.rules.state_shardings`.
    """
    factory = _factory(model, seed)
    abstract = nnx.eval_shape(factory)
    graphdef, abstract_state = nnx.split(abstract)
    shardings = state_shardings(abstract_state, mesh, rules, strict=strict)
    state = jax.jit(lambda: nnx.state(factory()), out_shardings=shardings)()
    return nnx.merge(graphdef, state)


# ----------------------------------------------------------------------------- batches
def batch_sharding(x, mesh: Mesh, rules: Optional[Rules] = None) -> NamedSharding:
    """``[B, ...]`` arrays: ``B`` over the ``batch`` mesh axes, the rest replicated."""
    return NamedSharding(mesh, logical_to_spec(("batch",) + (None,) * (x.ndim - 1), mesh, rules, shape=x.shape))


def shard_batch(batch, mesh: Mesh, rules: Optional[Rules] = None):
    """Place a pytree of ``[B, ...]`` host arrays on ``mesh``, split over the batch axes.

    One process: ``batch`` is the global batch. Several processes: each passes its own
    slice (``B / process_count`` rows) and gets the global array back.
    """
    def one(x):
        x = np.asarray(x) if not isinstance(x, jax.Array) else x
        if jax.process_count() == 1:
            return jax.device_put(x, batch_sharding(x, mesh, rules))
        global_shape = (x.shape[0] * jax.process_count(),) + tuple(x.shape[1:])
        sharding = batch_sharding(jax.ShapeDtypeStruct(global_shape, x.dtype), mesh, rules)
        return jax.make_array_from_process_local_data(sharding, np.asarray(x), global_shape)

    return jax.tree.map(one, batch)


# ----------------------------------------------------------------------------- expert parallelism
def _moe_layers(model: nnx.Module) -> list:
    from lineage_jax.layers.moe import MoE

    return [node for _, node in nnx.iter_graph(model) if isinstance(node, MoE)]


def resolve_expert_parallel(model: nnx.Module, mesh: Mesh, rules: Optional[Rules],
                            expert_parallel: Union[str, bool, ExpertParallel]) -> Optional[ExpertParallel]:
    """``"auto"``: on when the model has MoE layers and the expert mesh axis is > 1;
    ``True`` / ``False``; or a ready :class:`ExpertParallel`. Checks the experts divide."""
    if isinstance(expert_parallel, ExpertParallel):
        ep = expert_parallel
    elif expert_parallel is False:
        return None
    elif expert_parallel in ("auto", True):
        from lineage_jax.parallel.rules import DEFAULT_RULES

        ep = ExpertParallel(mesh, rules=DEFAULT_RULES if rules is None else rules)
        if expert_parallel == "auto" and ep.expert_size == 1:
            return None
    else:
        raise ValueError(f"`expert_parallel` must be 'auto', True, False or an ExpertParallel, got {expert_parallel!r}")
    moes = _moe_layers(model)
    if not moes:
        return None
    for moe in moes:
        check_num_experts(moe.num_experts, ep.mesh, ep.rules)
    return ep


# ----------------------------------------------------------------------------- training
def optimizer_shardings(tx: optax.GradientTransformation, params, param_shardings, mesh: Mesh):
    """Shardings of ``tx.init(params)``: every per-parameter buffer (Adam moments, Muon
    momentum) laid out like its parameter, everything else (counts, scalars) replicated.
    ``params`` may be abstract."""
    replicated = NamedSharding(mesh, P())
    abstract_opt = jax.eval_shape(tx.init, params)
    return optax.tree_map_params(tx, lambda _, s: s, abstract_opt, param_shardings,
                                 transform_non_params=lambda _: replicated,
                                 is_leaf=lambda x: isinstance(x, nnx.Variable))


class TrainState(NamedTuple):
    step: Array
    params: nnx.State      # the nnx.Param variables
    opt_state: Any
    rest: nnx.State        # every other variable (router score-correction biases)


class TrainStep:
    """A jitted, sharded training step for ``model`` on ``mesh``.

    Args:
      model: the (sharded, e.g. :func:`init_sharded`) model; only its structure is kept.
      mesh: the device mesh.
      tx: an ``optax`` transformation (default ``optax.adamw(3e-4, b2=0.95, weight_decay=0.1)``).
      loss_fn: ``loss_fn(model, batch) -> (loss, aux)``; default :func:`next_token_loss`.
        ``aux["moe"]`` (router stats), if present, feeds the drop count and bias updates.
      rules: logical-axis rules (default ``DEFAULT_RULES``).
      expert_parallel: ``"auto"`` (default), ``True``, ``False`` or an ``ExpertParallel``.
      router_bias_rate: if > 0, each step moves the MoE router biases by
        ``Decoder.update_router_biases(aux, rule=router_bias_rule, rate=router_bias_rate)``.
      donate: donate the incoming state's buffers to the step.

    Raises ``ValueError`` when expert parallelism is requested and some MoE's experts do
    not divide over the expert axis.
    """

    def __init__(self, model: nnx.Module, mesh: Mesh, tx: Optional[optax.GradientTransformation] = None, *,
                 loss_fn: LossFn = next_token_loss, rules: Optional[Rules] = None,
                 expert_parallel: Union[str, bool, ExpertParallel] = "auto", router_bias_rate: float = 0.0,
                 router_bias_rule: str = "sign", donate: bool = True):
        if router_bias_rate < 0:
            raise ValueError(f"TrainStep: `router_bias_rate` must be >= 0, got {router_bias_rate}")
        self.mesh, self.rules, self.loss_fn = mesh, rules, loss_fn
        self.tx = optax.adamw(3e-4, b1=0.9, b2=0.95, weight_decay=0.1) if tx is None else tx
        self.expert_parallel = resolve_expert_parallel(model, mesh, rules, expert_parallel)
        self.router_bias_rate, self.router_bias_rule = float(router_bias_rate), router_bias_rule
        self.graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        replicated = NamedSharding(mesh, P())
        param_sh = state_shardings(params, mesh, rules)
        opt_sh = optimizer_shardings(self.tx, params, param_sh, mesh)
        rest_sh = state_shardings(rest, mesh, rules)
        self.state_shardings = TrainState(replicated, param_sh, opt_sh, rest_sh)
        # Two jitted phases (one compile of forward + backward serves both `loss_and_grad`
        # and the step; the optimizer update is a cheap second program).
        self._grad = jax.jit(self._loss_and_grad, in_shardings=(self.state_shardings, None),
                             out_shardings=(replicated, replicated, param_sh, None))
        self._apply = jax.jit(self._apply_gradients, in_shardings=(self.state_shardings, param_sh, None),
                              out_shardings=self.state_shardings, donate_argnums=(0,) if donate else ())
        self._init = jax.jit(lambda params, rest: TrainState(jnp.zeros((), jnp.int32), params,
                                                             self.tx.init(params), rest),
                             out_shardings=self.state_shardings)

    # ------------------------------------------------------------------ pieces
    def model(self, state: TrainState) -> nnx.Module:
        """The model holding ``state``'s parameters and variables."""
        return nnx.merge(self.graphdef, state.params, state.rest)

    def shard_batch(self, batch):
        return shard_batch(batch, self.mesh, self.rules)

    def _forward_loss(self, params, rest, batch):
        model = nnx.merge(self.graphdef, params, rest)
        if self.expert_parallel is not None:
            enable_expert_parallel(model, self.expert_parallel)
        with logical_sharding(self.mesh, self.rules):
            loss, aux = self.loss_fn(model, batch)
        return loss, aux

    def _loss_and_grad(self, state: TrainState, batch):
        (loss, aux), grads = jax.value_and_grad(self._forward_loss, has_aux=True)(state.params, state.rest, batch)
        moe_aux = aux.get("moe", ()) if isinstance(aux, dict) else ()
        metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads), "tokens_dropped": _tokens_dropped(moe_aux),
                   "num_tokens": aux.get("num_tokens", jnp.zeros(())) if isinstance(aux, dict) else jnp.zeros(())}
        rest = None                                   # None: router biases unchanged
        if self.router_bias_rate > 0 and moe_aux:
            model = nnx.merge(self.graphdef, state.params, state.rest)
            if hasattr(model, "update_router_biases"):
                model.update_router_biases(aux, rule=self.router_bias_rule, rate=self.router_bias_rate)
                rest = nnx.state(model, nnx.Not(nnx.Param))
        return loss, metrics, grads, rest

    def _apply_gradients(self, state: TrainState, grads, rest):
        updates, opt_state = self.tx.update(grads, state.opt_state, state.params)
        rest = state.rest if rest is None else rest
        return TrainState(state.step + 1, optax.apply_updates(state.params, updates), opt_state, rest)

    # ------------------------------------------------------------------ public
    def init(self, model: nnx.Module) -> TrainState:
        """A sharded ``TrainState`` (step 0, fresh optimizer state) from ``model``'s variables."""
        _, params, rest = nnx.split(model, nnx.Param, ...)
        return self._init(params, rest)

    def loss_and_grad(self, state: TrainState, batch) -> tuple[Array, dict, nnx.State]:
        """``(loss, metrics, grads)`` without updating anything; ``grads`` are laid out like
        the parameters. ``metrics``: ``loss, grad_norm, tokens_dropped, num_tokens``."""
        loss, metrics, grads, _ = self._grad(state, batch)
        return loss, metrics, grads

    def apply_gradients(self, state: TrainState, grads: nnx.State, rest: Optional[nnx.State] = None) -> TrainState:
        """One optimizer update of ``state`` with ``grads`` (and new router biases ``rest``)."""
        return self._apply(state, grads, rest)

    def __call__(self, state: TrainState, batch) -> tuple[TrainState, dict]:
        """One training step: ``(new_state, metrics)`` (the input state is donated)."""
        _, metrics, grads, rest = self._grad(state, batch)
        return self._apply(state, grads, rest), metrics


# ----------------------------------------------------------------------------- decoding
class ShardedDecoder:
    """Jitted ``init_cache`` / ``prefill`` / ``decode`` of a ``Decoder`` on ``mesh``.

    Parameters keep the rules' shardings; every cache array is split over the batch mesh
    axes along its batch dimension (dimension 1 for scanned layer groups, 0 otherwise).
    ``expert_parallel="auto"`` uses expert parallelism when the batch (the tokens of one
    decode step) divides over the batch mesh axes.
    """

    def __init__(self, model: nnx.Module, mesh: Mesh, *, batch_size: int, max_len: int,
                 rules: Optional[Rules] = None, expert_parallel: Union[str, bool, ExpertParallel] = "auto",
                 cache_dtype=jnp.float32):
        for name, val in (("batch_size", batch_size), ("max_len", max_len)):
            if isinstance(val, bool) or not isinstance(val, int) or val <= 0:
                raise ValueError(f"ShardedDecoder: `{name}` must be a positive int, got {val!r}")
        if not hasattr(model, "groups_spec"):
            raise ValueError("ShardedDecoder: `model` must be a lineage_jax Decoder")
        self.mesh, self.rules, self.batch_size = mesh, rules, batch_size
        sizes = mesh_shape(mesh)
        batch_axes = [a for a in mesh_axes_of("batch", rules) if sizes.get(a, 1) > 1]
        if expert_parallel == "auto" and batch_size % int(np.prod([sizes[a] for a in batch_axes])):
            expert_parallel = False
        self.expert_parallel = resolve_expert_parallel(model, mesh, rules, expert_parallel)
        self.graphdef, state = nnx.split(model)
        self.state_shardings = state_shardings(state, mesh, rules)
        abstract_cache = jax.eval_shape(lambda: model.init_cache(batch_size, max_len, cache_dtype))
        self.cache_shardings = self._cache_shardings(model, abstract_cache)
        tok = NamedSharding(mesh, logical_to_spec(("batch",), mesh, rules, shape=(batch_size,)))
        logits2 = NamedSharding(mesh, logical_to_spec(("batch", None), mesh, rules, shape=(batch_size, 1)))
        logits3 = NamedSharding(mesh, logical_to_spec(("batch", None, None), mesh, rules, shape=(batch_size, 1, 1)))
        self._init_cache = jax.jit(lambda: model.init_cache(batch_size, max_len, cache_dtype),
                                   out_shardings=self.cache_shardings)
        self._prefill = jax.jit(self._prefill_impl, in_shardings=(self.state_shardings, tok, self.cache_shardings),
                                out_shardings=(logits3, self.cache_shardings), donate_argnums=(2,))
        self._decode = jax.jit(self._decode_impl, in_shardings=(self.state_shardings, tok, self.cache_shardings),
                               out_shardings=(logits2, self.cache_shardings), donate_argnums=(2,))

    def _cache_shardings(self, model, cache):
        def spec_for(leaf, batch_dim):
            axes = [None] * leaf.ndim
            axes[batch_dim] = "batch"
            return NamedSharding(self.mesh, logical_to_spec(axes, self.mesh, self.rules, shape=leaf.shape))

        layers = tuple(jax.tree.map(lambda leaf, d=(1 if n > 1 else 0): spec_for(leaf, d), group_cache)
                       for (_, _, n), group_cache in zip(model.groups_spec, cache.layers))
        return type(cache)(layers, spec_for(cache.length, 0))

    def _model(self, state):
        model = nnx.merge(self.graphdef, state)
        if self.expert_parallel is not None:
            enable_expert_parallel(model, self.expert_parallel)
        return model

    def _prefill_impl(self, state, tokens, cache):
        with logical_sharding(self.mesh, self.rules):
            return self._model(state).prefill(tokens, cache)

    def _decode_impl(self, state, token, cache):
        with logical_sharding(self.mesh, self.rules):
            return self._model(state).decode(token, cache)

    def init_cache(self):
        return self._init_cache()

    def prefill(self, state: nnx.State, tokens: Array, cache):
        """``tokens [B, T]`` -> ``(logits [B, T, vocab], cache)`` (``state = nnx.state(model)``)."""
        return self._prefill(state, tokens, cache)

    def decode(self, state: nnx.State, token: Array, cache):
        """``token [B]`` -> ``(logits [B, vocab], cache)``."""
        return self._decode(state, token, cache)
