"""One Decoder for the whole lineage, assembled from a layer pattern.

``ModelConfig.pattern`` names each layer's token mixer; every layer is
``norm → mixer → residual, norm → FFN (dense or MoE) → residual``, where the
residual is a plain sum or block Attention Residuals. Consecutive identical
macrocycles (e.g. K3's ``KKKM``) are stacked and run under one ``lax.scan`` so a
93-layer model traces one macrocycle, not 93 layers.

Three entry points share one path through the layers:

* ``forward(tokens, segment_ids=None) -> (logits, aux)`` — training / scoring;
* ``prefill(tokens, cache) -> (logits, cache)`` — a prompt, filling each layer's cache;
* ``decode(token, cache) -> (logits, cache)`` — one token per row.

``aux["moe"]`` holds the router statistics of every MoE layer (stacked per scanned group).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from lineage_jax.layers import attnres as AR
from lineage_jax.layers.attention import Attention
from lineage_jax.layers.common import LayerNorm, RMSNorm, constant, normal, param
from lineage_jax.layers.ffn import MLP
from lineage_jax.layers.grouped import RESIDUALS as GROUPED_RESIDUALS
from lineage_jax.layers.memory_mixer import MemoryMixer
from lineage_jax.layers.mla import MLA, MLACache
from lineage_jax.layers.moe import MoE
from lineage_jax.memory import _validate
from lineage_jax.memory.fused import RESIDUALS as ATTENTION_RESIDUALS
from lineage_jax.memory.rules import DELTA_RESIDUALS
from lineage_jax.memory.softmax import KVCache
from lineage_jax.models.config import MIXERS, ModelConfig
from lineage_jax.numerics import matmul_precision

Array = jax.Array


class DecoderCache(NamedTuple):
    layers: tuple  # one entry per layer group (stacked along axis 0 for scanned groups)
    length: Array  # [B] int32 tokens seen per row


def _cache_capacity(layers) -> Optional[int]:
    """The fewest tokens any attention cache (:class:`KVCache`, :class:`MLACache`) in ``layers`` holds, or
    None where every layer keeps a fixed-size state. Scanned groups stack their caches along a leading
    layer axis, so the token axis is counted from the end."""
    found = [c for c in jax.tree.leaves(layers, is_leaf=lambda x: isinstance(x, (KVCache, MLACache)))
             if isinstance(c, (KVCache, MLACache))]
    sizes = [c.k.shape[-3] if isinstance(c, KVCache) else c.latent.shape[-2] for c in found]
    return min(sizes) if sizes else None


def _poison_overflow(h: Array, cache: DecoderCache, new_tokens: int) -> Array:
    """The final hidden states ``h [B, T, D]`` with NaN in the rows whose attention caches overflow with
    ``new_tokens`` more, so those rows' logits are NaN (under ``jit`` the lengths are traced and cannot be
    refused: a full cache is overwritten in its last slot, so the logits would be wrong without a sign).
    Marked before the LM head: a ``[B, T, D]`` select, not one over the vocabulary."""
    capacity = _cache_capacity(cache.layers)
    if capacity is None:
        return h
    over = cache.length + new_tokens > capacity                               # [B]
    return jnp.where(over[:, None, None], jnp.nan, h)


def _norm(cfg: ModelConfig, rngs: nnx.Rngs):
    kw = {} if cfg.norm_eps is None else {"eps": cfg.norm_eps}
    return LayerNorm(cfg.d_model, rngs=rngs, **kw) if cfg.norm == "layernorm" else RMSNorm(cfg.d_model, rngs=rngs, **kw)


def make_mixer(cfg: ModelConfig, letter: str, *, rngs: nnx.Rngs):
    """Layer ``letter``'s token mixer, built from its part of ``cfg`` (``ModelConfig.*_part``)."""
    kind = MIXERS[letter]
    if kind == "softmax":
        return Attention(**cfg.attention_part().kwargs, rngs=rngs)
    if kind == "mla":
        return MLA(**cfg.mla_part().kwargs, rngs=rngs)
    return MemoryMixer(**cfg.mixer_part(kind).kwargs, rngs=rngs)


