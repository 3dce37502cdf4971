"""Shared building blocks for the Flax NNX layers.

Conventions every layer follows:

* Parameters are ``nnx.Param`` created by :func:`param`, each carrying
  ``logical_axes`` metadata (one name per dimension, e.g. ``("embed", "mlp")``).
  ``lineage_jax.parallel`` maps logical names to mesh axes with one table of rules.
  Logical names in use: ``embed`` (model width), ``vocab``, ``heads``, ``kv_heads``,
  ``head_dim``, ``mlp``, ``experts``, ``expert_mlp``, ``latent`` (MoE latent width),
  ``q_lora``, ``kv_lora``, ``rope``, ``gate_rank``, ``conv``, ``layers``, ``norm``, ``None``.
* Parameters are float32; activations run in the input's dtype, with norms,
  softmaxes, routers and recurrent states in float32.
* Token mixers expose ``__call__(x [B,T,D], *, segment_ids=None) -> [B,T,D]``,
  ``init_cache(batch, max_len, dtype)``, ``prefill(x, cache, *, segment_ids=None) -> (y, cache)``
  and ``decode(x_t [B,D], cache) -> (y_t [B,D], cache)``. Caches are plain pytrees.
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from lineage_jax.memory import _validate as V

Array = jax.Array
Axes = tuple[Optional[str], ...]


def param(rngs: nnx.Rngs, init: Callable, shape: Sequence[int], axes: Axes, dtype=jnp.float32) -> nnx.Param:
    """A parameter initialised by ``init(key, shape, dtype)`` with logical-axis metadata."""
    shape = tuple(int(s) for s in shape)
    if len(axes) != len(shape):
        raise ValueError(f"param: logical axes {axes} do not match shape {shape}")
    return nnx.Param(init(rngs.params(), shape, dtype), logical_axes=tuple(axes))


def normal(std: float) -> Callable:
    return jax.nn.initializers.normal(stddev=std)


def constant(value: float) -> Callable:
    return jax.nn.initializers.constant(value)


def logical_axes(module: nnx.Module):
    """The state of ``module``'s parameters with each leaf replaced by its logical axes."""
    state = nnx.state(module, nnx.Param)
    return jax.tree.map(lambda v: v.get_metadata().get("logical_axes"), state,
                        is_leaf=lambda x: isinstance(x, nnx.Variable))


class Dense(nnx.Module):
    """``y = x W (+ b)``; ``W`` is ``[in, *out]`` with logical ``axes`` (one per dim of W).

    ``out`` may be a tuple (e.g. ``(heads, head_dim)``) so head structure is explicit
    in the parameter's shape and axes.
    """

    def __init__(self, in_features: int, out_features: Union[int, Sequence[int]], *, axes: Axes,
                 rngs: nnx.Rngs, use_bias: bool = False, std: Optional[float] = None):
        V.require_bool("Dense", "use_bias", use_bias)
        out = (out_features,) if isinstance(out_features, int) else tuple(out_features)
        self.out_shape = out
        std = in_features ** -0.5 if std is None else std
        self.kernel = param(rngs, normal(std), (in_features, *out), axes)
        self.bias = param(rngs, constant(0.0), out, axes[1:]) if use_bias else None

    def __call__(self, x: Array) -> Array:
        w = self.kernel[...].astype(x.dtype)
        y = jnp.tensordot(x, w, axes=1)
        if self.bias is not None:
            y = y + self.bias[...].astype(x.dtype)
        return y


class RMSNorm(nnx.Module):
    """``x / rms(x) * w`` in float32 (weight initialised to 1)."""

    def __init__(self, dim: int, *, rngs: nnx.Rngs, eps: float = 1e-6, axis_name: Optional[str] = "norm"):
        self.eps = eps
        self.scale = param(rngs, constant(1.0), (dim,), (axis_name,))

    def __call__(self, x: Array) -> Array:
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (y * self.scale[...]).astype(x.dtype)


