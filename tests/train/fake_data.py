"""A tiny deterministic, checkpointable batch iterator for loop tests (no grain needed)."""

import numpy as np


class CountingData:
    def __init__(self, vocab, batch, seq, seed=0):
        self.vocab, self.batch, self.seq, self.seed, self.pos = vocab, batch, seq, seed, 0

    def __iter__(self):
        return self

    def __next__(self):
        r = np.random.default_rng([self.seed, self.pos])
        self.pos += 1
        # Learnable: each row counts up from a random start (next token = this token + 1).
        start = r.integers(0, self.vocab, size=(self.batch, 1))
        row = ((start + np.arange(self.seq + 1)[None, :]) % self.vocab).astype(np.int32)
        return {"tokens": row[:, :-1], "targets": row[:, 1:], "segment_ids": np.zeros((self.batch, self.seq), np.int32),
                "mask": np.ones((self.batch, self.seq), np.float32)}

    def get_state(self):
        return {"pos": self.pos}

    def set_state(self, state):
        self.pos = int(state["pos"])


def factory(train_cfg, model_cfg):
    return lambda split: CountingData(model_cfg.vocab_size, train_cfg.batch_size, train_cfg.seq_len,
                                      seed=train_cfg.seed + (0 if split == "train" else 999))
