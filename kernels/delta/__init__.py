"""Pallas kernels for the chunked (WY/UT) delta-rule family: DeltaNet, Gated DeltaNet, KDA.

See :mod:`kernels.delta.api` for the public functions and the GPU/TPU choices (which GPU
lowering runs each kernel, Triton or Mosaic GPU, and the measurements behind it),
:mod:`kernels.delta.tiles` for the in-kernel math and its numerics, and
:mod:`kernels.delta.kernels` for the kernel bodies; docs/kernels.md for the design, the launch
defaults and the measurements behind them.
"""

from .api import (  # noqa: F401
    GPU_MAX_CHUNK,
    MIN_GATE_BOUND,
    RESIDUALS,
    chunk_delta_rule,
    chunk_gated_delta_rule,
    chunk_kda,
    check_chunk_size,
    default_target,
)
