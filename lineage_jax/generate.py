"""Sample from a trained model: ``python -m lineage_jax.generate --workdir DIR --prompt TEXT``.

``--hf DIR`` samples from a transformers checkpoint instead (``lineage_jax.hf``: GPT-2, Kimi
Linear, DeepSeek-V3). The prompt is ``--prompt-ids 1,2,3`` (token ids), or ``--prompt`` text
for a GPT-2 checkpoint with GPT-2's vocabulary (the GPT-2 BPE tokenizer ships with the library;
other families' tokenizers do not).

Prefill runs the prompt through every layer once (filling KV caches, MLA latent
caches and recurrent states); decode then feeds one token at a time through each
layer's cache. Sampling: temperature, top-k, top-p (nucleus). Output streams as it
is generated; the tokens/s of prefill and decode are reported at the end.
:func:`generate_batch` samples after several prompts of different lengths as one batch.

:class:`ShardedDecoder` runs the same prefill / decode jitted on a device mesh, with the
parameters in the sharding rules' layout and every cache split over the batch.
"""

from __future__ import annotations

import argparse
import math
import numbers
import os
import sys
import time
from typing import Callable, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from lineage_jax.layers.moe import MoE
from lineage_jax.memory._validate import is_int
from lineage_jax.models import Decoder, ModelConfig, inference_steps
from lineage_jax.parallel.expert import ExpertParallel, enable_expert_parallel, resolve_expert_parallel
from lineage_jax.parallel.mesh import mesh_shape
from lineage_jax.parallel.rules import (Rules, check_mesh, logical_sharding, logical_to_spec, mesh_axes_of,
                                        state_shardings)
from lineage_jax.train.checkpoint import Checkpointer
from lineage_jax.train.config import TrainConfig
from lineage_jax.train.loop import run_configs
from lineage_jax.train.step import init_state


def load(workdir: str) -> tuple[Decoder, TrainConfig]:
    """The latest checkpoint in ``workdir`` as a ready ``Decoder``."""
    configs = run_configs(workdir)
    if configs is None:
        raise ValueError(f"--workdir {workdir!r} holds no run (no config.json); train one with python -m lineage_jax.train")
    train_cfg, model_cfg = configs
    graphdef, abstract = _abstract_state(model_cfg, train_cfg)
    with Checkpointer(os.path.join(workdir, "checkpoints"), async_save=False) as ckpt:
        state, _ = ckpt.restore(abstract)
    return nnx.merge(graphdef, state.params, state.rest), train_cfg


def _abstract_state(model_cfg: ModelConfig, train_cfg: TrainConfig):
    """``(graphdef, abstract TrainState)`` without allocating parameters."""
    out = {}

    def build():
        graphdef, state, tx = init_state(model_cfg, train_cfg)
        out["graphdef"] = graphdef
        return state

    abstract = jax.eval_shape(build)
    return out["graphdef"], abstract


MIN_TEMPERATURE = 1e-30  # a normal float32: logits a rounding step apart stay ~1e23 apart, greedy in effect


