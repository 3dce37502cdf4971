"""Train-and-score plumbing shared by the experiments that train small models.

``train_model`` runs the library's own train step (``lineage_jax.train.step``) on any
random-access dataset of ``{"tokens", "targets", "mask"}`` rows (the synthetic probes
of ``lineage_jax.data``, or packed text), ``accuracy`` scores a trained model on the
answer positions of held-out rows, ``decode_ms_per_token`` times single-token decode
after a prefilled context. The scorecard, MQAR, NIAH, LM and AttnRes experiments all
train through these, so they differ only in what they train on and what they vary.
"""

from __future__ import annotations

import time
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from lineage_jax import data as D
from lineage_jax.models import Decoder, ModelConfig
from lineage_jax.train.config import TrainConfig
from lineage_jax.train.step import init_state, make_train_step


class Mixture:
    """Random access over several datasets, interleaved (example ``i`` comes from dataset ``i % n``)."""

    def __init__(self, datasets: Sequence):
        if not datasets:
            raise ValueError("Mixture: datasets must be non-empty")
        self.datasets = list(datasets)

    def __len__(self):
        return min(len(t) for t in self.datasets) * len(self.datasets)

    def __getitem__(self, i):
        n = len(self.datasets)
        return self.datasets[int(i) % n][int(i) // n]


def train_model(cfg: ModelConfig, dataset, *, steps: int, batch: int, seq_len: int, lr: float, seed: int = 0,
                bar=None, log_every: Optional[int] = None, warmup_frac: float = 0.05,
                weight_decay: float = 0.1) -> tuple[Decoder, list[float]]:
    """Train a fresh ``Decoder(cfg)`` for ``steps`` AdamW steps; returns the model and the logged losses.

    ``bar`` (a tqdm bar) advances one unit per step and shows the latest loss. Losses
    are read back every ``log_every`` steps (default: ten times per run), so the host
    does not synchronize with the device on every step.
    """
    tc = TrainConfig(config="custom", steps=steps, batch_size=batch, seq_len=seq_len, lr=lr,
                     warmup_steps=max(1, int(steps * warmup_frac)), weight_decay=weight_decay, seed=seed)
    graphdef, state, tx = init_state(cfg, tc)
    step = jax.jit(make_train_step(graphdef, tx, tc), donate_argnums=(0,))
    batches = D.make_batches(dataset, seq_len=seq_len, batch_size=batch, seed=seed)
    log_every = log_every or max(1, steps // 10)
    losses = []
    for i in range(steps):
        state, metrics = step(state, next(batches))
        if (i + 1) % log_every == 0 or i + 1 == steps:
            losses.append(float(metrics["loss"]))
            if bar is not None:
                bar.set_postfix(model=str(cfg.name)[:18], loss=f"{losses[-1]:.3f}")
        if bar is not None:
            bar.update(1)
    return nnx.merge(graphdef, state.params, state.rest), losses


def accuracy(model: Decoder, dataset, n: int, batch: int) -> float:
    """Argmax accuracy over the ``mask``-ed (answer) positions of the first ``n`` rows of ``dataset``."""
    forward = nnx.jit(lambda m, t: m(t))
    correct = total = 0.0
    for start in range(0, n, batch):
        rows = [dataset[i] for i in range(start, min(start + batch, n))]
        tokens = jnp.asarray(np.stack([r["tokens"] for r in rows]))
        pred = np.asarray(jnp.argmax(forward(model, tokens), axis=-1))
        targets = np.stack([r["targets"] for r in rows])
        mask = np.stack([r["mask"] for r in rows])
        correct += float(np.sum((pred == targets) * mask))
        total += float(np.sum(mask))
    return correct / max(total, 1.0)


def mean_loss(model: Decoder, dataset, n: int, batch: int) -> float:
    """Mean next-token cross-entropy over the ``mask``-ed positions of the first ``n`` rows."""
    from lineage_jax.train.step import cross_entropy

    forward = nnx.jit(lambda m, t, y, k: cross_entropy(m(t), y, k)[0])
    losses, weights = [], []
    for start in range(0, n, batch):
        rows = [dataset[i] for i in range(start, min(start + batch, n))]
        tokens, targets, mask = (jnp.asarray(np.stack([r[k] for r in rows])) for k in ("tokens", "targets", "mask"))
        losses.append(float(forward(model, tokens, targets, mask.astype(jnp.float32))))
        weights.append(float(np.sum(mask)))
    return float(np.average(losses, weights=weights))


def decode_ms_per_token(model: Decoder, vocab: int, context: int, tokens: int, batch: int = 1, seed: int = 0) -> float:
    """Median wall-clock ms of one jitted decode step after prefilling ``context`` random tokens."""
    ctx = jax.random.randint(jax.random.key(seed), (batch, context), 2, vocab)
    cache = model.init_cache(batch, context + tokens + 1)
    _, cache = nnx.jit(lambda m, t, c: m.prefill(t, c))(model, ctx, cache)
    step = nnx.jit(lambda m, t, c: m.decode(t, c))
    tok = jnp.zeros((batch,), jnp.int32)
    logits, cache = step(model, tok, cache)  # compile
    jax.block_until_ready(logits)
    times = []
    for _ in range(tokens):
        t0 = time.perf_counter()
        logits, cache = step(model, tok, cache)
        jax.block_until_ready(logits)
        times.append(time.perf_counter() - t0)
    return 1e3 * float(np.median(times))
