"""Training inputs: ``TrainConfig.data`` -> ``data(split)`` iterators of batch dicts.

``data`` is "stdlib" (the running interpreter's standard-library sources), a
directory of text files / ArrayRecord paths, or a synthetic task name
(``lineage_jax.data.TASKS``). Each host reads its own shard.
"""

from __future__ import annotations

import functools

import jax

from lineage_jax import data as D
from lineage_jax.models import ModelConfig
from lineage_jax.train.config import TrainConfig


def make_data(train_cfg: TrainConfig, model_cfg: ModelConfig):
    """``TrainConfig.batch_size`` is the global batch; each of the ``jax.process_count()``
    processes reads its own disjoint shard and ``batch_size / process_count`` rows a step."""
    shard = dict(shard_index=jax.process_index(), shard_count=jax.process_count())
    if train_cfg.batch_size % jax.process_count():
        raise ValueError(f"batch_size={train_cfg.batch_size} must be divisible by the {jax.process_count()} processes")
    batch_size = train_cfg.batch_size // jax.process_count()
    if train_cfg.data in D.TASKS:
        kwargs = {"seq_len": train_cfg.seq_len}
        if train_cfg.data == "niah":
            kwargs["tokenizer"] = train_cfg.tokenizer
        else:
            kwargs["vocab_size"] = model_cfg.vocab_size

        def task_data(split: str):
            task = D.get_task(train_cfg.data, seed=train_cfg.seed + (0 if split == "train" else 10_007), **kwargs)
            return D.make_batches(task, seq_len=train_cfg.seq_len, batch_size=batch_size,
                                  seed=train_cfg.seed, **shard)

        task_data("train")  # build once now: bad task settings fail before training starts
        tok_vocab = D.get_tokenizer(train_cfg.tokenizer).vocab_size if train_cfg.data == "niah" else 0
        if tok_vocab > model_cfg.vocab_size:
            raise ValueError(f"task niah with tokenizer {train_cfg.tokenizer!r} needs vocab_size >= {tok_vocab}, "
                             f"model has {model_cfg.vocab_size}")
        return task_data

    tok = D.get_tokenizer(train_cfg.tokenizer)
    if tok.vocab_size > model_cfg.vocab_size:
        raise ValueError(f"tokenizer {train_cfg.tokenizer!r} has {tok.vocab_size} tokens but the model's vocab_size "
                         f"is {model_cfg.vocab_size}; pick a matching --config or --set vocab_size=...")

    @functools.lru_cache(maxsize=2)
    def corpus(split: str):
        return D.tokenize_corpus(D.load_corpus(train_cfg.data, split), tok)

    def text_data(split: str):
        return D.make_batches(corpus(split), seq_len=train_cfg.seq_len, batch_size=batch_size,
                              seed=train_cfg.seed, shuffle=split == "train", **shard)

    # Both splits read now: a missing, empty or too short corpus fails before anything is written (the
    # validation split is read after the last step otherwise, where a failure would recur on every resume).
    text_data("train")
    try:
        text_data("val")
    except ValueError as e:
        raise ValueError(f"its validation split: {e}") from None
    return text_data
