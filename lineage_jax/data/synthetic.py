"""Synthetic recall tasks and eviction probes as grain random-access sources.

Every task is a frozen dataclass; ``task[i]`` is a pure function of
``(task arguments, i)`` (its RNG is seeded by ``(seed, i, task name)``), and
returns the batch fields for one sequence of ``seq_len`` tokens::

    tokens       int32   [T]   x[:-1]   of a generated sequence x of T + 1 tokens
    targets      int32   [T]   x[1:]    (targets[t] == tokens[t + 1] everywhere)
    segment_ids  int32   [T]   all ones: one document (a probe's "document switch"
                               is a token, not a segment boundary, or the state
                               reset would solve it for the model)
    mask         float32 [T]   1.0 exactly where targets[t] is an answer to score

``task.info(i)`` adds ``kinds`` (int32 [T]: 0 = not a query, j = ``task.KINDS[j-1]``)
and task-specific metadata, so experiments can report accuracy per query kind.

Key-value tasks share one format: a sequence of (key, value) *pairs*, keys and
values from disjoint token ranges. Every pair binds its key to its value; a
query is simply a pair whose key is already bound, so its value is predictable
as the key's latest binding (the answer appears in the input only after it was
predicted, as in teacher-forced language modelling). Probe vocabulary:
0 = BLANK (padding), 1 = SWITCH (document switch), keys ``[2, 2 + (V-2)//2)``,
values ``[2 + (V-2)//2, V)``.

=================  ==========================================  ===================================
task               what it isolates                            predicted to fail                  
=================  ==========================================  ===================================
mqar               associative recall of N pairs (Zoology);     linear attention once N exceeds the
                   queries at power-law gaps                    state (interference); attention and
                                                                DeltaNet-family solve it
niah               copy a 5-digit passkey from depth d of a     pure-decay memories as T grows (Gated
                   noise haystack (RULER S-NIAH-1)              DeltaNet paper: Mamba2 99 -> 30% from
                                                                1K to 8K) and additive linear attention;
                                                                attention and DeltaNet hold (~97%+)
overwrite          keys re-bound mid-sequence; queries want     linear attention (new value adds to
                   the *latest* value                           the old: a blend); softmax without
                                                                positions (NoPE) has no recency
                                                                signal unless it learns one from
                                                                the causal mask; DeltaNet / GDN /
                                                                KDA erase and pass
fade               doc A's facts (queried inside A), SWITCH,    DeltaNet and linear attention: with
                   doc B's fresh facts, queries about B;        N_A + N_B > state dim, A's stale
                   optional unscored "stale" A queries at the   facts crowd B (no key points at
                   end measure what survived                    "everything"); GDN/KDA gate A away
mixed_half_lives   long-lived facts written first, queried      GDN: one scalar gate must either
                   last, under a stream of junk bindings that   keep the junk (capacity overflows)
                   are queried 1..max_lag pairs later and then  or fade the long facts with it; KDA
                   never again (long and junk keys come from    (per-channel decay) and attention
                   disjoint key ranges: separable at write)     pass; linear attention fails
=================  ==========================================  ===================================

The predictions are what each architecture's update rule implies for a small
model whose state is smaller than the number of bindings it must juggle: an
additive write cannot erase (the delta rule's motivation: Schlag et al., "Linear
Transformers Are Secretly Fast Weight Programmers", 2021, arXiv:2102.11174), a
memory without forgetting fills with stale facts, and one scalar decay cannot keep
some facts while fading others (Yang, Kautz, Hatamizadeh, "Gated Delta Networks:
Improving Mamba2 with Delta Rule", 2024, arXiv:2412.06464; Kimi Team, "Kimi Linear:
An Expressive, Efficient Attention Architecture", 2025, arXiv:2510.26692); the Gated
DeltaNet paper is also the source of the S-NIAH figures. Measuring them is the
experiments' job. Sizes: pick ``num_facts`` <= the head's key dim and, for
``fade``, ``num_facts_a + num_facts`` > it.
"""

