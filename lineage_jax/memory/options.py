"""How a delta-rule call runs: one small options object, checked once.

:class:`MemoryOptions` carries the settings that travel from a model's configuration to the
kernels — which backend runs the chunked form, its chunk, KDA's gate bound and the float32
matmul precision. ``ModelConfig.memory_options`` builds it (and so checks it) when the config is
made; ``MemoryMixer`` receives it; :func:`lineage_jax.memory.delta_rule`,
:func:`~lineage_jax.memory.gated_delta_rule` and :func:`~lineage_jax.memory.kda` take it as
``options=`` (or build one from their ``backend`` / ``chunk_size`` / ``gate_lower_bound``
arguments); :meth:`MemoryOptions.use_pallas` is the one place that decides the backend of a call,
and the Pallas kernels receive its chunk and gate bound.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import jax
import jax.numpy as jnp

from lineage_jax.memory import _validate as V
from lineage_jax.numerics import MATMUL_PRECISIONS

BACKENDS = ("auto", "xla", "pallas")


def check_backend(fn: str, backend: Any, arg: str = "backend") -> str:
    """The one check of a delta-rule backend name."""
    if backend not in BACKENDS:
        raise ValueError(f"{fn}: `{arg}` must be one of {BACKENDS}, got {backend!r}")
    return backend


@dataclasses.dataclass(frozen=True)
class MemoryOptions:
    """Execution settings of the delta rules' chunked form (hashable, immutable, checked on creation).

    Attributes:
      backend: ``"xla"`` (the chunked form in :mod:`lineage_jax.memory.core`), ``"pallas"`` (the
        ``kernels.delta`` kernels; interpret mode on a CPU) or ``"auto"`` (Pallas on GPUs and TPUs
        for chunked calls computing in float32 — every input dtype but float64 — at a chunk size the
        kernels take, XLA otherwise). The kernels take 16-bit q, k, v into their matmuls as they are
        (float32 accumulation and state), float32 ones float32-accurately.
      chunk_size: tokens per chunk; ``None`` is each backend's own (64 for XLA, the kernels'
        tile-tuned chunk for Pallas). The kernels take powers of two >= 16 (on GPUs up to 64).
      gate_lower_bound: KDA only — a promise that every log-decay is ``>= gate_lower_bound``, in
        ``[-8, 0)`` (K3's ``g = -5·σ(·)`` gives ``-5.0``); the kernels then run the anchored
        bounded-gate form. The rules without a per-channel gate do not read it.
      precision: the float32 matmul precision of the XLA form, one of
        :data:`lineage_jax.numerics.MATMUL_PRECISIONS`; ``"default"`` leaves the one in force.
    """

    backend: str = "auto"
    chunk_size: Optional[int] = None
    gate_lower_bound: Optional[float] = None
    precision: str = "default"

    def __post_init__(self):
        fn = "MemoryOptions"
        check_backend(fn, self.backend)
        if self.chunk_size is not None:
            object.__setattr__(self, "chunk_size", V.check_chunk_size(fn, self.chunk_size))
            if self.backend == "pallas":
                _check_kernel_chunk(fn, self.chunk_size)
        if self.gate_lower_bound is not None:
            from lineage_jax._kernels import MIN_GATE_BOUND  # the kernels' limit (float32 range of a tile)
            try:
                bound = float(self.gate_lower_bound)
            except (TypeError, ValueError):
                bound = float("nan")
            if not MIN_GATE_BOUND <= bound < 0.0:
                raise ValueError(f"{fn}: `gate_lower_bound` must be a float in [{MIN_GATE_BOUND}, 0), "
                                 f"got {self.gate_lower_bound!r}")
            object.__setattr__(self, "gate_lower_bound", bound)
        if self.precision not in MATMUL_PRECISIONS:
            raise ValueError(f"{fn}: `precision` must be one of {MATMUL_PRECISIONS}, got {self.precision!r}")

    def replace(self, **changes) -> "MemoryOptions":
        return dataclasses.replace(self, **changes)

    def use_pallas(self, fn: str, mode: str, compute_dtype) -> bool:
        """Whether a call of ``fn`` in ``mode`` runs the Pallas kernels — the one place that decides."""
        if self.backend == "xla":
            return False
        if self.backend == "auto":  # where the kernels cannot take the chunk size, XLA's chunked form runs
            use = (jax.default_backend() != "cpu" and mode == "chunked" and compute_dtype == jnp.float32
                   and (self.chunk_size is None or _kernels_take(self.chunk_size)))
        elif mode != "chunked":
            raise ValueError(f"{fn}: `backend='pallas'` runs the chunked form; got mode={mode!r}")
        else:
            use = True
        if use and self.chunk_size is not None:
            _check_kernel_chunk(fn, self.chunk_size)
        return use


    def use_pallas_conv(self) -> bool:
        """Whether a fixed-state mixer's short causal convolution (training and a fresh prefill)
        runs the Pallas kernel of :mod:`lineage_jax.layers.conv_pallas`: ``"auto"`` on GPUs,
        ``"pallas"`` on GPUs and (interpreted) on the CPU. It is a Triton kernel: TPUs run XLA's."""
        if self.backend == "xla":
            return False
        platform = jax.default_backend()
        return platform == "gpu" or (self.backend == "pallas" and platform == "cpu")


def _kernels_take(chunk_size: int) -> bool:
    """Whether the kernels on this backend run chunks of ``chunk_size`` tokens (on GPUs at most
    ``GPU_MAX_CHUNK``)."""
    from lineage_jax import _kernels
    try:
        _kernels.check_chunk_size(chunk_size)
    except ValueError:
        return False
    return jax.default_backend() != "gpu" or chunk_size <= _kernels.GPU_MAX_CHUNK


def _check_kernel_chunk(fn: str, chunk_size: int) -> None:
    from lineage_jax._kernels import check_chunk_size  # memory/ -> kernels/
    try:
        check_chunk_size(chunk_size)
    except ValueError as e:
        raise ValueError(f"{fn}: {e} (or chunk_size=None for the kernels' own chunk, or backend='xla')") from None


def resolve(fn: str, options: Optional[MemoryOptions], *, default_backend: str = "xla", **given) -> MemoryOptions:
    """``options``, or one built from a function's own arguments (``backend``, ``chunk_size``,
    ``gate_lower_bound``: ``None`` where not passed; ``backend`` then ``default_backend``).
    Passing both is refused, naming them."""
    passed = {k: v for k, v in given.items() if v is not None}
    if options is not None:
        if not isinstance(options, MemoryOptions):
            raise ValueError(f"{fn}: `options` must be a MemoryOptions, got {type(options).__name__}")
        if passed:
            raise ValueError(f"{fn}: pass either `options` or {', '.join(f'`{k}`' for k in passed)}, not both")
        return options
    try:
        return MemoryOptions(**{"backend": default_backend, **passed})
    except ValueError as e:
        raise ValueError(str(e).replace("MemoryOptions:", f"{fn}:", 1)) from None
