"""The training objective and optimiser against NumPy re-derivations: the masked cross-entropy and
accuracy (and their gradient), ``loss_fn``'s use of the batch mask, the warmup + cosine schedule, the
weight-decay mask, clipped AdamW step by step, and Muon's orthogonalised per-head updates."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from lineage_jax.models import Decoder, config_names, get_config
from lineage_jax.train import TrainConfig
from lineage_jax.train.optim import decay_mask, make_optimizer, schedule
from lineage_jax.train.step import cross_entropy, init_state, loss_fn


# ------------------------------------------------------------------------- cross-entropy
def _np_cross_entropy(logits, targets, mask):
    """float64: mean over the mask of -log softmax(logits)[target], the masked argmax accuracy, and
    the gradient of the loss with respect to the logits ((softmax - onehot) * mask / count)."""
    z = np.asarray(logits, np.float64)
    z = z - z.max(-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    nll = -np.take_along_axis(logp, targets[..., None], -1)[..., 0]
    count = max(float(mask.sum()), 1.0)
    hit = (np.argmax(logits, -1) == targets).astype(np.float64)
    onehot = np.eye(logits.shape[-1])[targets]
    dlogits = (np.exp(logp) - onehot) * mask[..., None] / count
    return float((nll * mask).sum() / count), float((hit * mask).sum() / count), dlogits


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_cross_entropy_matches_numpy_over_a_random_mask(seed):
    r = np.random.default_rng(seed)
    B, T, V = 3, 11, 17
    logits = (2.0 * r.normal(size=(B, T, V))).astype(np.float32)
    targets = r.integers(0, V, size=(B, T)).astype(np.int32)
    # Some targets are the argmax, so the accuracy is neither 0 nor 1.
    hit = r.random((B, T)) < 0.4
    targets[hit] = np.argmax(logits, -1)[hit]
    mask = (r.random((B, T)) < 0.6).astype(np.float32)
    assert 0 < mask.sum() < mask.size
    want_loss, want_acc, want_grad = _np_cross_entropy(logits, targets, mask)
    loss, acc = cross_entropy(jnp.asarray(logits), jnp.asarray(targets), jnp.asarray(mask))
    # Measured on seeds 0-2: loss 6.9e-8 relative, accuracy 1.1e-8 relative.
    np.testing.assert_allclose(float(loss), want_loss, rtol=3e-7)
    np.testing.assert_allclose(float(acc), want_acc, rtol=1e-7)
    grad = jax.grad(lambda z: cross_entropy(z, jnp.asarray(targets), jnp.asarray(mask))[0])(jnp.asarray(logits))
    # Measured: max |error| 6.6e-9 on entries up to 6e-2.
    np.testing.assert_allclose(grad, want_grad, rtol=0, atol=3e-8)
    assert np.all(np.asarray(grad)[mask == 0] == 0)   # masked positions get no gradient


def test_cross_entropy_of_an_empty_mask_is_zero_not_nan():
    logits = jnp.asarray(np.random.default_rng(3).normal(size=(2, 4, 5)), jnp.float32)
    loss, acc = cross_entropy(logits, jnp.zeros((2, 4), jnp.int32), jnp.zeros((2, 4), jnp.float32))
    assert float(loss) == 0.0 and float(acc) == 0.0


def test_loss_fn_uses_the_batch_mask():
    """``loss_fn`` (what the train and eval steps differentiate) is the cross-entropy of the model's
    logits over ``batch["mask"]``: compared with NumPy on the logits of ``model.forward``."""
    mc = get_config("tiny_gpt2")
    graphdef, state, _ = init_state(mc, TrainConfig(config="tiny_gpt2", steps=1))
    r = np.random.default_rng(4)
    B, T = 2, 12
    tokens = r.integers(0, mc.vocab_size, size=(B, T)).astype(np.int32)
    targets = r.integers(0, mc.vocab_size, size=(B, T)).astype(np.int32)
    mask = (r.random((B, T)) < 0.5).astype(np.float32)
    batch = {"tokens": jnp.asarray(tokens), "targets": jnp.asarray(targets), "mask": jnp.asarray(mask),
             "segment_ids": jnp.zeros((B, T), jnp.int32)}
    logits, _ = nnx.merge(graphdef, state.params, state.rest).forward(jnp.asarray(tokens))
    want_loss, want_acc, _ = _np_cross_entropy(np.asarray(logits), targets, mask)
    unmasked, _, _ = _np_cross_entropy(np.asarray(logits), targets, np.ones_like(mask))
    assert abs(unmasked - want_loss) > 1e-3             # the mask matters on these inputs
    loss, (acc, _) = jax.jit(loss_fn, static_argnums=(2,))(state.params, state.rest, graphdef, batch)
    # Measured: 3.3e-10 relative (the bound is float32's resolution); the accuracy exactly.
    np.testing.assert_allclose(float(loss), want_loss, rtol=1e-7)
    np.testing.assert_allclose(float(acc), want_acc, rtol=1e-7)


# ------------------------------------------------------------------------------ schedule
def _np_schedule(step, lr, warmup, steps, min_ratio):
    """Linear warmup from 0 to ``lr`` over ``warmup`` steps, then a half cosine down to
    ``lr * min_ratio`` at ``steps``, constant after."""
    if step < warmup:
        return lr * step / warmup
    frac = min((step - warmup) / (steps - warmup), 1.0)
    end = lr * min_ratio
    return end + (lr - end) * 0.5 * (1 + math.cos(math.pi * frac))


@pytest.mark.parametrize("lr, warmup, steps, ratio", [(3e-3, 20, 100, 0.1), (1e-2, 5, 12, 0.0), (2e-4, 1, 7, 0.5)])
def test_schedule_is_warmup_then_cosine(lr, warmup, steps, ratio):
    f = schedule(TrainConfig(lr=lr, warmup_steps=warmup, steps=steps, min_lr_ratio=ratio))
    # Measured (float32 rates against float64): at most 6.3e-7 relative.
    assert float(f(0)) == 0.0
    np.testing.assert_allclose(float(f(warmup)), lr, rtol=2e-7)
    np.testing.assert_allclose(float(f(steps)), lr * ratio, rtol=2e-7, atol=1e-12)
    for s in range(steps + 3):
        np.testing.assert_allclose(float(f(s)), _np_schedule(s, lr, warmup, steps, ratio), rtol=2e-6, atol=1e-12,
                                   err_msg=f"step {s}")
    # the peak: no step's rate exceeds lr
    assert max(float(f(s)) for s in range(steps + 1)) <= lr * (1 + 1e-6)


# --------------------------------------------------------------------------- decay mask
_NO_DECAY = ("scale", "A_log", "res_query", "final_query")


def _names(path):
    return [str(getattr(p, "key", getattr(p, "name", p))) for p in path]


@pytest.mark.parametrize("name", [n for n in config_names() if n.startswith("tiny_")])
def test_decay_mask_decays_matrices_only(name):
    """Per parameter of every tiny model: norms' scales, every bias (``bias``, ``*_bias``: ``dt_bias``,
    ``o_bias``), ``A_log``, the AttnRes queries and the embedding / position tables are not decayed;
    a weight is decayed when it has at least two axes besides the scanned ``layers`` axis."""
    model = nnx.eval_shape(lambda: Decoder(get_config(name), rngs=nnx.Rngs(0)))
    _, params, _ = nnx.split(model, nnx.Param, ...)
    mask = dict(nnx.to_flat_state(decay_mask(params)))
    wrong, kinds = [], set()
    for path, var in nnx.to_flat_state(params):
        names = _names(path)
        leaf = names[-1]
        axes = [a for a in (var.get_metadata().get("logical_axes") or ()) if a != "layers"]
        if names[0] in ("embed", "pos") or leaf in _NO_DECAY or leaf == "bias" or leaf.endswith("_bias"):
            want = False
        else:
            want = len(axes) >= 2
        got = mask[path]
        got = bool(got.get_value() if isinstance(got, nnx.Variable) else got)
        kinds.add((leaf, want))
        if got != want:
            wrong.append(("/".join(names), tuple(var.get_metadata().get("logical_axes") or ()), got))
    assert not wrong, f"decay_mask disagrees (path, axes, decayed): {wrong}"
    assert ("embed", False) in kinds and ("scale", False) in kinds and (True in {w for _, w in kinds})


# --------------------------------------------------------------------------- AdamW steps
def _np_adamw(cfg, params, grads_seq, decay):
    """float64 clip-by-global-norm + AdamW (decoupled, masked decay) with the warmup + cosine rate."""
    p = {k: np.asarray(v, np.float64) for k, v in params.items()}
    m = {k: np.zeros_like(v) for k, v in p.items()}
    v2 = {k: np.zeros_like(v) for k, v in p.items()}
    out = []
    for t, g in enumerate(grads_seq):
        g = {k: np.asarray(a, np.float64) for k, a in g.items()}
        norm = math.sqrt(sum(float(np.sum(a * a)) for a in g.values()))
        if norm > cfg.grad_clip:
            g = {k: a * cfg.grad_clip / norm for k, a in g.items()}
        lr = _np_schedule(t, cfg.lr, cfg.warmup_steps, cfg.steps, cfg.min_lr_ratio)
        for k in p:
            m[k] = cfg.b1 * m[k] + (1 - cfg.b1) * g[k]
            v2[k] = cfg.b2 * v2[k] + (1 - cfg.b2) * g[k] ** 2
            mhat, vhat = m[k] / (1 - cfg.b1 ** (t + 1)), v2[k] / (1 - cfg.b2 ** (t + 1))
            u = mhat / (np.sqrt(vhat) + 1e-8) + (cfg.weight_decay * p[k] if decay[k] else 0.0)
            p[k] = p[k] - lr * u
        out.append({k: a.copy() for k, a in p.items()})
    return out


def test_adamw_steps_match_numpy_with_clipping_schedule_and_decay_mask():
    """Five steps of ``make_optimizer`` (clipping, AdamW, decay mask, schedule) on a small tree whose
    gradient norms alternate above and below ``grad_clip``: every parameter after every step equals
    the float64 re-derivation."""
    cfg = TrainConfig(lr=0.05, warmup_steps=2, steps=6, min_lr_ratio=0.2, weight_decay=0.3, grad_clip=1.0,
                      b1=0.8, b2=0.9)
    r = np.random.default_rng(5)
    shapes = {("embed",): (6, 4), ("blk", "w", "kernel"): (4, 3), ("blk", "norm", "scale"): (3,),
              ("blk", "w", "bias"): (3,), ("blk", "o"): (2, 3, 4)}
    decay = {("embed",): False, ("blk", "w", "kernel"): True, ("blk", "norm", "scale"): False,
             ("blk", "w", "bias"): False, ("blk", "o"): True}
    flat = {k: r.normal(size=s).astype(np.float32) for k, s in shapes.items()}

    def nest(d):
        tree = {}
        for path, v in d.items():
            node = tree
            for p in path[:-1]:
                node = node.setdefault(p, {})
            node[path[-1]] = jnp.asarray(v)
        return tree

    def unnest(tree):
        return {tuple(_names(path)): np.asarray(v) for path, v in jax.tree_util.tree_flatten_with_path(tree)[0]}

    norms = [5.0, 0.3, 2.0, 0.05, 3.0]   # above / below grad_clip = 1
    grads_seq = []
    for n in norms:
        g = {k: r.normal(size=s) for k, s in shapes.items()}
        total = math.sqrt(sum(float(np.sum(a * a)) for a in g.values()))
        grads_seq.append({k: (a * n / total).astype(np.float32) for k, a in g.items()})
    params = nest(flat)
    tx = make_optimizer(cfg, params)
    opt = tx.init(params)
    want = _np_adamw(cfg, flat, grads_seq, decay)
    update = jax.jit(tx.update)
    for t, g in enumerate(grads_seq):
        u, opt = update(nest(g), opt, params)
        params = optax.apply_updates(params, u)
        got = unnest(params)
        for k in shapes:
            # Measured: max |error| 1.8e-7 over the five steps (parameters ~1, steps up to 0.05).
            np.testing.assert_allclose(got[k], want[t][k], rtol=0, atol=5e-7, err_msg=f"step {t + 1} {k}")
    assert float(np.max(np.abs(unnest(params)[("blk", "w", "kernel")] - flat[("blk", "w", "kernel")]))) > 1e-2


# --------------------------------------------------------------------------------- Muon
def _head_slices(a):
    """``[L, D, H, hd]`` -> the ``L * H`` per-head ``[D, hd]`` matrices."""
    L, D, H, hd = a.shape
    return np.moveaxis(np.asarray(a, np.float64), 2, 1).reshape(L * H, D, hd)


def _state_kinds(state):
    """The type names of every optimiser-state node (named tuples, nested in tuples and dicts)."""
    if hasattr(state, "_fields"):
        return {type(state).__name__}.union(*(_state_kinds(s) for s in state))
    if isinstance(state, (tuple, list)):
        return set().union(*(_state_kinds(s) for s in state))
    if isinstance(state, dict):
        return set().union(*(_state_kinds(s) for s in state.values()))
    return set()


def test_muon_orthogonalises_each_head_and_keeps_tables_on_adamw():
    """``optimizer="muon"``: the optimiser state holds Muon's, and after one step from a gradient that is
    nearly rank one in every head, each head's ``[D, hd]`` update of the query kernel has near-equal
    singular values (the orthogonalised momentum) while AdamW's sign-like update of the same gradient
    stays nearly rank one; the embedding table gets Adam's first step, not Muon's."""
    mc = get_config("tiny_kda")
    model = nnx.eval_shape(lambda: Decoder(mc, rngs=nnx.Rngs(0)))
    _, abstract, _ = nnx.split(model, nnx.Param, ...)
    _, params, _ = nnx.split(Decoder(mc, rngs=nnx.Rngs(0)), nnx.Param, ...)
    r = np.random.default_rng(6)

    def grad_of(a):
        if a.ndim == 4 and a.shape[1] == mc.d_model:   # [L, D, H, hd] projections: rank one + 3% noise
            L, D, H, hd = a.shape
            u, v = r.normal(size=(L, D, 1, 1)), r.normal(size=(L, 1, H, hd))
            return jnp.asarray(u * v + 0.03 * r.normal(size=a.shape), jnp.float32)
        return jnp.asarray(r.normal(size=a.shape), jnp.float32)

    grads = jax.tree.map(grad_of, params)
    q_grad = grads["groups"][0]["blocks"][0]["mixer"]["q"]["kernel"][...]
    updates = {}
    for opt_name in ("muon", "adamw"):
        cfg = TrainConfig(optimizer=opt_name, lr=0.01, warmup_steps=0, steps=10, weight_decay=0.0)
        tx = make_optimizer(cfg, abstract)
        state = tx.init(params)
        kinds = _state_kinds(state)
        assert ("MuonState" in kinds) == (opt_name == "muon"), kinds
        updates[opt_name], _ = jax.jit(tx.update)(grads, state, params)

    def spread(u):   # largest / smallest singular value of each head's update
        s = np.linalg.svd(_head_slices(u["groups"][0]["blocks"][0]["mixer"]["q"]["kernel"][...]), compute_uv=False)
        return s.max(-1) / s.min(-1)

    muon, adam = spread(updates["muon"]), spread(updates["adamw"])
    g_spread = np.linalg.svd(_head_slices(q_grad), compute_uv=False)
    assert np.min(g_spread.max(-1) / g_spread.min(-1)) > 20        # the gradient is far from orthogonal
    # Measured: Muon's per-head spread at most 1.76 (five Newton-Schulz steps leave singular values in about
    # [0.7, 1.2]); AdamW's at least 2e6; the gradient's at least 128.
    assert np.max(muon) < 2.5, muon
    assert np.min(adam) > 100, adam
    # The embedding table is on Adam in both: the first step is -lr * g / (|g| + eps) of the clipped g, times
    # 1 + b1 / (1 + b1) beside Muon (its Adam uses Nesterov momentum: b1 m_1 / (1 - b1^2) + (1 - b1) g / (1 - b1)).
    norm = math.sqrt(sum(float(np.sum(np.asarray(a, np.float64) ** 2)) for a in jax.tree.leaves(grads)))
    g = np.asarray(grads["embed"][...], np.float64) * min(1.0, 1.0 / norm)
    b1 = TrainConfig().b1
    for name, factor in (("muon", 1 + b1 / (1 + b1)), ("adamw", 1.0)):
        got = np.asarray(updates[name]["embed"][...], np.float64)
        # Measured: 3.7e-7 relative.
        np.testing.assert_allclose(got, -0.01 * factor * g / (np.abs(g) + 1e-8), rtol=1e-6, atol=0, err_msg=name)


@pytest.mark.parametrize("opt_name", ["adamw", "muon"])
def test_weight_decay_follows_the_decay_mask_under_both_optimizers(opt_name):
    """From a zero gradient an update is the decay alone: ``-lr · weight_decay · param`` on the leaves
    ``decay_mask`` marks (Muon's matrices and, under Muon, the AdamW side's: the untied LM head), exactly 0 on
    the rest (norms, biases, ``A_log``, ``dt_bias``, the embedding table) — under Muon too."""
    mc = get_config("tiny_kda")
    model = nnx.eval_shape(lambda: Decoder(mc, rngs=nnx.Rngs(0)))
    _, abstract, _ = nnx.split(model, nnx.Param, ...)
    _, params, _ = nnx.split(Decoder(mc, rngs=nnx.Rngs(0)), nnx.Param, ...)
    lr, wd = 0.5, 0.1
    cfg = TrainConfig(optimizer=opt_name, lr=lr, warmup_steps=0, steps=10, weight_decay=wd)
    tx = make_optimizer(cfg, abstract)
    grads = jax.tree.map(jnp.zeros_like, params)
    updates, _ = jax.jit(tx.update)(grads, tx.init(params), params)
    mask = {jax.tree_util.keystr(p): bool(m) for p, m in jax.tree_util.tree_leaves_with_path(decay_mask(abstract))}
    decayed = 0
    for path, u in jax.tree_util.tree_leaves_with_path(updates):
        name = jax.tree_util.keystr(path)
        p = np.asarray(jax.tree_util.tree_leaves(params)[list(mask).index(name)], np.float64)
        want = -lr * wd * p if mask[name] else np.zeros_like(p)
        np.testing.assert_allclose(np.asarray(u, np.float64), want, rtol=1e-6, atol=1e-9, err_msg=name)
        decayed += mask[name]
    assert mask["['head'].value"] and not mask["['embed'].value"], mask   # the untied head decays, the table not
    assert 0 < decayed < len(mask)