from __future__ import annotations

import dataclasses
import functools
import zlib
from typing import ClassVar, Optional

import numpy as np

from lineage_jax.data.tokenizers import get_tokenizer

__all__ = ["MQAR", "PasskeyNIAH", "OverwriteProbe", "FadeProbe", "MixedHalfLivesProbe", "TASKS", "get_task", "BLANK", "SWITCH"]

BLANK = 0
SWITCH = 1
_FIRST_KEY = 2


def _int(name: str, value, minimum: int) -> None:
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name}: must be an int >= {minimum}, got {value!r}")


@dataclasses.dataclass(frozen=True)
class _Task:
    """Shared machinery: indexing, seeding, the batch dict."""

    KINDS: ClassVar[tuple[str, ...]] = ()
    SCORED: ClassVar[tuple[str, ...]] = ()
    name: ClassVar[str] = ""

    def _validate_common(self) -> None:
        _int("seq_len", self.seq_len, 2)
        _int("seed", self.seed, 0)
        _int("num_examples", self.num_examples, 1)

    def __len__(self) -> int:
        return int(self.num_examples)

    def _rng(self, index: int) -> np.random.Generator:
        salt = zlib.crc32(self.name.encode())
        return np.random.default_rng(np.random.SeedSequence([int(self.seed), int(index), salt]))

    def _check_index(self, index) -> int:
        index = int(index)
        if not 0 <= index < self.num_examples:
            raise IndexError(f"index {index} out of range [0, {self.num_examples})")
        return index

    def _generate(self, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, dict]:
        """Return (x int64 [T+1], kinds_x int32 [T+1] (kind of predicting x[p]), extra info)."""
        raise NotImplementedError

    def _build(self, index):
        x, kinds_x, extra = self._generate(self._rng(self._check_index(index)))
        T = self.seq_len
        if x.shape != (T + 1,) or kinds_x.shape != (T + 1,):
            raise AssertionError(f"{self.name}: generated {x.shape}, expected ({T + 1},)")
        kinds = kinds_x[1:].astype(np.int32)
        scored = np.array([k in self.SCORED for k in self.KINDS], bool)
        mask = np.zeros(T, np.float32)
        if len(scored):
            mask[kinds > 0] = scored[kinds[kinds > 0] - 1]
        example = {
            "tokens": x[:-1].astype(np.int32),
            "targets": x[1:].astype(np.int32),
            "segment_ids": np.ones(T, np.int32),
            "mask": mask,
        }
        return example, kinds, extra

    def __getitem__(self, index) -> dict:
        return self._build(index)[0]

    def info(self, index) -> dict:
        """``kinds`` (int32 [T]), ``kind_names`` and task-specific metadata for example ``index``."""
        _, kinds, extra = self._build(index)
        return {"kinds": kinds, "kind_names": self.KINDS, **extra}


class _Pairs:
    """Append-only sequence builder: tokens plus the query kind of each position."""

    def __init__(self):
        self.x: list[int] = []
        self.kinds: list[int] = []

    def token(self, tok: int) -> None:
        self.x.append(int(tok))
        self.kinds.append(0)

    def pair(self, key: int, value: int, kind: int = 0) -> None:
        self.x += [int(key), int(value)]
        self.kinds += [0, int(kind)]

    def finish(self, length: int) -> tuple[np.ndarray, np.ndarray]:
        if len(self.x) > length:
            raise AssertionError(f"sequence overflow: {len(self.x)} > {length}")
        pad = length - len(self.x)
        return np.array(self.x + [BLANK] * pad, np.int64), np.array(self.kinds + [0] * pad, np.int32)