def sample_token(logits: jax.Array, key: jax.Array, *, temperature: float = 1.0, top_k: int = 0,
                 top_p: float = 1.0) -> jax.Array:
    """``logits [B, V]`` -> token ids ``[B]``. ``temperature = 0`` is greedy; the logits are shifted to a
    maximum of 0 before they are divided, and a temperature below ``MIN_TEMPERATURE`` is taken as it (a
    float32 division by it overflowed every logit, and the draw took token 0)."""
    if temperature == 0:
        return jnp.argmax(logits, axis=-1)
    logits = logits.astype(jnp.float32)
    logits = (logits - jnp.max(logits, axis=-1, keepdims=True)) / max(float(temperature), MIN_TEMPERATURE)
    if top_k:
        kth = jax.lax.top_k(logits, top_k)[0][..., -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if top_p < 1.0:
        sorted_logits = jnp.sort(logits, axis=-1)[..., ::-1]
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        cum = jnp.cumsum(probs, axis=-1)
        # Keep the smallest prefix whose mass reaches top_p (always at least one token).
        cutoff_idx = jnp.sum(cum - probs < top_p, axis=-1, keepdims=True) - 1
        cutoff = jnp.take_along_axis(sorted_logits, cutoff_idx, axis=-1)
        logits = jnp.where(logits < cutoff, -jnp.inf, logits)
    return jax.random.categorical(key, logits, axis=-1)


def _check_prompt(fn: str, name: str, prompt, vocab_size: int) -> list[int]:
    if isinstance(prompt, (str, bytes)) or not hasattr(prompt, "__len__") or not len(prompt):
        raise ValueError(f"{fn}: `{name}` must contain at least one token")
    if not all(is_int(t) for t in prompt):
        raise ValueError(f"{fn}: `{name}` must be a list of int token ids")
    bad = [int(t) for t in prompt if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"{fn}: `{name}` holds {len(bad)} id(s) outside [0, vocab_size={vocab_size}), "
                         f"e.g. {bad[:5]}")
    return [int(t) for t in prompt]


def generate(model: Decoder, prompt: list[int], *, max_new_tokens: int = 100, temperature: float = 0.8,
             top_k: int = 0, top_p: float = 1.0, seed: int = 0, eos_id: Optional[int] = None,
             on_token: Optional[Callable[[list[int]], None]] = None) -> tuple[list[int], dict]:
    """Prefill ``prompt`` then sample up to ``max_new_tokens`` tokens (batch of one; ``on_token`` gets the
    tokens so far after each one). Returns ``(tokens, stats)``; see :func:`generate_batch`."""
    prompt = _check_prompt("generate", "prompt", prompt, model.cfg.vocab_size)
    outs, stats = _sample_rows("generate", model, [prompt], max_new_tokens=max_new_tokens, temperature=temperature,
                               top_k=top_k, top_p=top_p, seed=seed, eos_id=eos_id,
                               on_token=None if on_token is None else lambda rows: on_token(rows[0]))
    return outs[0], stats


def generate_batch(model: Decoder, prompts: list[list[int]], *, max_new_tokens: int = 100,
                   temperature: float = 0.8, top_k: int = 0, top_p: float = 1.0, seed: int = 0,
                   eos_id: Optional[int] = None) -> tuple[list[list[int]], dict]:
    """Sample up to ``max_new_tokens`` tokens after each of several prompts of any lengths, as one batch.

    The rows advance together and without padding: the shortest prompt's length of every prompt is
    prefilled in one call, then each decode step feeds every row its next prompt token while it has one
    and its last sampled token after, so each layer's cache (KV, MLA latent, recurrent state, conv
    history) holds exactly its row's tokens. A row stops at ``eos_id`` (kept) or after ``max_new_tokens``;
    the call returns when every row has. With ``temperature=0`` each row is what :func:`generate` gives
    its prompt alone (up to the rounding of the chunked against the one-token form); sampled rows draw
    from one key per step.

    Returns:
      ``(tokens, stats)``: the new tokens of each row, and ``prompt_tokens`` / ``new_tokens`` (all rows),
      ``prefill_s``, ``prefill_tokens_per_s``, ``decode_s``, ``first_decode_s`` (the first decode step,
      which holds its compilation on a first call) and ``decode_tokens_per_s`` (tokens of all rows through
      the decode steps after the first, a second).
    """
    fn = "generate_batch"
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError(f"{fn}: `prompts` must be a non-empty list of prompts (lists of token ids)")
    prompts = [_check_prompt(fn, f"prompts[{i}]", p, model.cfg.vocab_size) for i, p in enumerate(prompts)]
    return _sample_rows(fn, model, prompts, max_new_tokens=max_new_tokens, temperature=temperature,
                        top_k=top_k, top_p=top_p, seed=seed, eos_id=eos_id, on_token=None)


def _sample_rows(fn, model, prompts, *, max_new_tokens, temperature, top_k, top_p, seed, eos_id, on_token):
    """The sampling loop of :func:`generate` and :func:`generate_batch` (checked prompts)."""
    cfg = model.cfg
    if not is_int(max_new_tokens) or max_new_tokens < 0:
        raise ValueError(f"{fn}: `max_new_tokens` must be an int >= 0, got {max_new_tokens!r}")
    if not is_int(top_k) or not 0 <= top_k <= cfg.vocab_size:
        raise ValueError(f"{fn}: `top_k` must be an int in [0, vocab_size={cfg.vocab_size}], got {top_k!r}")
    if not isinstance(temperature, numbers.Real) or not 0 <= temperature < math.inf:
        raise ValueError(f"{fn}: `temperature` must be finite and >= 0, got {temperature!r}")
    if not isinstance(top_p, numbers.Real) or not 0 < top_p <= 1:
        raise ValueError(f"{fn}: `top_p` must be in (0, 1], got {top_p!r}")
    if eos_id is not None and (not is_int(eos_id) or not 0 <= eos_id < cfg.vocab_size):
        raise ValueError(f"{fn}: `eos_id` must be an int token id in [0, vocab_size={cfg.vocab_size}) or None, "
                         f"got {eos_id!r}")
    if not is_int(seed) or not 0 <= seed < 2 ** 32:
        raise ValueError(f"{fn}: `seed` must be an int in [0, 2**32), got {seed!r}")
    lens = np.array([len(p) for p in prompts])
    B, first, longest = len(prompts), int(lens.min()), int(lens.max())
    max_len = longest + max_new_tokens
    fed = max(longest, max_len - 1)  # the positions fed (the last sampled token is not)
    if cfg.positions == "learned" and fed > cfg.max_seq_len:
        name = "prompt" if fn == "generate" else "the longest prompt"
        raise ValueError(f"{fn}: {name} + max_new_tokens - 1 = {fed} positions exceed max_seq_len={cfg.max_seq_len}")
    ids = np.zeros((B, longest), np.int32)
    for b, p in enumerate(prompts):
        ids[b, :len(p)] = p
    state, prefill, decode = inference_steps(model)   # split once, cache donated
    key = jax.random.key(seed)
    cache = model.init_cache(B, max_len)
    t0 = time.perf_counter()
    logits, cache = prefill(state, jnp.asarray(ids[:, :first]), cache)
    logits = logits[:, -1]
    jax.block_until_ready(logits)
    t1 = time.perf_counter()
    out: list[list[int]] = [[] for _ in range(B)]
    done = np.full(B, max_new_tokens == 0)
    times = []  # when each step's tokens were sampled
    pos = first  # the position the latest logits predict
    while not done.all():
        key, sub = jax.random.split(key)
        sampled = np.asarray(_SAMPLE(logits, sub, temperature=temperature, top_k=top_k, top_p=top_p))
        times.append(time.perf_counter())
        for b in np.flatnonzero(~done & (pos >= lens)):
            out[b].append(int(sampled[b]))
            done[b] = len(out[b]) == max_new_tokens or out[b][-1] == eos_id
        if on_token is not None:
            on_token(out)
        if done.all():
            break
        feed = np.where(pos < lens, ids[:, min(pos, longest - 1)], sampled).astype(np.int32)
        logits, cache = decode(state, jnp.asarray(feed), cache)
        pos += 1
    t2 = time.perf_counter()
    # the first decode step (between the first two samples) compiles it on a first call: the rate is the rest's
    steady = len(times) - 2
    stats = {"prompt_tokens": int(lens.sum()), "new_tokens": sum(map(len, out)), "prefill_s": t1 - t0,
             "prefill_tokens_per_s": B * first / max(t1 - t0, 1e-9), "decode_s": t2 - t1,
             "first_decode_s": times[1] - times[0] if len(times) > 1 else 0.0,
             "decode_tokens_per_s": B * steady / max(times[-1] - times[1], 1e-9) if steady > 0 else 0.0}
    return out, stats


_SAMPLE = jax.jit(sample_token, static_argnames=("temperature", "top_k", "top_p"))


class ShardedDecoder:
    """Jitted ``init_cache`` / ``prefill`` / ``decode`` of a ``Decoder`` on ``mesh``.

    Parameters keep the rules' shardings; every cache array is split over the batch mesh
    axes along its batch dimension (dimension 1 for scanned layer groups, 0 otherwise).
    ``expert_parallel="auto"`` uses expert parallelism when the batch (the tokens of one
    decode step) divides over the batch mesh axes and no MoE layer uses capacity dispatch (under
    expert parallelism capacity is counted per pair of devices, one token each a decode step, so
    other tokens would be dropped than on one device).
    """

    def __init__(self, model: nnx.Module, mesh: Mesh, *, batch_size: int, max_len: int,
                 rules: Optional[Rules] = None, expert_parallel: Union[str, bool, ExpertParallel] = "auto",
                 cache_dtype=jnp.float32):
        check_mesh("ShardedDecoder", mesh, rules)
        for name, val in (("batch_size", batch_size), ("max_len", max_len)):
            if isinstance(val, bool) or not isinstance(val, int) or val <= 0:
                raise ValueError(f"ShardedDecoder: `{name}` must be a positive int, got {val!r}")
        if not hasattr(model, "groups_spec"):
            raise ValueError("ShardedDecoder: `model` must be a lineage_jax Decoder")
        self.mesh, self.rules, self.batch_size = mesh, rules, batch_size
        sizes = mesh_shape(mesh)
        batch_axes = [a for a in mesh_axes_of("batch", rules) if sizes.get(a, 1) > 1]
        if expert_parallel == "auto" and batch_size % int(np.prod([sizes[a] for a in batch_axes])):
            expert_parallel = False
        if expert_parallel == "auto" and any(isinstance(m, MoE) and m.dispatch == "capacity"
                                             for _, m in nnx.iter_graph(model)):
            expert_parallel = False
        self.expert_parallel = resolve_expert_parallel(model, mesh, rules, expert_parallel)
        self.graphdef, state = nnx.split(model)
        self.state_shardings = state_shardings(state, mesh, rules)
        abstract_cache = jax.eval_shape(lambda: model.init_cache(batch_size, max_len, cache_dtype))
        self.cache_shardings = self._cache_shardings(model, abstract_cache)
        tok = NamedSharding(mesh, logical_to_spec(("batch",), mesh, rules, shape=(batch_size,)))
        logits2 = NamedSharding(mesh, logical_to_spec(("batch", None), mesh, rules, shape=(batch_size, 1)))
        logits3 = NamedSharding(mesh, logical_to_spec(("batch", None, None), mesh, rules, shape=(batch_size, 1, 1)))
        self._init_cache = jax.jit(lambda: model.init_cache(batch_size, max_len, cache_dtype),
                                   out_shardings=self.cache_shardings)
        self._prefill = jax.jit(self._prefill_impl, in_shardings=(self.state_shardings, tok, self.cache_shardings),
                                out_shardings=(logits3, self.cache_shardings), donate_argnums=(2,))
        self._decode = jax.jit(self._decode_impl, in_shardings=(self.state_shardings, tok, self.cache_shardings),
                               out_shardings=(logits2, self.cache_shardings), donate_argnums=(2,))

    def _cache_shardings(self, model, cache):
        def spec_for(leaf, batch_dim):
            axes = [None] * leaf.ndim
            axes[batch_dim] = "batch"
            return NamedSharding(self.mesh, logical_to_spec(axes, self.mesh, self.rules, shape=leaf.shape))

        layers = tuple(jax.tree.map(lambda leaf, d=(1 if n > 1 else 0): spec_for(leaf, d), group_cache)
                       for (_, _, n), group_cache in zip(model.groups_spec, cache.layers))
        return type(cache)(layers, spec_for(cache.length, 0))

    def _model(self, state):
        model = nnx.merge(self.graphdef, state)
        if self.expert_parallel is not None:
            enable_expert_parallel(model, self.expert_parallel)
        return model

    def _prefill_impl(self, state, tokens, cache):
        with logical_sharding(self.mesh, self.rules):
            return self._model(state).prefill(tokens, cache)

    def _decode_impl(self, state, token, cache):
        with logical_sharding(self.mesh, self.rules):
            return self._model(state).decode(token, cache)

    def init_cache(self):
        return self._init_cache()

    def place(self, state: nnx.State) -> nnx.State:
        """``state`` laid out as this decoder's rules lay it out on its mesh (a copy where it differs): for a
        state sharded by other rules or on another mesh, e.g. a training run's."""
        return jax.device_put(state, self.state_shardings)

    def _call(self, fn, name, state, *args):
        try:
            return fn(state, *args)
        except ValueError as e:
            if "does not match the sharding" not in str(e):
                raise
            raise ValueError(f"ShardedDecoder.{name}: `state` is laid out by other rules or on another mesh than "
                             "this decoder's; lay it out with `decoder.place(state)` once, before decoding") from e

    def prefill(self, state: nnx.State, tokens: jax.Array, cache):
        """``tokens [B, T]`` -> ``(logits [B, T, vocab], cache)`` (``state = nnx.state(model)``)."""
        return self._call(self._prefill, "prefill", state, tokens, cache)

    def decode(self, state: nnx.State, token: jax.Array, cache):
        """``token [B]`` -> ``(logits [B, vocab], cache)``."""
        return self._call(self._decode, "decode", state, token, cache)


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lineage_jax.generate", description=__doc__.splitlines()[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--workdir", help="a training run directory")
    src.add_argument("--hf", metavar="DIR", help="a transformers checkpoint directory (config.json + safetensors)")
    prompt_arg = p.add_mutually_exclusive_group(required=True)
    prompt_arg.add_argument("--prompt")
    prompt_arg.add_argument("--prompt-ids", help="the prompt as comma-separated token ids")
    p.add_argument("--max-new-tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    from lineage_jax.data.tokenizers import get_tokenizer

    tok = None
    try:
        if args.hf is not None:
            from lineage_jax import hf
            model = hf.load(args.hf)
            if model.cfg.name == "hf_gpt2" and model.cfg.vocab_size in (50257, 50304):
                tok = get_tokenizer("gpt2")
        else:
            model, train_cfg = load(args.workdir)
            tok = get_tokenizer(train_cfg.tokenizer)
    except (ValueError, FileNotFoundError) as e:
        p.error(str(e))
    model = model.unscanned()  # one cache buffer per layer (Decoder.unscanned; compiles layer by layer)
    if args.prompt_ids is not None:
        try:
            prompt = [int(t) for t in args.prompt_ids.split(",") if t.strip()]
        except ValueError:
            p.error(f"--prompt-ids must be comma-separated integers, got {args.prompt_ids!r}")
        if any(not 0 <= t < model.cfg.vocab_size for t in prompt):
            p.error(f"--prompt-ids must lie in [0, {model.cfg.vocab_size})")
    elif tok is None:
        p.error("this checkpoint's tokenizer is not available here: give --prompt-ids")
    else:
        prompt = tok.encode(args.prompt)
    if tok is None:  # token ids in, token ids out
        tok = type("Ids", (), {"decode": staticmethod(lambda ids: "".join(f" {i}" for i in ids)), "eos_id": None})()
        shown = ",".join(map(str, prompt))
    else:
        shown = tok.decode(prompt) if args.prompt is None else args.prompt
    printed = [0]
    sys.stdout.write(shown)

    def stream(tokens, last=False):
        # a character whose bytes are still arriving decodes to U+FFFD: held back until it is whole (or the end)
        text = tok.decode(tokens)
        upto = len(text) if last else len(text.rstrip("\ufffd"))
        sys.stdout.write(text[printed[0]:upto])
        sys.stdout.flush()
        printed[0] = max(printed[0], upto)

    try:
        new, stats = generate(model, prompt, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                              top_k=args.top_k, top_p=args.top_p, seed=args.seed, eos_id=tok.eos_id,
                              on_token=stream)
    except ValueError as e:
        p.error(str(e))
    stream(new, last=True)
    sys.stdout.write("\n")
    print(f"[prefill {stats['prompt_tokens']} tok at {stats['prefill_tokens_per_s']:,.0f} tok/s (incl. compile); "
          f"decode {stats['new_tokens']} tok: the first step {stats['first_decode_s']:.2f} s (incl. compile), "
          f"then {stats['decode_tokens_per_s']:,.1f} tok/s]", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