def make_ffn(cfg: ModelConfig, moe: bool, *, rngs: nnx.Rngs):
    if not moe:
        return MLP(cfg.d_model, cfg.ffn_hidden, kind=cfg.ffn_kind, rngs=rngs,
                   out_std=0.02 / (2 * cfg.num_layers) ** 0.5 if cfg.ffn_kind == "gelu" else None)
    return MoE(**cfg.moe_part().kwargs, rngs=rngs)


# ---------------------------------------------------------------------------- residual streams
class _Plain:
    """``h ← h + out``."""

    def init(self, h):
        return h

    def read(self, carry, query):
        return carry

    def write(self, carry, out):
        return carry + out.astype(carry.dtype)

    def end_layer(self, carry, layer_idx):
        return carry

    def final(self, carry, query):
        return carry


class _AttnRes:
    """Block AttnRes: sublayer inputs are softmax reads over depth (see layers/attnres.py)."""

    def __init__(self, cfg: ModelConfig):
        self.block = cfg.attnres_block
        self.max_sources = AR.max_sources(cfg.num_layers, cfg.attnres_block)

    def init(self, h):
        return AR.init(h, self.max_sources)

    def read(self, carry, query):
        return AR.read(carry, query)

    def write(self, carry, out):
        return AR.write(carry, out)

    def end_layer(self, carry, layer_idx):
        return AR.seal(carry, (layer_idx + 1) % self.block == 0)

    def final(self, carry, query):
        return AR.read(carry, query)


def residual_stream(cfg: ModelConfig):
    return _AttnRes(cfg) if cfg.attnres_block else _Plain()


# ---------------------------------------------------------------------------- layers
class Block(nnx.Module):
    """One layer: ``norm → mixer`` and ``norm → FFN``, each added to the residual stream."""

    def __init__(self, cfg: ModelConfig, layer: int, *, rngs: nnx.Rngs):
        letter, moe = cfg.layer_kind(layer)
        self.is_moe = moe
        self.norm1 = _norm(cfg, rngs)
        self.mixer = make_mixer(cfg, letter, rngs=rngs)
        self.norm2 = _norm(cfg, rngs)
        self.ffn = make_ffn(cfg, moe, rngs=rngs)
        # One AttnRes pseudo-query per sublayer, zero at init (= mean of the sources).
        self.res_query = param(rngs, constant(0.0), (2, cfg.d_model), (None, "embed")) if cfg.attnres_block else None

    def run(self, stream, carry, cache, layer_idx, mode: str, segment_ids):
        q = self.res_query[...] if self.res_query is not None else (None, None)
        x = self.norm1(stream.read(carry, q[0]))
        if mode == "train":
            y, cache = self.mixer(x, segment_ids=segment_ids), None
        elif mode == "prefill":
            y, cache = self.mixer.prefill(x, cache, segment_ids=segment_ids)
        else:
            y, cache = self.mixer.decode(x[:, 0], cache)
            y = y[:, None]
        carry = stream.write(carry, y)
        x = self.norm2(stream.read(carry, q[1]))
        if self.is_moe:
            f, stats = self.ffn(x)
        else:
            f, stats = self.ffn(x), None
        carry = stream.write(carry, f)
        return stream.end_layer(carry, layer_idx), cache, stats


class Macro(nnx.Module):
    """``p`` consecutive layers: the unit a scanned group repeats."""

    def __init__(self, cfg: ModelConfig, first_layer: int, period: int, *, rngs: nnx.Rngs):
        self.blocks = nnx.List([Block(cfg, first_layer + j, rngs=rngs) for j in range(period)])

    def run(self, stream, carry, caches, first_idx, mode, segment_ids):
        new_caches, stats = [], []
        for j, block in enumerate(self.blocks):
            carry, c, s = block.run(stream, carry, None if caches is None else caches[j], first_idx + j, mode, segment_ids)
            new_caches.append(c)
            stats.append(s)
        return carry, tuple(new_caches), tuple(stats)

    def init_cache(self, batch, max_len, dtype):
        return tuple(b.mixer.init_cache(batch, max_len, dtype) for b in self.blocks)


