"""The training state, the sharded initialisation and the jitted train / eval steps.

The model lives as ``graphdef`` + pure pytrees (``params``: every ``nnx.Param``;
``rest``: non-trainable variables such as MoE router biases), so the whole state
(:class:`TrainState`) is one pytree that optax updates, orbax saves and ``jax.jit`` shards.

On a device mesh (:class:`Parallel`, built by :func:`make_parallel` from
``TrainConfig.mesh``) the same step runs sharded: the state is born sharded by the
logical-axis rules of :mod:`lineage_jax.parallel` (parameters, optimizer moments laid
out like their parameters, router biases; :func:`state_shardings`), activations are
constrained by the same rules, and MoE layers run expert-parallel (``shard_map`` +
all-to-all) when the mesh has an ``expert`` axis. One code path: a one-device run is the
same step with ``parallel=None``.

Two entry points share that state and its shardings:

* from configs — :func:`init_state`, :func:`make_train_step` / :func:`make_eval_step`,
  :func:`jit_steps` (what ``python -m lineage_jax.train`` runs: the optimizer and
  schedule of ``TrainConfig``, batches of ``tokens`` / ``targets`` / ``mask``);
* from a built model — :func:`init_sharded` (a model whose variables are born sharded)
  and :class:`TrainStep` (any ``optax`` transformation and loss, default
  :func:`next_token_loss` on batches of ``tokens``; the loss-and-gradient and the update
  are two jitted phases that can also be called apart)::

    mesh = make_mesh(parse_mesh_spec("data=2,expert=4"))
    model = init_sharded(get_config("tiny_kimi_linear"), mesh)
    trainer = TrainStep(model, mesh, optax.adamw(3e-4))
    state = trainer.init(model)
    state, metrics = trainer(state, trainer.shard_batch({"tokens": tokens}))
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import numbers
from typing import Any, Callable, NamedTuple, Optional, Union

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from lineage_jax.layers.moe import BIAS_RULES, RouterStats
from lineage_jax.models import Decoder, ModelConfig
from lineage_jax.parallel.expert import (ExpertParallel, check_num_experts, enable_expert_parallel,
                                         resolve_expert_parallel)
from lineage_jax.parallel.mesh import make_mesh, mesh_shape, parse_mesh_spec
from lineage_jax.parallel.rules import (Rules, check_mesh, logical_sharding, mesh_axes_of, optimizer_shardings,
                                        shard_batch, with_logical_constraint)
from lineage_jax.parallel.rules import state_shardings as variable_shardings
from lineage_jax.train.config import TrainConfig
from lineage_jax.train.optim import make_optimizer, schedule

Array = jax.Array


LossFn = Callable[[nnx.Module, dict], tuple[Array, dict]]


class TrainState(NamedTuple):
    """Everything a training step reads and writes, as one pytree."""

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
        return logical_sharding(self.mesh, self.rules)

    def shard_batch(self, batch):
        """Host batch (this process's rows) -> global arrays split over the batch mesh axes."""
        return shard_batch(batch, self.mesh, self.rules)


def parse_dcn_spec(spec: str) -> dict:
    """``TrainConfig.mesh_dcn`` (``"data=2"``; ``""``: one slice) -> axis sizes, each a positive int
    (a ``ValueError`` naming ``mesh_dcn`` otherwise: the slices are counted, not inferred)."""
    try:
        sizes = parse_mesh_spec(spec)
    except ValueError as e:
        raise ValueError(f"mesh_dcn {spec!r}: {e}") from None
    bad = [a for a, n in sizes.items() if n < 1]
    if bad:
        raise ValueError(f"mesh_dcn {spec!r}: axis {bad[0]!r} must span a positive number of slices/processes, "
                         f"got {sizes[bad[0]]}")
    return sizes


def make_parallel(model_cfg: ModelConfig, mesh_spec: str, devices=None,
                  batch_size: Optional[int] = None, mesh_dcn: str = "") -> Optional[Parallel]:
    """``TrainConfig.mesh`` (e.g. ``"data=2,expert=4"``) -> a :class:`Parallel`, or ``None``
    when the mesh has one device (the plain single-device step). ``mesh_dcn``
    (``TrainConfig.mesh_dcn``, e.g. ``"data=2"``): how many TPU slices or GPU processes each axis
    spans, ``mesh_spec`` then being the shape within one (:func:`~lineage_jax.parallel.make_mesh`'s
    ``dcn``; sizes are positive, no ``-1``).

    Raises ``ValueError`` naming ``mesh`` (or ``mesh_dcn``) when it does not match the devices, when
    the model's experts do not divide over the ``expert`` axis, or when the global
    ``batch_size`` does not split evenly over the batch mesh axes (data × fsdp × expert).
    """
    sizes = parse_mesh_spec(mesh_spec)
    dcn = parse_dcn_spec(mesh_dcn)
    devices = list(jax.devices() if devices is None else devices)
    where = f"mesh {mesh_spec!r}" + (f" with mesh_dcn {mesh_dcn!r}" if mesh_dcn else "")
    processes = len({d.process_index for d in devices})
    if all(s == 1 for s in sizes.values()) and all(s == 1 for s in dcn.values()):
        if processes > 1:  # each process would train a copy of its own on its first device, never synchronised
            raise ValueError(f"{where}: one device, but the devices belong to {processes} processes: give a mesh "
                             f"over all {len(devices)} devices (e.g. data=-1 for data parallelism)")
        return None
    try:
        mesh = make_mesh(sizes, devices=devices, dcn=dcn if any(s > 1 for s in dcn.values()) else None)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    batch_ways = math.prod(mesh_shape(mesh)[a] for a in mesh_axes_of("batch"))
    if batch_size is not None and batch_size % batch_ways:
        raise ValueError(f"batch_size={batch_size} does not split over the batch mesh axes of mesh {mesh_spec!r} "
                         f"({batch_ways} ways: data × fsdp × expert); use a multiple of {batch_ways}")
    if batch_size is not None and processes > 1:
        _check_process_rows(mesh, batch_size, processes, where)
    ep = None  # a dense model's weights use the expert axis as more FSDP (the rules' table)
    if mesh_shape(mesh)["expert"] > 1 and model_cfg.num_experts > 0:
        try:
            check_num_experts(model_cfg.num_experts, mesh, None)
        except ValueError as e:
            raise ValueError(f"mesh {mesh_spec!r}: {e}") from None
        ep = ExpertParallel(mesh)
    return Parallel(mesh, None, ep)


def _check_process_rows(mesh: Mesh, batch_size: int, processes: int, where: str) -> None:
    """Each process reads its own ``batch_size / processes`` rows (``train.inputs``): the batch axes must give
    every process's devices a disjoint share of that size — a ``ValueError`` naming the mesh otherwise."""
    sharding = NamedSharding(mesh, P(tuple(a for a in mesh_axes_of("batch") if a in mesh.shape)))
    rows: dict[int, set] = {}
    for device, index in sharding.devices_indices_map((batch_size,)).items():
        rows.setdefault(device.process_index, set()).update(range(*index[0].indices(batch_size)))
    share = batch_size // processes
    if any(len(r) != share for r in rows.values()) or sum(len(r) for r in rows.values()) != batch_size:
        raise ValueError(f"{where}: the batch axes (data × fsdp × expert) do not split the batch between the "
                         f"{processes} processes (each reads {share} rows of its own): put an axis that crosses "
                         f"processes among them, e.g. --mesh-dcn data={processes}")


def _abstract_model(model_cfg: ModelConfig, seed: int):
    return nnx.eval_shape(lambda: Decoder(model_cfg, rngs=nnx.Rngs(seed)))


def state_shardings(graphdef_params_rest, tx: optax.GradientTransformation, parallel: Parallel) -> TrainState:
    """``NamedSharding`` per leaf of the :class:`TrainState` for ``(params, rest)`` (abstract or not):
    parameters and other variables by the rules, optimizer buffers like their parameters,
    the step and the RNG replicated."""
    params, rest = graphdef_params_rest
    replicated = NamedSharding(parallel.mesh, P())
    param_sh = variable_shardings(params, parallel.mesh, parallel.rules)
    return TrainState(replicated, param_sh, variable_shardings(rest, parallel.mesh, parallel.rules),
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
        enable_expert_parallel(model, parallel.expert_parallel)
    return model


def loss_fn(params, rest, graphdef, batch: dict[str, Array], parallel: Optional[Parallel] = None):
    """Cross-entropy of ``batch["targets"]`` (over ``batch["mask"]``) and ``(accuracy, aux)``."""
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
    (see :func:`jit_steps` for the sharded wrapping)."""
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


# ----------------------------------------------------------------------------- from a built model
def next_token_loss(model: nnx.Module, batch: dict) -> tuple[Array, dict]:
    """Mean next-token cross-entropy of ``model.forward``.

    ``batch`` in either of two forms:

    * ``tokens [B, T]`` int, optional ``segment_ids [B, T]`` (packed documents: no prediction across a
      boundary) and ``loss_mask [B, T]`` (1 where the *target* token counts): each token predicts the next;
    * the data pipeline's (``lineage_jax.data``): ``tokens``, ``targets [B, T]`` (the token each position
      predicts) and optional ``mask [B, T]`` (1 where position ``t``'s prediction counts) and ``segment_ids``
      — what :func:`loss_fn` takes.

    A batch mixing the two (``loss_mask`` with ``targets`` or ``mask``) is refused.
    Returns ``(loss, aux)`` with ``aux = {"moe": router stats, "num_tokens": predicted tokens}``.
    """
    tokens = batch["tokens"]
    if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise ValueError(f"next_token_loss: `batch['tokens']` must be an integer array [B, T], got "
                         f"{tokens.dtype}{tuple(tokens.shape)}")
    pipeline = "targets" in batch or "mask" in batch
    if pipeline and "loss_mask" in batch:
        raise ValueError("next_token_loss: `batch` holds `loss_mask` (the next-token form) and `targets` / `mask` "
                         "(the data pipeline's); give one form")
    if pipeline and "targets" not in batch:
        raise ValueError("next_token_loss: `batch['mask']` is the data pipeline's and needs `batch['targets']`")
    if not pipeline and tokens.shape[1] < 2:
        raise ValueError(f"next_token_loss: `batch['tokens']` needs T >= 2 to predict a next token, got {tokens.shape}")
    segment_ids = batch.get("segment_ids")
    tokens = with_logical_constraint(tokens, ("batch", "seq"))
    logits, aux = model.forward(tokens, segment_ids=segment_ids)
    logits = with_logical_constraint(logits, ("batch", "seq", "vocab"))
    if pipeline:
        targets = batch["targets"]
        if tuple(targets.shape) != tuple(tokens.shape):
            raise ValueError(f"next_token_loss: `batch['targets']` must have the shape of `tokens` "
                             f"{tuple(tokens.shape)}, got {tuple(targets.shape)}")
        mask = batch.get("mask", jnp.ones(targets.shape, jnp.float32)).astype(jnp.float32)
        loss, _ = cross_entropy(logits, targets, mask)
        return loss, {"moe": aux.get("moe", ()), "num_tokens": jnp.sum(mask)}
    logits = logits[:, :-1].astype(jnp.float32)
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


def init_sharded(model: Union[Callable[[], nnx.Module], ModelConfig], mesh: Mesh, *, rules: Optional[Rules] = None,
                 strict: bool = False, seed: int = 0) -> nnx.Module:
    """Build a model with every variable born sharded on ``mesh``.

    ``model`` is a ``ModelConfig`` (a ``Decoder`` seeded with ``seed``) or a zero-argument
    constructor. The constructor runs under ``jax.jit`` with ``out_shardings`` derived by the
    rules (:func:`lineage_jax.parallel.rules.state_shardings`) from ``nnx.eval_shape``, so
    no device ever holds a full copy.
    """
    check_mesh("init_sharded", mesh, rules)
    if isinstance(model, ModelConfig):
        config = model
        factory = lambda: Decoder(config, rngs=nnx.Rngs(seed))  # noqa: E731
    elif callable(model) and not isinstance(model, nnx.Module):
        factory = model
    else:
        raise ValueError(f"init_sharded: `model` must be a ModelConfig or a zero-argument constructor, got {type(model)}")
    graphdef, abstract_state = nnx.split(nnx.eval_shape(factory))
    shardings = variable_shardings(abstract_state, mesh, rules, strict=strict)
    state = jax.jit(lambda: nnx.state(factory()), out_shardings=shardings)()
    return nnx.merge(graphdef, state)


class TrainStep:
    """A jitted, sharded training step for a built ``model`` on ``mesh``.

    The state is a :class:`TrainState` laid out by :func:`state_shardings`; the batch is
    split over the ``batch`` mesh axes; MoE layers run expert-parallel when the mesh has an
    expert axis.

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
        check_mesh("TrainStep", mesh, rules)
        if (isinstance(router_bias_rate, bool) or not isinstance(router_bias_rate, numbers.Real)
                or not 0 <= router_bias_rate < math.inf):
            raise ValueError(f"TrainStep: `router_bias_rate` must be a finite number >= 0, got {router_bias_rate!r}")
        if router_bias_rule not in BIAS_RULES:
            raise ValueError(f"TrainStep: `router_bias_rule` must be one of {BIAS_RULES}, got {router_bias_rule!r}")
        self.mesh, self.rules, self.loss_fn = mesh, rules, loss_fn
        self.tx = optax.adamw(3e-4, b1=0.9, b2=0.95, weight_decay=0.1) if tx is None else tx
        self.expert_parallel = resolve_expert_parallel(model, mesh, rules, expert_parallel)
        self.parallel = Parallel(mesh, rules, self.expert_parallel)
        self.router_bias_rate, self.router_bias_rule = float(router_bias_rate), router_bias_rule
        self.graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        narrow = [(jax.tree_util.keystr(path), leaf.dtype) for path, leaf in jax.tree_util.tree_leaves_with_path(params)
                  if jnp.issubdtype(leaf.dtype, jnp.floating) and jnp.dtype(leaf.dtype).itemsize < 4]
        if narrow:  # the optimizer state would follow them: bf16 moments, updates rounded away
            raise ValueError(f"TrainStep: `model` must hold float32 master weights; {len(narrow)} parameters are "
                             f"16-bit, e.g. {narrow[0][0]} ({narrow[0][1]}) — a model from hf.load(dtype='bfloat16') "
                             f"is for inference: load it in float32 to train")
        replicated = NamedSharding(mesh, P())
        self.state_shardings = state_shardings((params, rest), self.tx, self.parallel)
        param_sh = self.state_shardings.params
        # Two jitted phases (one compile of forward + backward serves both `loss_and_grad`
        # and the step; the optimizer update is a cheap second program).
        self._grad = jax.jit(self._loss_and_grad, in_shardings=(self.state_shardings, None),
                             out_shardings=(replicated, replicated, param_sh, None))
        self._apply = jax.jit(self._apply_gradients, in_shardings=(self.state_shardings, param_sh, None),
                              out_shardings=self.state_shardings, donate_argnums=(0,) if donate else ())
        self._init = jax.jit(lambda params, rest, rng: TrainState(jnp.zeros((), jnp.int32), params, rest,
                                                                  self.tx.init(params), rng),
                             out_shardings=self.state_shardings)

    # ------------------------------------------------------------------ pieces
    def model(self, state: TrainState) -> nnx.Module:
        """The model holding ``state``'s parameters and variables."""
        return nnx.merge(self.graphdef, state.params, state.rest)

    def shard_batch(self, batch):
        return self.parallel.shard_batch(batch)

    def _forward_loss(self, params, rest, batch):
        model = _merge(self.graphdef, params, rest, self.parallel)
        with self.parallel.context():
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
        return TrainState(state.step + 1, optax.apply_updates(state.params, updates), rest, opt_state, state.rng)

    # ------------------------------------------------------------------ public
    def init(self, model: nnx.Module, seed: int = 0) -> TrainState:
        """A sharded ``TrainState`` (step 0, fresh optimizer state, RNG from ``seed``) from
        ``model``'s variables."""
        _, params, rest = nnx.split(model, nnx.Param, ...)
        return self._init(params, rest, jax.random.key_data(jax.random.key(seed)))

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