def _key_value_ranges(vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    num_keys = (vocab_size - _FIRST_KEY) // 2
    return np.arange(_FIRST_KEY, _FIRST_KEY + num_keys), np.arange(_FIRST_KEY + num_keys, vocab_size)


def _new_value(rng, values: np.ndarray, avoid: Optional[int]) -> int:
    while True:
        v = int(values[rng.integers(len(values))])
        if v != avoid:
            return v


# --------------------------------------------------------------------------- MQAR


@dataclasses.dataclass(frozen=True)
class MQAR(_Task):
    """Multi-query associative recall (Arora, Eyuboglu et al., Zoology, 2023).

    Layout of ``x`` (T + 1 tokens): ``k1 v1 k2 v2 ... kN vN`` (keys distinct from
    ``[1, V//2)``, values distinct from ``[V//2, V)``), then a query region in
    which every key appears once, followed by its value, at an even offset
    ``2g`` from the region's start. The N gaps ``g`` are drawn without
    replacement from ``[0, (T + 1 - 2N) // 2)`` with ``P(g) ∝ (g + 1)**(power_a - 1)``
    (Zoology's power law: ``power_a = 0.01`` favours queries soon after the
    context, ``power_a = 1`` is uniform). Other tokens are uniform noise from
    ``[0, V)`` minus this example's keys (``random_non_queries``; Zoology's
    noise may repeat a key, which reads as a fake re-binding) or 0. Scored: the value after each
    query key (kind "query"); a brute-force answer is the value bound to that
    key in the context.
    """

    vocab_size: int = 8192
    seq_len: int = 256
    num_kv_pairs: int = 16
    power_a: float = 0.01
    random_non_queries: bool = True
    seed: int = 0
    num_examples: int = 1 << 24

    KINDS: ClassVar[tuple[str, ...]] = ("query",)
    SCORED: ClassVar[tuple[str, ...]] = ("query",)
    name: ClassVar[str] = "mqar"

    def __post_init__(self):
        self._validate_common()
        _int("num_kv_pairs", self.num_kv_pairs, 1)
        _int("vocab_size", self.vocab_size, 4)
        if self.vocab_size // 2 - 1 < self.num_kv_pairs:
            raise ValueError(f"vocab_size: {self.vocab_size} gives {self.vocab_size // 2 - 1} keys < num_kv_pairs={self.num_kv_pairs}")
        if self.seq_len < 4 * self.num_kv_pairs:
            raise ValueError(f"seq_len: must be >= 4 * num_kv_pairs = {4 * self.num_kv_pairs}, got {self.seq_len}")
        if not isinstance(self.power_a, (int, float)) or not 0 < self.power_a <= 1:
            raise ValueError(f"power_a: must be in (0, 1], got {self.power_a!r}")

    def _generate(self, rng):
        V, T, N = self.vocab_size, self.seq_len, self.num_kv_pairs
        keys = rng.choice(np.arange(1, V // 2), N, replace=False)
        values = rng.choice(np.arange(V // 2, V), N, replace=False)
        if self.random_non_queries:
            x = rng.integers(0, V, T + 1)
            while (clash := np.isin(x, keys)).any():  # noise never repeats a key (fake bindings)
                x[clash] = rng.integers(0, V, int(clash.sum()))
        else:
            x = np.zeros(T + 1, np.int64)
        x[0 : 2 * N : 2] = keys
        x[1 : 2 * N : 2] = values
        space = (T + 1 - 2 * N) // 2
        p = np.arange(1, space + 1, dtype=np.float64) ** (self.power_a - 1)
        gaps = rng.choice(space, N, replace=False, p=p / p.sum())
        qpos = 2 * N + 2 * gaps
        x[qpos] = keys
        x[qpos + 1] = values
        kinds_x = np.zeros(T + 1, np.int32)
        kinds_x[qpos + 1] = 1
        return x, kinds_x, {"keys": keys, "values": values, "query_positions": np.sort(qpos)}


# --------------------------------------------------------------------------- NIAH


_NOISE = (" The grass is green.", " The sky is blue.", " The sun is yellow.", " Here we go.", " There and back again.")
_HEADER = "There is an important piece of information hidden inside a lot of irrelevant text. Find it and memorize it."


@functools.lru_cache(maxsize=None)
def _niah_pieces(tokenizer: str) -> dict:
    enc = get_tokenizer(tokenizer).encode
    return {
        "header": enc(_HEADER),
        "noise": [enc(s) for s in _NOISE],
        "needle_pre": enc(" The pass key is"),
        "needle_post": enc(". Remember it."),
        "question": enc("\nWhat is the pass key? The pass key is"),
    }


@dataclasses.dataclass(frozen=True)
class PasskeyNIAH(_Task):
    """S-NIAH-1 passkey retrieval (RULER; Mohtashami & Jaggi's passkey).

    ``x`` = header + noise haystack (RULER's repeated "The grass is green. The
    sky is blue. ..." sentences) with the needle "The pass key is NNNNN.
    Remember it." inserted at the sentence boundary nearest below
    ``depth * len(haystack)`` + "What is the pass key? The pass key is" +
    " NNNNN". ``depth`` None draws it uniformly per example. Pieces are
    tokenized separately with ``tokenizer`` ("byte" or "gpt2"), so the answer
    tokens equal the needle's key tokens. Scored (kind "passkey"): the answer
    tokens that contain digits (for bytes: the digits, not the leading space).
    """

    seq_len: int = 1024
    tokenizer: str = "byte"
    depth: Optional[float] = None
    num_digits: int = 5
    seed: int = 0
    num_examples: int = 1 << 24

    KINDS: ClassVar[tuple[str, ...]] = ("passkey",)
    SCORED: ClassVar[tuple[str, ...]] = ("passkey",)
    name: ClassVar[str] = "niah"

    def __post_init__(self):
        self._validate_common()
        if not isinstance(self.tokenizer, str):
            raise ValueError(f"tokenizer: must be a tokenizer name, got {self.tokenizer!r}")
        get_tokenizer(self.tokenizer)  # raises ValueError naming the valid ones
        _int("num_digits", self.num_digits, 1)
        if self.num_digits > 18:
            raise ValueError(f"num_digits: must be <= 18, got {self.num_digits}")
        if self.depth is not None and not (isinstance(self.depth, (int, float)) and 0.0 <= self.depth <= 1.0):
            raise ValueError(f"depth: must be None or in [0, 1], got {self.depth!r}")
        need = self._fixed_len() + 2 * (self.num_digits + 1) + 1
        if self.seq_len + 1 < need:
            raise ValueError(f"seq_len: {self.seq_len} is too short for the passkey task with {self.tokenizer!r} tokens (need >= {need - 1})")

    @property
    def vocab_size(self) -> int:
        return get_tokenizer(self.tokenizer).vocab_size

    def _pieces(self) -> dict:
        return _niah_pieces(self.tokenizer)

    def _fixed_len(self) -> int:
        p = self._pieces()
        return len(p["header"]) + len(p["needle_pre"]) + len(p["needle_post"]) + len(p["question"])

    def _generate(self, rng):
        tok = get_tokenizer(self.tokenizer)
        p = self._pieces()
        passkey = str(int(rng.integers(10 ** (self.num_digits - 1), 10**self.num_digits)))
        key_tokens = tok.encode(" " + passkey)
        needle = p["needle_pre"] + key_tokens + p["needle_post"]
        hay_len = self.seq_len + 1 - len(p["header"]) - len(needle) - len(p["question"]) - len(key_tokens)
        noise, bounds = [], [0]
        i = 0
        while len(noise) < hay_len:
            noise += p["noise"][i % len(p["noise"])]
            bounds.append(len(noise))
            i += 1
        noise = noise[:hay_len]
        depth = float(rng.uniform()) if self.depth is None else float(self.depth)
        cut = max(b for b in bounds if b <= depth * hay_len)
        x = p["header"] + noise[:cut] + needle + noise[cut:] + p["question"] + key_tokens
        kinds_x = np.zeros(len(x), np.int32)
        start = len(x) - len(key_tokens)
        for j, t in enumerate(key_tokens):
            if any(c.isdigit() for c in tok.decode([t])):
                kinds_x[start + j] = 1
        info = {"passkey": passkey, "depth": depth, "needle_position": len(p["header"]) + cut}
        return np.array(x, np.int64), kinds_x, info


# --------------------------------------------------------------------------- eviction probes


def _probe_vocab_check(vocab_size, keys_needed: int, what: str) -> None:
    _int("vocab_size", vocab_size, 4)
    keys, values = _key_value_ranges(vocab_size)
    if len(keys) < keys_needed:
        raise ValueError(f"vocab_size: {vocab_size} gives {len(keys)} keys, fewer than the {keys_needed} {what}")
    if len(values) < 2:  # a re-bound key takes a value other than its current one
        raise ValueError(f"vocab_size: {vocab_size} gives {len(values)} value token(s); the probes need at least 2")


@dataclasses.dataclass(frozen=True)
class OverwriteProbe(_Task):
    """Keys re-bound mid-sequence; every query wants the key's *latest* value.

    ``x``: bind ``num_facts`` distinct keys; then pairs that, with probability
    ``rebind_prob``, re-bind a random key to a new value (unscored: unpredictable)
    and otherwise query a random key; then query every key once. A trailing
    BLANK pads an odd length. Kinds: "original" (key never re-bound so far),
    "overwritten" (re-bound at least once: an additive memory returns a blend
    of old and new values). Needs ``seq_len >= 6 * num_facts``.
    """

    vocab_size: int = 8192
    seq_len: int = 256
    num_facts: int = 16
    rebind_prob: float = 0.5
    seed: int = 0
    num_examples: int = 1 << 24

    KINDS: ClassVar[tuple[str, ...]] = ("original", "overwritten")
    SCORED: ClassVar[tuple[str, ...]] = ("original", "overwritten")
    name: ClassVar[str] = "overwrite"

    def __post_init__(self):
        self._validate_common()
        _int("num_facts", self.num_facts, 1)
        _probe_vocab_check(self.vocab_size, self.num_facts, "facts")
        if self.seq_len < 6 * self.num_facts:
            raise ValueError(f"seq_len: must be >= 6 * num_facts = {6 * self.num_facts}, got {self.seq_len}")
        if not isinstance(self.rebind_prob, (int, float)) or not 0 < self.rebind_prob < 1:
            raise ValueError(f"rebind_prob: must be in (0, 1), got {self.rebind_prob!r}")

    def _generate(self, rng):
        keys_range, values_range = _key_value_ranges(self.vocab_size)
        N = self.num_facts
        keys = rng.choice(keys_range, N, replace=False)
        current = {int(k): int(values_range[rng.integers(len(values_range))]) for k in keys}
        rebound = {int(k): False for k in keys}
        seq = _Pairs()
        for k in keys:
            seq.pair(k, current[int(k)])
        middle = (self.seq_len + 1) // 2 - 2 * N
        num_rebinds = 0
        for _ in range(middle):
            k = int(keys[rng.integers(N)])
            if rng.uniform() < self.rebind_prob:
                current[k] = _new_value(rng, values_range, current[k])
                rebound[k] = True
                num_rebinds += 1
                seq.pair(k, current[k])
            else:
                seq.pair(k, current[k], 2 if rebound[k] else 1)
        for k in rng.permutation(keys):
            k = int(k)
            seq.pair(k, current[k], 2 if rebound[k] else 1)
        x, kinds_x = seq.finish(self.seq_len + 1)
        return x, kinds_x, {"num_rebinds": num_rebinds}


@dataclasses.dataclass(frozen=True)
class FadeProbe(_Task):
    """A document switch that should free the whole memory.

    ``x``: document A binds ``num_facts_a`` facts and queries each once (kind "a",
    scored: A must really be stored); SWITCH; document B binds ``num_facts``
    *fresh* keys (disjoint from A's) and queries them: each once, then random
    B keys until the sequence is full (kind "b", scored); finally
    ``num_stale_queries`` queries of A's keys (kind "stale", NOT scored: the
    correct policy forgets A, so their accuracy measures retention, i.e. how
    much of A survived the switch). A trailing BLANK pads an odd length.
    Needs ``seq_len + 1 >= 4 * (num_facts_a + num_facts) + 2 * num_stale_queries + 1``.
    """

    vocab_size: int = 8192
    seq_len: int = 256
    num_facts: int = 16
    num_facts_a: Optional[int] = None  # default: num_facts
    num_stale_queries: int = 0
    seed: int = 0
    num_examples: int = 1 << 24

    KINDS: ClassVar[tuple[str, ...]] = ("a", "b", "stale")
    SCORED: ClassVar[tuple[str, ...]] = ("a", "b")
    name: ClassVar[str] = "fade"

    @property
    def facts_a(self) -> int:
        return self.num_facts if self.num_facts_a is None else self.num_facts_a

    def __post_init__(self):
        self._validate_common()
        _int("num_facts", self.num_facts, 1)
        if self.num_facts_a is not None:
            _int("num_facts_a", self.num_facts_a, 1)
        _int("num_stale_queries", self.num_stale_queries, 0)
        if self.num_stale_queries > self.facts_a:
            raise ValueError(f"num_stale_queries: must be <= num_facts_a = {self.facts_a}, got {self.num_stale_queries}")
        _probe_vocab_check(self.vocab_size, self.facts_a + self.num_facts, "facts of both documents")
        need = 4 * (self.facts_a + self.num_facts) + 2 * self.num_stale_queries + 1
        if self.seq_len + 1 < need:
            raise ValueError(f"seq_len: must be >= {need - 1} for these fact counts, got {self.seq_len}")

    def _generate(self, rng):
        keys_range, values_range = _key_value_ranges(self.vocab_size)
        NA, NB, S = self.facts_a, self.num_facts, self.num_stale_queries
        all_keys = rng.choice(keys_range, NA + NB, replace=False)
        keys_a, keys_b = all_keys[:NA], all_keys[NA:]
        value = {int(k): int(values_range[rng.integers(len(values_range))]) for k in all_keys}
        seq = _Pairs()
        for k in keys_a:
            seq.pair(k, value[int(k)])
        for k in rng.permutation(keys_a):
            seq.pair(k, value[int(k)], 1)
        switch_position = len(seq.x)
        seq.token(SWITCH)
        for k in keys_b:
            seq.pair(k, value[int(k)])
        extra = (self.seq_len + 1 - len(seq.x) - 2 * S) // 2 - NB
        b_queries = np.concatenate([rng.permutation(keys_b), rng.choice(keys_b, extra)])
        for k in b_queries:
            seq.pair(k, value[int(k)], 2)
        for k in rng.choice(keys_a, S, replace=False):
            seq.pair(k, value[int(k)], 3)
        x, kinds_x = seq.finish(self.seq_len + 1)
        return x, kinds_x, {"switch_position": switch_position, "keys_a": keys_a, "keys_b": keys_b}


@dataclasses.dataclass(frozen=True)
class MixedHalfLivesProbe(_Task):
    """Long-lived facts and short-lived junk in one memory.

    ``x``: bind ``num_facts`` long-lived facts (keys from the lower half of the
    key range); then a junk stream filling the sequence: junk bindings (keys
    from the upper half; a key is never re-used while its query is pending, and
    a re-used key gets a new value) each queried exactly once, 1..``max_lag``
    pairs later (kind "junk"), and never again; finally every long-lived fact
    is queried once (kind "long"). A slot with nothing due and no room left for
    a new binding's query is a BLANK pair. Needs ``seq_len >= 4 * num_facts + 4``.
    """

    vocab_size: int = 8192
    seq_len: int = 512
    num_facts: int = 8
    max_lag: int = 4
    seed: int = 0
    num_examples: int = 1 << 24

    KINDS: ClassVar[tuple[str, ...]] = ("long", "junk")
    SCORED: ClassVar[tuple[str, ...]] = ("long", "junk")
    name: ClassVar[str] = "mixed_half_lives"

    def __post_init__(self):
        self._validate_common()
        _int("num_facts", self.num_facts, 1)
        _int("max_lag", self.max_lag, 1)
        _int("vocab_size", self.vocab_size, 4)
        keys, _ = _key_value_ranges(self.vocab_size)
        if len(keys) // 2 < self.num_facts:
            raise ValueError(f"vocab_size: {self.vocab_size} gives {len(keys) // 2} long-lived keys < num_facts={self.num_facts}")
        if len(keys) - len(keys) // 2 < self.max_lag + 1:
            raise ValueError(f"vocab_size: {self.vocab_size} gives {len(keys) - len(keys) // 2} junk keys; need > max_lag={self.max_lag}")
        if self.seq_len < 4 * self.num_facts + 4:
            raise ValueError(f"seq_len: must be >= 4 * num_facts + 4 = {4 * self.num_facts + 4}, got {self.seq_len}")

    def _generate(self, rng):
        keys_range, values_range = _key_value_ranges(self.vocab_size)
        half = len(keys_range) // 2
        long_range, junk_range = keys_range[:half], keys_range[half:]
        N = self.num_facts
        long_keys = rng.choice(long_range, N, replace=False)
        long_val = {int(k): int(values_range[rng.integers(len(values_range))]) for k in long_keys}
        seq = _Pairs()
        for k in long_keys:
            seq.pair(k, long_val[int(k)])
        slots = (self.seq_len + 1) // 2 - 2 * N
        due: dict[int, tuple[int, int]] = {}  # slot -> (junk key, value) queried there
        last_value: dict[int, int] = {}
        lags = []
        for s in range(slots):
            if s in due:
                k, v = due.pop(s)
                seq.pair(k, v, 2)
                continue
            free = [t for t in range(s + 1, min(s + self.max_lag, slots - 1) + 1) if t not in due]
            if not free:
                seq.pair(BLANK, BLANK)
                continue
            t = free[rng.integers(len(free))]
            pending = {k for k, _ in due.values()}
            while True:
                k = int(junk_range[rng.integers(len(junk_range))])
                if k not in pending:
                    break
            v = _new_value(rng, values_range, last_value.get(k))
            last_value[k] = v
            due[t] = (k, v)
            lags.append(t - s)
            seq.pair(k, v)
        for k in rng.permutation(long_keys):
            seq.pair(k, long_val[int(k)], 1)
        x, kinds_x = seq.finish(self.seq_len + 1)
        return x, kinds_x, {"num_junk": len(lags), "junk_lags": np.array(lags, np.int32)}


# --------------------------------------------------------------------------- registry

TASKS = {
    "mqar": MQAR,
    "niah": PasskeyNIAH,
    "overwrite": OverwriteProbe,
    "fade": FadeProbe,
    "mixed_half_lives": MixedHalfLivesProbe,
}


def get_task(name: str, **kwargs):
    """Build the task ``name`` with ``kwargs`` (its dataclass fields; see each class)."""
    if name not in TASKS:
        raise ValueError(f"name: unknown task {name!r}; valid tasks: {sorted(TASKS)}")
    cls = TASKS[name]
    valid = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(kwargs) - set(valid))
    if unknown:
        raise ValueError(f"{unknown[0]}: not an argument of task {name!r}; valid arguments: {valid}")
    return cls(**kwargs)