class LayerNorm(nnx.Module):
    """GPT-2's LayerNorm with weight and bias, in float32."""

    def __init__(self, dim: int, *, rngs: nnx.Rngs, eps: float = 1e-5):
        self.eps = eps
        self.scale = param(rngs, constant(1.0), (dim,), ("norm",))
        self.bias = param(rngs, constant(0.0), (dim,), ("norm",))

    def __call__(self, x: Array) -> Array:
        x32 = x.astype(jnp.float32)
        mu = jnp.mean(x32, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(x32 - mu), axis=-1, keepdims=True)
        y = (x32 - mu) * jax.lax.rsqrt(var + self.eps)
        return (y * self.scale[...] + self.bias[...]).astype(x.dtype)


def l2_normalize(x: Array, eps: float = 1e-6) -> Array:
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.sum(x32 * x32, axis=-1, keepdims=True) + eps)).astype(x.dtype)


class YaRN(NamedTuple):
    """YaRN RoPE scaling (Peng et al., 2023, arXiv:2309.00071), as DeepSeek-V3 configures it.

    ``factor``: context extension ratio; ``original_max_len``: the pretraining context;
    ``beta_fast`` / ``beta_slow``: the rotation counts bounding the ramp between extrapolated
    (high-frequency) and interpolated (low-frequency) channels; ``attention_factor``: multiplies the
    rotated channels (the cos and sin tables); ``truncate``: round the ramp's bounds to whole channels.
    """

    factor: float
    original_max_len: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float = 1.0
    truncate: bool = True


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature ``0.1 · mscale · ln(factor) + 1`` (1 for ``factor <= 1``)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_frequencies(dim: int, theta: float, yarn: Optional[YaRN] = None) -> np.ndarray:
    """The ``dim / 2`` inverse frequencies of a rotary embedding, float32.

    Plain RoPE: ``theta ** (-2i / dim)``. With ``yarn``, channel ``i`` blends the plain frequency
    (kept where a channel turns more than ``beta_fast`` times over ``original_max_len`` tokens) and
    the frequency divided by ``factor`` (where it turns fewer than ``beta_slow`` times), linearly in
    between.
    """
    if dim <= 0 or dim % 2:
        raise ValueError(f"rope_frequencies: `dim` must be a positive even int, got {dim}")
    pos = np.float32(theta) ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim))
    extrapolated = (np.float32(1.0) / pos).astype(np.float32)
    if yarn is None:
        return extrapolated
    interpolated = (np.float32(1.0) / (np.float32(yarn.factor) * pos)).astype(np.float32)

    def correction_dim(rotations):
        return dim * math.log(yarn.original_max_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(yarn.beta_fast), correction_dim(yarn.beta_slow)
    if yarn.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
    keep = (np.float32(1.0) - ramp).astype(np.float32)  # 1: extrapolate (plain frequency)
    return (interpolated * (1 - keep) + extrapolated * keep).astype(np.float32)


def apply_rope(x: Array, positions: Array, *, theta: float, yarn: Optional[YaRN] = None) -> Array:
    """Rotary embedding, half-split ("GPT-NeoX") convention, computed in float32.

    Channel ``i < r/2`` is paired with channel ``i + r/2`` and the pair is rotated by
    ``positions · theta ** (-2i / r)``. (DeepSeek's reference code pairs adjacent
    channels ``(2i, 2i+1)`` instead; the two differ by a fixed permutation of the
    rope channels of ``W_kr`` / ``W_q``, so neither is more expressive; ``lineage_jax.hf``
    applies that permutation when it loads such a checkpoint.) With ``yarn``
    (:class:`YaRN`) the frequencies are :func:`rope_frequencies`' and the rotated pair is
    multiplied by ``yarn.attention_factor``.

    Args:
      x: ``[..., r]`` with ``r`` even.
      positions: integer positions broadcastable to ``x.shape[:-1]``.
    Returns:
      the rotated ``x``, same shape and dtype.
    """
    half = x.shape[-1] // 2
    if yarn is None:
        inv_freq = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    else:
        inv_freq = jnp.asarray(rope_frequencies(2 * half, theta, yarn))
    angle = jnp.asarray(positions, jnp.float32)[..., None] * inv_freq      # [..., r/2]
    cos, sin = jnp.cos(angle), jnp.sin(angle)
    if yarn is not None and yarn.attention_factor != 1.0:
        cos, sin = cos * yarn.attention_factor, sin * yarn.attention_factor
    x32 = x.astype(jnp.float32)
    x1, x2 = x32[..., :half], x32[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)
