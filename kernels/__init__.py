"""Pallas kernels for the chunked delta family (GPU and TPU).

This package must not import ``lineage_jax``: it is plain JAX + Pallas so that it
can be tested against, and vendored without, the reference implementation.
"""