def smallest_period(pattern: str) -> int:
    """Smallest ``p`` such that ``pattern`` is at least two repeats of ``pattern[:p]`` (plus a tail)."""
    L = len(pattern)
    for p in range(1, L // 2 + 1):
        n = L // p
        if pattern[:p] * n == pattern[: n * p]:
            return p
    return L


def layer_groups(cfg: ModelConfig) -> list[tuple[int, int, int]]:
    """Split the layers into ``(first_layer, period, repeats)`` groups; repeats >= 2 are scanned."""
    L = cfg.num_layers
    specs = [cfg.layer_kind(i) for i in range(L)]
    p = cfg.scan_period or smallest_period(cfg.pattern)
    groups, i = [], 0
    while i < L:
        if cfg.scan_layers and i + 2 * p <= L:
            n = 1
            while i + (n + 1) * p <= L and specs[i + n * p: i + (n + 1) * p] == specs[i: i + p]:
                n += 1
            if n >= 2:
                groups.append((i, p, n))
                i += n * p
                continue
        groups.append((i, 1, 1))
        i += 1
    return groups


def stacked_macro(cfg: ModelConfig, first: int, period: int, repeats: int, *, rngs: nnx.Rngs) -> Macro:
    """``repeats`` independently initialised macrocycles as one module whose parameters
    carry a leading ``layers`` axis. Built by ``jax.vmap`` over keys, so construction
    traces one macrocycle whatever ``repeats`` is."""
    keys = jax.random.split(rngs.params(), repeats)
    states = jax.vmap(lambda key: nnx.state(Macro(cfg, first, period, rngs=nnx.Rngs(key))))(keys)
    stacked = nnx.eval_shape(lambda: Macro(cfg, first, period, rngs=nnx.Rngs(0)))
    nnx.update(stacked, states)
    for _, var in nnx.iter_graph(stacked):
        if isinstance(var, nnx.Variable):
            axes = var.get_metadata().get("logical_axes")
            if axes is not None:
                var.set_metadata("logical_axes", ("layers", *axes))
    return stacked


# ---------------------------------------------------------------------------- the model
# cuDNN's fused attention (``jax.nn.dot_product_attention``, implementation "cudnn"): the forward
# primitive whose outputs (the attention output and the softmax statistics) its backward reads.
CUDNN_ATTENTION_FWD = ("dot_product_attention_fwd_wrapper", "dot_product_attention_fwd")


def _cudnn_attention_saveable(prim, *_, **__) -> bool:
    return prim.name in CUDNN_ATTENTION_FWD


def remat_policy(name: str):
    """``ModelConfig.remat`` -> ``None`` (no ``jax.checkpoint``) or a ``jax.checkpoint`` policy.

    "full" saves nothing inside a layer group (``nothing_saveable``); "dots" saves the outputs of
    matmuls without batch dimensions — the weight projections and FFN matmuls
    (``dots_with_no_batch_dims_saveable``) —, the residuals the delta-rule kernels, the
    blockwise attention and the MoE experts' grouped matmuls name (``kernels.delta.RESIDUALS``,
    ``memory.fused.RESIDUALS``, ``layers.grouped.RESIDUALS``) and cuDNN's attention forward
    outputs (:data:`CUDNN_ATTENTION_FWD`: the output and softmax statistics its backward reads,
    so the backward pass does not rerun the forward attention), and recomputes elementwise work
    and norms in the backward pass."""
    if name == "none":
        return None
    if name == "full":
        return jax.checkpoint_policies.nothing_saveable
    if name == "dots":
        return jax.checkpoint_policies.save_from_both_policies(
            jax.checkpoint_policies.save_from_both_policies(
                jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
                jax.checkpoint_policies.save_only_these_names(DELTA_RESIDUALS, ATTENTION_RESIDUALS, GROUPED_RESIDUALS)),
            _cudnn_attention_saveable)
    raise ValueError(f"remat_policy: unknown policy {name!r}")


def _scan_with_cache(body, carry, state, stacked_cache, idx):
    """Scan ``body`` over a stacked layer group with its caches in the *carry*, each layer's
    slice read and written back in place (``dynamic_update_index_in_dim``).

    As scan ``xs -> ys`` the caches would be rebuilt into a new stacked buffer on every call —
    XLA does not alias ``ys`` to ``xs`` — so a decode step's workspace exceeded its whole cache
    (XLA:CPU analysis of a scanned 2-layer GPT-2 decode at 16K: temporaries 1.75x the cache, 0.52x
    unrolled; on an H200 an MHA decode step's workspace equalled its cache at 1M tokens).
    """
    def step(c, xs):
        h, cache = c
        st, i, layer_idx = xs
        mine = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, keepdims=False), cache)
        h, mine, stats = body(h, (st, mine, layer_idx))
        cache = jax.tree.map(lambda a, u: jax.lax.dynamic_update_index_in_dim(a, u.astype(a.dtype), i, 0),
                             cache, mine)
        return (h, cache), stats

    (carry, cache), stats = jax.lax.scan(step, (carry, stacked_cache), (state, jnp.arange(len(idx)), idx))
    return carry, cache, stats


