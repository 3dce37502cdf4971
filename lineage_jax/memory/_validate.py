"""Argument checks shared by every public memory function.

Every check raises ``ValueError`` naming the offending argument and the shape or
value it expected, before any computation runs. Value checks (gate signs, NaNs)
only run on concrete arrays: under ``jax.jit`` the values are abstract, and the
caller is responsible (``jax.experimental.checkify`` can wrap the call).
"""

from __future__ import annotations

import numbers
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

MODES = ("chunked", "recurrent")


def shape_of(x: Any) -> tuple[int, ...]:
    return tuple(np.shape(x))


def is_int(x: Any) -> bool:
    """A Python or NumPy integer; a bool is not one."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def require_positive_int(fn: str, name: str, x: Any) -> int:
    if not is_int(x) or x <= 0:
        raise ValueError(f"{fn}: `{name}` must be a positive int, got {x!r}")
    return int(x)


def require_bool(fn: str, name: str, x: Any, allow_none: bool = False, none_means: str = "the default") -> Any:
    """A flag: a Python or NumPy bool (``None`` too with ``allow_none``, meaning ``none_means``); returned as a
    Python bool (or None). A truthy string or int is refused, not read as True."""
    if allow_none and x is None:
        return None
    if not isinstance(x, (bool, np.bool_)):
        want = f"a bool (or None for {none_means})" if allow_none else "a bool"
        raise ValueError(f"{fn}: `{name}` must be {want}, got {x!r}")
    return bool(x)


def require_rank(fn: str, name: str, x: Any, rank: int, layout: str) -> None:
    if x is None:
        raise ValueError(f"{fn}: `{name}` is required (expected layout {layout})")
    if np.ndim(x) != rank:
        raise ValueError(
            f"{fn}: `{name}` must have rank {rank} with layout {layout}, got shape {shape_of(x)}"
        )


def require_shape(fn: str, name: str, x: Any, expected: tuple[int, ...], layout: str) -> None:
    if x is None:
        raise ValueError(f"{fn}: `{name}` is required (expected shape {layout} = {expected})")
    if shape_of(x) != tuple(expected):
        raise ValueError(
            f"{fn}: `{name}` must have shape {layout} = {tuple(expected)}, got {shape_of(x)}"
        )


def require_float(fn: str, name: str, x: Any) -> None:
    dtype = x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype
    if not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"{fn}: `{name}` must be a floating-point array, got dtype {dtype}")


def require_float_dtype(fn: str, name: str, dtype: Any) -> Any:
    """``dtype`` names a floating-point dtype (a cache's storage); returned as a NumPy dtype."""
    try:
        d = jnp.dtype(dtype)
    except TypeError:
        raise ValueError(f"{fn}: `{name}` must be a floating-point dtype, got {dtype!r}") from None
    if not jnp.issubdtype(d, jnp.floating):
        raise ValueError(f"{fn}: `{name}` must be a floating-point dtype, got {d}")
    return d


def check_mode(fn: str, mode: Any) -> str:
    if mode not in MODES:
        raise ValueError(f"{fn}: `mode` must be one of {MODES}, got {mode!r}")
    return mode


def check_chunk_size(fn: str, chunk_size: Any) -> int:
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, (int, np.integer)) or chunk_size <= 0:
        raise ValueError(f"{fn}: `chunk_size` must be a positive integer, got {chunk_size!r}")
    return int(chunk_size)


def resolve_scale(fn: str, scale: Any, head_dim: int) -> float:
    if scale is None:
        return float(head_dim) ** -0.5
    try:
        value = float(scale)
    except (TypeError, ValueError):
        raise ValueError(f"{fn}: `scale` must be a real number or None, got {scale!r}") from None
    if not np.isfinite(value):
        raise ValueError(f"{fn}: `scale` must be finite, got {scale!r}")
    return value


def is_concrete(x: Any) -> bool:
    return x is not None and not isinstance(x, jax.core.Tracer)


def max_filled(length: Any) -> int:
    """The largest fill length of a concrete cache ``length`` [B], read on the host (``jnp.max``
    would trace when the cache is a constant captured inside ``jit``)."""
    return int(np.max(jax.device_get(length)))


