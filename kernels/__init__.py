"""Pallas kernels for the chunked delta family (GPU and TPU).

This package must not import ``lineage_jax``: it is plain JAX + Pallas so that it
can be tested against, and vendored without, the reference implementation.

* :mod:`kernels.delta` — DeltaNet, Gated DeltaNet and KDA in the chunked WY/UT
  form, forward and backward (``jax.custom_vjp``), Triton-lowered on GPU,
  Mosaic-lowered on TPU, ``interpret=True`` on the CPU.
"""

from .delta import chunk_delta_rule, chunk_gated_delta_rule, chunk_kda  # noqa: F401
