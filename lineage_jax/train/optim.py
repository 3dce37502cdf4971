"""Optimizers: AdamW with warmup + cosine, clipping and a weight-decay mask; optional Muon."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from lineage_jax.train.config import TrainConfig


def schedule(cfg: TrainConfig) -> optax.Schedule:
    warmup = min(cfg.warmup_steps, max(cfg.steps - 1, 0))
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0 if warmup else cfg.lr, peak_value=cfg.lr, warmup_steps=warmup,
        decay_steps=max(cfg.steps, warmup + 1), end_value=cfg.lr * cfg.min_lr_ratio)


NO_DECAY = ("scale", "bias", "A_log", "dt_bias", "res_query", "final_query")


def decay_mask(params):
    """Decay matrices only: no weight decay on norms, biases (``bias``, ``*_bias``), gates' scalars or
    embedding tables. A weight is a matrix when it has two axes besides a scanned stack's ``layers``
    axis (read from its ``logical_axes``; ``ndim`` where a leaf has none)."""
    def keep(path, leaf):
        names = [str(getattr(p, "key", getattr(p, "name", p))) for p in path]
        if names[:1] and names[0] in ("embed", "pos"):
            return False
        if any(n in NO_DECAY or n.endswith("_bias") for n in names):
            return False
        axes = leaf.get_metadata().get("logical_axes") if isinstance(leaf, nnx.Variable) else None
        if axes:
            return sum(a != "layers" for a in axes) >= 2
        value = leaf.get_value() if isinstance(leaf, nnx.Variable) else leaf
        return getattr(value, "ndim", 0) >= 2

    def mark(path, leaf):
        k = keep(path, leaf)
        return leaf.replace(value=k) if isinstance(leaf, nnx.Variable) else k

    return jax.tree_util.tree_map_with_path(mark, params, is_leaf=lambda x: isinstance(x, nnx.Variable))


BATCH_AXES = ("layers", "heads", "kv_heads", "experts")


def muon_dims(params):
    """Per-head Muon: orthogonalize each head's (and expert's, layer's) ``[in, out]`` matrix.

    Reads each parameter's ``logical_axes`` metadata: axes named in ``BATCH_AXES`` are
    batch dimensions; of the rest, the first is the input (reduction) axis and the
    others the output. Tables (embedding, positions, LM head) and anything with fewer
    than two matrix axes stay on AdamW (``None``).
    """
    def dims(path, var):
        names = [str(getattr(p, "key", getattr(p, "name", p))) for p in path]
        ax = var.get_metadata().get("logical_axes") or ()
        matrix = [i for i, a in enumerate(ax) if a not in BATCH_AXES]
        if names[0] in ("embed", "pos", "head") or len(matrix) < 2:
            return var.replace(value=None)
        return var.replace(value=optax.contrib.MuonDimensionNumbers(reduction_axis=(matrix[0],),
                                                                     output_axis=tuple(matrix[1:])))
    return jax.tree_util.tree_map_with_path(dims, params, is_leaf=lambda x: isinstance(x, nnx.Variable))


def decoupled_decay(lr: optax.Schedule, weight_decay: float, mask) -> optax.GradientTransformation:
    """Adds ``-lr(step) · weight_decay · param`` to the updates of the leaves ``mask`` marks (AdamW's decoupled
    decay, applied after the updates are scaled); its own step count, as optax's learning-rate scaling keeps."""
    def init(params):
        del params
        return optax.ScaleByScheduleState(count=jnp.zeros([], jnp.int32))

    def update(updates, state, params=None):
        if params is None:
            raise ValueError("decoupled_decay: the update needs `params`")
        rate = lr(state.count) * weight_decay
        updates = jax.tree.map(lambda u, p, m: (u - rate * p).astype(u.dtype) if m else u, updates, params, mask)
        return updates, optax.ScaleByScheduleState(count=optax.safe_increment(state.count))

    return optax.GradientTransformation(init, update)


def make_optimizer(cfg: TrainConfig, params) -> optax.GradientTransformation:
    """The chain: global-norm clipping, then AdamW (or per-head Muon with AdamW for tables and vectors).
    Weight decay follows :func:`decay_mask` in both: under Muon the matrices Muon orthogonalizes decay inside
    it, the AdamW side's matrices (an untied LM head) by :func:`decoupled_decay` (optax's Muon decays its
    whole AdamW side, norms, biases and tables included)."""
    lr = schedule(cfg)
    mask = decay_mask(params)
    if cfg.optimizer == "adamw":
        return optax.chain(optax.clip_by_global_norm(cfg.grad_clip),
                           optax.adamw(lr, b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay, mask=mask))
    dims = muon_dims(params)
    inner = optax.contrib.muon(lr, weight_decay=cfg.weight_decay, weight_decay_mask=mask,
                               adam_b1=cfg.b1, adam_b2=cfg.b2, adam_weight_decay=0.0,
                               muon_weight_dimension_numbers=dims)
    adam_side = jax.tree.map(lambda m, d: m.replace(value=bool(m.get_value()) and d.get_value() is None),
                             mask, dims, is_leaf=lambda x: isinstance(x, nnx.Variable))  # decayed, not Muon's
    return optax.chain(optax.clip_by_global_norm(cfg.grad_clip), inner,
                       decoupled_decay(lr, cfg.weight_decay, adam_side))