def _summary(x: Any):
    """``(non-finite count, smallest and largest finite value)`` of a concrete array, reduced where it
    lives (three scalars to the host, not the array), or None where that would trace (a constant
    captured inside ``jit``)."""
    try:
        x = jnp.asarray(x)
        ok = jnp.isfinite(x)
        out = jax.device_get((jnp.sum(~ok), jnp.min(jnp.where(ok, x, jnp.inf), initial=jnp.inf),
                              jnp.max(jnp.where(ok, x, -jnp.inf), initial=-jnp.inf)))
        return int(out[0]), float(out[1]), float(out[2])
    except jax.errors.ConcretizationTypeError:
        return None


def check_finite(fn: str, name: str, x: Any) -> None:
    """A concrete ``x`` holds no NaN or inf (a traced one is not read)."""
    summary = _summary(x) if is_concrete(x) else None
    if summary and summary[0]:
        raise ValueError(f"{fn}: `{name}` has {summary[0]} non-finite entries (NaN or inf)")


def check_cache_length(fn: str, length: Any, batch: int, name: str = "cache.length") -> None:
    """A cache's fill lengths: ``[B]`` integers, and (when concrete) none negative."""
    require_rank(fn, name, length, 1, "[B]")
    if shape_of(length)[0] != batch:
        raise ValueError(f"{fn}: `{name}` has batch {shape_of(length)[0]}, the input has batch {batch} "
                         "(the cache was built for another batch)")
    dtype = length.dtype if hasattr(length, "dtype") else np.asarray(length).dtype
    if not jnp.issubdtype(dtype, jnp.integer):
        raise ValueError(f"{fn}: `{name}` must be an integer array, got dtype {dtype}")
    if is_concrete(length) and batch > 0:
        lowest = int(np.min(jax.device_get(length)))
        if lowest < 0:
            raise ValueError(f"{fn}: `{name}` must be >= 0, got {lowest}")


def check_log_decay(fn: str, name: str, g: Any, lower_bound: float | None = None) -> None:
    """Gates are natural-log decays: finite and <= 0 (alpha = exp(g) in (0, 1]); with ``lower_bound``
    (KDA's ``gate_lower_bound``), also ``>= lower_bound``."""
    summary = _summary(g) if is_concrete(g) else None
    if summary is None:
        return
    bad, low, high = summary
    if bad:
        raise ValueError(
            f"{fn}: `{name}` (log-decay) has {bad} non-finite entries (NaN or inf); gates must be "
            "finite and <= 0. For a hard reset between documents use `segment_ids`."
        )
    if high > 0:
        raise ValueError(
            f"{fn}: `{name}` (log-decay) must be <= 0 everywhere (alpha = exp({name}) <= 1); "
            f"max is {high:.4g}. Map raw gate logits with e.g. "
            "-softplus(x) or jax.nn.log_sigmoid(x)."
        )
    # the bound in the gates' own precision: a gate at a bound float32 cannot hold (-0.3) is not below it
    dtype = jnp.dtype(getattr(g, "dtype", "float32"))
    bound = None if lower_bound is None else float(np.asarray(lower_bound, dtype=dtype))
    if bound is not None and low < bound:
        raise ValueError(
            f"{fn}: `{name}` (log-decay) reaches {low:.4g}, below `gate_lower_bound`={lower_bound}; "
            "bound the gates by construction (e.g. g = gate_lower_bound·sigmoid(·)) or leave the bound unset"
        )


def check_segment_ids(fn: str, segment_ids: Any, batch: int, length: int) -> None:
    if segment_ids is None:
        return
    require_shape(fn, "segment_ids", segment_ids, (batch, length), "[B,T]")
    dtype = segment_ids.dtype if hasattr(segment_ids, "dtype") else np.asarray(segment_ids).dtype
    if not (jnp.issubdtype(dtype, jnp.integer) or jnp.issubdtype(dtype, jnp.bool_)):
        raise ValueError(f"{fn}: `segment_ids` must be an integer array, got dtype {dtype}")