def _check_ids(fn: str, name: str, ids: Array, limit: int, limit_name: str) -> None:
    """Concrete ``ids`` index a table of ``limit`` rows: every one in ``[0, limit)`` (``jnp.take`` would
    read an out-of-range row as NaN, and a negative one from the end). Traced ids are not read."""
    if not _validate.is_concrete(ids):
        return
    a = np.asarray(jax.device_get(ids))
    if a.size and (a.min() < 0 or a.max() >= limit):
        raise ValueError(f"{fn}: `{name}` must be in [0, {limit_name}={limit}), got values from {a.min()} to {a.max()}")


def _at_model_precision(method):
    """Run a Decoder entry point (and so its backward pass) at ``cfg.matmul_precision``."""
    @functools.wraps(method)
    def wrapped(self, *args, **kwargs):
        with matmul_precision(self.cfg.matmul_precision):
            return method(self, *args, **kwargs)
    return wrapped


class Decoder(nnx.Module):
    """The language model of every ``ModelConfig``: embedding (+ learned positions), the layer
    groups, a final norm and the output head (tied to the embedding or its own).

    ``cfg.pattern`` is cut into layer groups (:func:`layer_groups`): a run of identical
    macrocycles is one group whose parameters are stacked along a ``layers`` axis and run
    under ``lax.scan``; every other layer is a group of its own. Each layer is
    ``norm → mixer → residual, norm → FFN → residual``; the mixer is built from the config's
    mixer family (softmax, fixed-state or MLA fields), the FFN from its FFN / MoE family, the
    residual from ``attnres_block``, and the execution fields decide how it runs.

    Entry points: :meth:`forward` (training and scoring; ``(logits, aux)`` with the MoE
    router statistics in ``aux["moe"]``), :meth:`init_cache` / :meth:`prefill` /
    :meth:`decode` (generation), :meth:`moe_layers` and :meth:`update_router_biases` (MoE
    bookkeeping), :meth:`unscanned` (one group per layer, for serving).
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        D, V = cfg.d_model, cfg.vocab_size
        self.embed = param(rngs, normal(0.02), (V, D), ("vocab", "embed"))
        self.pos = param(rngs, normal(0.01), (cfg.max_seq_len, D), (None, "embed")) if cfg.positions == "learned" else None
        self.groups_spec = tuple(layer_groups(cfg))
        groups = []
        for first, p, n in self.groups_spec:
            groups.append(Macro(cfg, first, p, rngs=rngs) if n == 1 else stacked_macro(cfg, first, p, n, rngs=rngs))
        self.groups = nnx.List(groups)
        self.final_norm = _norm(cfg, rngs)
        self.final_query = param(rngs, constant(0.0), (D,), ("embed",)) if cfg.attnres_block else None
        self.head = None if cfg.tie_embeddings else param(rngs, normal(D ** -0.5), (D, V), ("embed", "vocab"))

    # ------------------------------------------------------------------ pieces
    @property
    def compute_dtype(self):
        return jnp.bfloat16 if self.cfg.dtype == "bfloat16" else jnp.float32

    def _check_tokens(self, fn: str, tokens: Array, rank: int) -> None:
        name = "tokens" if rank == 2 else "token"  # the entry point's argument
        if tokens.ndim != rank or not jnp.issubdtype(tokens.dtype, jnp.integer):
            want = "[B,T]" if rank == 2 else "[B]"
            raise ValueError(f"Decoder.{fn}: `{name}` must be an integer array {want}, "
                             f"got {tokens.dtype}{tuple(tokens.shape)}")
        if rank == 2 and tokens.shape[1] == 0:
            raise ValueError(f"Decoder.{fn}: `tokens` holds no tokens (shape {tuple(tokens.shape)}); need T >= 1")
        _check_ids(f"Decoder.{fn}", name, tokens, self.cfg.vocab_size, "vocab_size")

    def _check_cache(self, fn: str, cache: DecoderCache, batch: int, new_tokens: int) -> None:
        """``cache`` is this model's :class:`DecoderCache` for ``batch`` rows, and (concrete lengths)
        ``new_tokens`` more fit its attention caches and the learned position table. Each layer checks its
        own cache's shapes; the capacity is checked here, where the lengths are concrete — inside a scanned
        layer group they are traced."""
        fn = f"Decoder.{fn}"
        if not isinstance(cache, DecoderCache):
            raise ValueError(f"{fn}: `cache` must be a DecoderCache (see Decoder.init_cache), "
                             f"got {type(cache).__name__}")
        if not isinstance(cache.layers, tuple) or len(cache.layers) != len(self.groups_spec):
            got = len(cache.layers) if isinstance(cache.layers, tuple) else type(cache.layers).__name__
            raise ValueError(f"{fn}: `cache.layers` must hold one cache per layer group ({len(self.groups_spec)} "
                             f"for pattern {self.cfg.pattern!r}), got {got}")
        _validate.check_cache_length(fn, cache.length, batch)
        capacity = _cache_capacity(cache.layers)
        if capacity is not None and _validate.is_concrete(cache.length):
            filled = _validate.max_filled(cache.length)
            if filled + new_tokens > capacity:
                raise ValueError(f"{fn}: `cache` is full: {filled} + {new_tokens} tokens exceed capacity {capacity}; "
                                 "allocate a larger max_len (Decoder.init_cache)")
        if self.pos is not None and _validate.is_concrete(cache.length):
            last = _validate.max_filled(cache.length) + new_tokens - 1
            if last >= self.cfg.max_seq_len:
                raise ValueError(f"{fn}: position {last} exceeds the learned position table "
                                 f"(max_seq_len={self.cfg.max_seq_len})")

    def embed_tokens(self, tokens: Array, positions: Array) -> Array:
        """``tokens [B, T]`` at ``positions [B, T]`` -> the residual stream's input ``[B, T, d]``
        (token embedding + learned positions where the config has them; compute dtype)."""
        h = jnp.take(self.embed[...], tokens, axis=0)
        if self.pos is not None:
            h = h + jnp.take(self.pos[...], positions, axis=0)
        return h.astype(self.compute_dtype)

    def output_logits(self, h: Array) -> Array:
        """The last hidden state ``[B, T, d]`` -> logits ``[B, T, vocab]`` float32 (final norm, then
        the tied embedding or the LM head). With :meth:`embed_tokens`, what a probe that walks the
        layers itself (``experiments.attnres``) needs to reproduce :meth:`forward`."""
        h = self.final_norm(h)
        w = self.embed[...].T if self.head is None else self.head[...]
        return jnp.einsum("btd,dv->btv", h.astype(jnp.float32), w.astype(jnp.float32))

    def _run(self, h: Array, caches, mode: str, segment_ids):
        stream = residual_stream(self.cfg)
        carry = stream.init(h)
        new_caches, moe_stats = [], []
        for (first, p, n), group in zip(self.groups_spec, self.groups):
            group_cache = None if caches is None else caches[len(new_caches)]
            graphdef, state = nnx.split(group)

            def body(carry, xs, first=first, graphdef=graphdef):
                st, cache, idx = xs
                return nnx.merge(graphdef, st).run(stream, carry, cache, idx, mode, segment_ids)

            policy = remat_policy(self.cfg.remat)
            if policy is not None:
                body = jax.checkpoint(body, policy=policy)
            if n == 1:
                carry, cache, stats = body(carry, (state, group_cache, first))
            else:
                def scan_body(carry, xs, body=body):
                    carry, cache, stats = body(carry, xs)
                    return carry, (cache, stats)

                idx = first + p * jnp.arange(n)
                if group_cache is None:
                    carry, (cache, stats) = jax.lax.scan(scan_body, carry, (state, group_cache, idx),
                                                         unroll=bool(self.cfg.scan_unroll))
                else:
                    carry, cache, stats = _scan_with_cache(body, carry, state, group_cache, idx)
            new_caches.append(cache)
            moe_stats.append(stats)
        out = stream.final(carry, None if self.final_query is None else self.final_query[...])
        return out, tuple(new_caches), moe_stats

    # ------------------------------------------------------------------ public
    @_at_model_precision
    def forward(self, tokens: Array, *, segment_ids: Optional[Array] = None,
                positions: Optional[Array] = None) -> tuple[Array, dict[str, Any]]:
        """``tokens [B, T]`` -> ``(logits [B, T, vocab] float32, aux)``.

        ``positions [B, T]`` index the learned position table (``positions="learned"``). Rotary
        layers (softmax with ``positions="rope"``, MLA with ``mla_rope``) rotate at ``0..T-1``; RoPE
        is relative, so only a shift would differ, and passing ``positions`` to such a model is
        refused rather than silently ignored."""
        self._check_tokens("forward", tokens, 2)
        if positions is not None and (self.cfg.positions == "rope" and "S" in self.cfg.pattern
                                      or self.cfg.mla_rope and "M" in self.cfg.pattern):
            raise ValueError("Decoder.forward: `positions` only indexes a learned position table; this model's "
                             "rotary layers rotate at 0..T-1 (pass positions=None)")
        B, T = tokens.shape
        if self.pos is not None and T > self.cfg.max_seq_len:
            raise ValueError(f"Decoder.forward: sequence length {T} exceeds max_seq_len={self.cfg.max_seq_len}")
        _validate.check_segment_ids("Decoder.forward", segment_ids, B, T)
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(T), (B, T))
        else:
            _validate.require_shape("Decoder.forward", "positions", positions, (B, T), "[B,T] (as tokens)")
            dtype = positions.dtype if hasattr(positions, "dtype") else np.asarray(positions).dtype
            if not jnp.issubdtype(dtype, jnp.integer):
                raise ValueError(f"Decoder.forward: `positions` must be an integer array, got dtype {dtype}")
            if self.pos is not None:
                _check_ids("Decoder.forward", "positions", positions, self.cfg.max_seq_len, "max_seq_len")
        h, _, stats = self._run(self.embed_tokens(tokens, positions), None, "train", segment_ids)
        return self.output_logits(h), {"moe": stats}

    def __call__(self, tokens: Array, *, segment_ids: Optional[Array] = None) -> Array:
        return self.forward(tokens, segment_ids=segment_ids)[0]

    def init_cache(self, batch: int, max_len: int, dtype=jnp.float32) -> DecoderCache:
        """Empty caches for ``batch`` rows: attention layers hold ``max_len`` tokens in ``dtype``; fixed-state
        layers keep float32 states (their convolution windows in ``dtype``)."""
        _validate.require_float_dtype("Decoder.init_cache", "dtype", dtype)
        caches = []
        for (_, _, n), group in zip(self.groups_spec, self.groups):
            if n == 1:
                caches.append(group.init_cache(batch, max_len, dtype))
            else:
                graphdef, state = nnx.split(group)
                one = nnx.merge(graphdef, jax.tree.map(lambda a: a[0], state)).init_cache(batch, max_len, dtype)
                caches.append(jax.tree.map(lambda a: jnp.broadcast_to(a, (n, *a.shape)), one))
        return DecoderCache(tuple(caches), jnp.zeros((batch,), jnp.int32))

    @_at_model_precision
    def prefill(self, tokens: Array, cache: DecoderCache, *, segment_ids: Optional[Array] = None):
        """Run a prompt ``[B, T]`` after what ``cache`` holds; ``(logits [B, T, vocab], cache)``.

        ``segment_ids`` packs documents into a row for the prompt's own logits. The cache it leaves is not one
        document's: fixed-state layers end in the last document's state, while attention layers keep every
        document's keys, and a decode step after it attends to all of them. To continue a document, prefill it
        alone in its row."""
        self._check_tokens("prefill", tokens, 2)
        B, T = tokens.shape
        self._check_cache("prefill", cache, B, T)
        _validate.check_segment_ids("Decoder.prefill", segment_ids, B, T)
        positions = cache.length[:, None] + jnp.arange(T)[None, :]
        h, layers, _ = self._run(self.embed_tokens(tokens, positions), cache.layers, "prefill", segment_ids)
        return self.output_logits(_poison_overflow(h, cache, T)), DecoderCache(layers, cache.length + T)

    @_at_model_precision
    def decode(self, token: Array, cache: DecoderCache):
        """One token per row ``[B]`` -> ``(logits [B, vocab], cache)``."""
        self._check_tokens("decode", token, 1)
        self._check_cache("decode", cache, token.shape[0], 1)
        h, layers, _ = self._run(self.embed_tokens(token[:, None], cache.length[:, None]), cache.layers, "decode", None)
        return self.output_logits(_poison_overflow(h, cache, 1))[:, 0], DecoderCache(layers, cache.length + 1)

    def moe_layers(self):
        """``(group_index, macro_position, MoE module)`` for every MoE FFN (stacked for scanned groups)."""
        out = []
        for g, group in enumerate(self.groups):
            for j, block in enumerate(group.blocks):
                if block.is_moe:
                    out.append((g, j, block.ffn))
        return out

    def unscanned(self) -> "Decoder":
        """The same model with every layer its own group (``scan_layers=False``) — for serving.

        A scanned group keeps its layers' caches stacked along a layer axis, and each decode
        step reads a layer's slice out of the stack and writes it back whole: a copy of the
        cache per step that XLA does not remove (``experiments.decode_scaling``: MHA at 64K on
        the CPU, 222 → 140 ms per step unscanned). Train scanned (one macrocycle to compile),
        decode unscanned: this returns a new model whose layer ``first + r·p + j`` holds slice
        ``r`` of the scanned group's block ``j``; its outputs and caches' contents are the
        same up to float rounding (caches are per layer instead of stacked). Every array is
        copied, none shared (so donating one model's state leaves the other intact): while
        both models live the weights take twice the memory, and the unscanned model compiles
        layer by layer. Arrays keep their placement; on a mesh, re-shard with the rules.
        """
        cfg = dataclasses.replace(self.cfg, scan_layers=False)
        target = nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0)))
        src = nnx.to_pure_dict(nnx.state(self))
        dst = {k: jax.tree.map(jnp.copy, v) for k, v in src.items() if k != "groups"}
        groups = {}
        for g, (first, p, n) in enumerate(self.groups_spec):
            blocks = src["groups"][g]["blocks"]
            for r in range(n):
                for j in range(p):
                    block = jax.tree.map(jnp.copy if n == 1 else (lambda a, r=r: a[r]), blocks[j])
                    groups[first + r * p + j] = {"blocks": {0: block}}
        dst["groups"] = groups
        state = nnx.state(target)
        nnx.replace_by_pure_dict(state, dst)
        nnx.update(target, state)
        return target

    def update_router_biases(self, aux: dict[str, Any], *, rule: str = "sign", rate: float = 1e-3) -> None:
        """Update every MoE layer's score-correction bias from ``forward``'s ``aux`` (outside the optimizer)."""
        for g, j, moe in self.moe_layers():
            moe.update_bias(aux["moe"][g][j], rule=rule, rate=rate)


class InferenceSteps(NamedTuple):
    """A :class:`Decoder` split once into its state and two jitted steps over it.

    ``prefill(state, tokens [B, T], cache) -> (logits [B, T, V], cache)`` and
    ``decode(state, token [B], cache) -> (logits [B, V], cache)`` are plain ``jax.jit``
    functions with the cache donated (updated in place). Why not ``nnx.jit``: it re-walks the
    module graph in Python on every call, a cost that grows with the number of parameter
    leaves and, for small models, dominated per-token time (CPU, an unscanned 4-layer hybrid
    with MoE: 3.99 ms/token through ``nnx.jit``, 1.04 ms this way). ``state`` is a snapshot:
    re-split after changing the module's parameters.
    """

    state: Any
    prefill: Any
    decode: Any


def inference_steps(model: Decoder) -> InferenceSteps:
    """``model`` split once; jitted ``prefill`` and ``decode`` over its state (cache donated). Models of the
    same structure share the jitted functions, so a second call (another prompt, or new weights of the same
    config) reuses their compilations."""
    graphdef, state = nnx.split(model)
    prefill, decode = _jitted_steps(graphdef)
    return InferenceSteps(state, prefill, decode)


@functools.lru_cache(maxsize=16)
def _jitted_steps(graphdef):
    prefill = jax.jit(lambda st, tokens, cache: nnx.merge(graphdef, st).prefill(tokens, cache), donate_argnums=2)
    decode = jax.jit(lambda st, token, cache: nnx.merge(graphdef, st).decode(token, cache), donate_argnums=2)
    return prefill, decode
