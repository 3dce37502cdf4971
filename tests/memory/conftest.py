import numpy as np
import pytest


def l2norm(x):
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


class Inputs:
    """Fresh random inputs for one rule call (float32 numpy)."""

    def __init__(self, seed, B=2, T=37, H=2, K=16, V=8, gate_scale=1.0):
        r = np.random.default_rng(seed)
        self.B, self.T, self.H, self.K, self.V = B, T, H, K, V
        f = np.float32
        self.q = r.normal(size=(B, T, H, K)).astype(f)
        self.k = l2norm(r.normal(size=(B, T, H, K))).astype(f)
        self.v = r.normal(size=(B, T, H, V)).astype(f)
        self.beta = r.uniform(0.05, 1.0, size=(B, T, H)).astype(f)
        self.g_scalar = (-gate_scale * r.uniform(0.0, 1.0, size=(B, T, H))).astype(f)
        self.g_channel = (-gate_scale * r.uniform(0.0, 1.0, size=(B, T, H, K))).astype(f)
        self.S0 = (0.5 * r.normal(size=(B, H, K, V))).astype(f)
        # Packed documents: 1-3 boundaries per row at random places.
        seg = np.zeros((B, T), np.int32)
        for b in range(B):
            for cut in r.choice(np.arange(1, T), size=min(3, T - 1), replace=False):
                seg[b, cut:] += 1
        self.segment_ids = seg
        self.rng = r


@pytest.fixture
def inputs():
    return Inputs
