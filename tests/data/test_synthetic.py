import re

import numpy as np
import pytest

from lineage_jax.data import synthetic as syn
from lineage_jax.data.synthetic import BLANK, SWITCH, TASKS, get_task
from lineage_jax.data.tokenizers import get_tokenizer

# Small instances keep the suite fast; each still exercises every phase.
SMALL = {
    "mqar": dict(vocab_size=128, seq_len=64, num_kv_pairs=8),
    "niah": dict(seq_len=320),
    "overwrite": dict(vocab_size=128, seq_len=96, num_facts=8),
    "fade": dict(vocab_size=128, seq_len=96, num_facts=6, num_facts_a=8, num_stale_queries=3),
    "mixed_half_lives": dict(vocab_size=128, seq_len=128, num_facts=4, max_lag=3),
}
N_EXAMPLES = 25


def key_range(vocab_size):
    keys, values = syn._key_value_ranges(vocab_size)
    return keys[0], keys[-1] + 1, values[0]


def latest_binding_solver(tokens, targets, vocab_size):
    """Brute force for the pair format: walk the sequence, remember each key's latest value.

    Returns (predicted int [T], -1 where the key was never bound before t; is_key bool [T]).
    """
    lo, hi, _ = key_range(vocab_size)
    latest, pred = {}, np.full(len(tokens), -1)
    is_key = (tokens >= lo) & (tokens < hi)
    for t in np.flatnonzero(is_key):
        k = int(tokens[t])
        pred[t] = latest.get(k, -1)
        latest[k] = int(targets[t])  # a key is always followed by its value
    return pred, is_key


# --------------------------------------------------------------------------- all tasks


@pytest.mark.parametrize("name", sorted(TASKS))
def test_shapes_dtypes_and_shift(name):
    task = get_task(name, **SMALL[name])
    T = task.seq_len
    for i in range(5):
        ex = task[i]
        assert set(ex) == {"tokens", "targets", "segment_ids", "mask"}
        for k in ("tokens", "targets", "segment_ids"):
            assert ex[k].shape == (T,) and ex[k].dtype == np.int32
        assert ex["mask"].shape == (T,) and ex["mask"].dtype == np.float32
        np.testing.assert_array_equal(ex["targets"][:-1], ex["tokens"][1:])
        assert (ex["segment_ids"] == 1).all()
        assert ex["tokens"].min() >= 0 and ex["tokens"].max() < task.vocab_size
        assert ex["mask"].sum() > 0 and set(np.unique(ex["mask"])) <= {0.0, 1.0}
        kinds = task.info(i)["kinds"]
        scored = np.isin(kinds, [task.KINDS.index(k) + 1 for k in task.SCORED])
        np.testing.assert_array_equal(ex["mask"] == 1, scored)


@pytest.mark.parametrize("name", sorted(TASKS))
def test_deterministic_per_seed_and_index(name):
    a, b = get_task(name, **SMALL[name]), get_task(name, **SMALL[name])
    other_seed = get_task(name, **SMALL[name], seed=1)
    for i in (0, 3):
        for k in ("tokens", "mask"):
            np.testing.assert_array_equal(a[i][k], b[i][k])
    # Random access: examples read in another order (and read again) are the same examples.
    first = {i: b[i] for i in (0, 1, 3)}
    for i in (3, 1, 0, 3):
        for k in ("tokens", "mask"):
            np.testing.assert_array_equal(a[i][k], first[i][k])
    assert not np.array_equal(a[0]["tokens"], a[1]["tokens"])
    assert not np.array_equal(a[0]["tokens"], other_seed[0]["tokens"])
    with pytest.raises(IndexError):
        a[len(a)]


# --------------------------------------------------------------------------- MQAR


def test_mqar_answers_are_the_context_bindings():
    task = get_task("mqar", **SMALL["mqar"])
    V, N = task.vocab_size, task.num_kv_pairs
    for i in range(N_EXAMPLES):
        ex = task[i]
        tok, tgt, mask = ex["tokens"], ex["targets"], ex["mask"]
        context = {int(tok[s]): int(tok[s + 1]) for s in range(0, 2 * N, 2)}
        assert len(context) == N
        assert all(1 <= k < V // 2 for k in context) and all(V // 2 <= v < V for v in context.values())
        q = np.flatnonzero(mask)
        assert len(q) == N and (q >= 2 * N).all()
        assert sorted(tok[q].tolist()) == sorted(context)  # every key is queried exactly once
        for t in q:
            assert tgt[t] == context[int(tok[t])]
        # Noise never repeats a key, so keys occur only in the context and at queries.
        key_positions = np.flatnonzero(np.isin(tok, list(context)))
        assert sorted(key_positions.tolist()) == sorted(list(range(0, 2 * N, 2)) + q.tolist())


def test_mqar_power_law_gaps_favour_early_queries():
    def mean_gap(power_a):
        task = get_task("mqar", vocab_size=512, seq_len=256, num_kv_pairs=8, power_a=power_a)
        return np.mean([np.flatnonzero(task[i]["mask"]).mean() for i in range(60)])

    assert mean_gap(0.01) < 0.8 * mean_gap(1.0)


def test_mqar_without_noise():
    task = get_task("mqar", vocab_size=64, seq_len=32, num_kv_pairs=4, random_non_queries=False)
    ex = task[0]
    q = np.flatnonzero(ex["mask"])
    filler = np.ones(32, bool)
    filler[:8] = False
    filler[q] = False
    filler[np.minimum(q + 1, 31)] = False
    assert (ex["tokens"][filler] == 0).all()


# --------------------------------------------------------------------------- NIAH


def find(seq, pattern):
    seq, pattern = list(seq), list(pattern)
    return [i for i in range(len(seq) - len(pattern) + 1) if seq[i : i + len(pattern)] == pattern]


@pytest.mark.parametrize("tokenizer, seq_len", [("byte", 320), ("gpt2", 128)])
def test_niah_answer_is_the_needle(tokenizer, seq_len):
    tok = get_tokenizer(tokenizer)
    task = get_task("niah", seq_len=seq_len, tokenizer=tokenizer)
    assert task.vocab_size == tok.vocab_size
    needle = tok.encode(" The pass key is")
    for i in range(5 if tokenizer == "byte" else 3):
        ex = task[i]
        tokens, mask = ex["tokens"].tolist(), ex["mask"]
        hits = find(tokens, needle)
        assert len(hits) == 2  # the needle and the question
        after = tok.decode(tokens[hits[0] + len(needle) : hits[0] + len(needle) + 24])
        passkey = re.match(r" (\d+)\. Remember it\.", after).group(1)
        answer = tok.decode(ex["targets"][mask == 1].tolist())
        assert answer.strip() == passkey == task.info(i)["passkey"] and len(passkey) == 5
        assert re.fullmatch(r" ?\d+", answer)
        assert np.flatnonzero(mask).max() == seq_len - 1  # the answer ends the sequence
        assert "What is the pass key?" in tok.decode(tokens[hits[0] :])


def test_niah_depth_moves_the_needle():
    positions = [get_task("niah", seq_len=400, depth=d).info(0)["needle_position"] for d in (0.0, 0.5, 1.0)]
    header = len(syn._niah_pieces("byte")["header"])
    assert positions[0] == header and positions[0] < positions[1] < positions[2]
    assert positions[2] > 300
    depths = [get_task("niah", seq_len=400).info(i)["depth"] for i in range(20)]
    assert 0.0 <= min(depths) and max(depths) <= 1.0 and np.std(depths) > 0.1


# --------------------------------------------------------------------------- probes


def check_pair_solver(task, allowed_unscored_predictable=()):
    """mask[t] == 1 iff tokens[t] is a bound key whose latest value is the target."""
    for i in range(N_EXAMPLES):
        ex, kinds = task[i], task.info(i)["kinds"]
        pred, is_key = latest_binding_solver(ex["tokens"], ex["targets"], task.vocab_size)
        predictable = is_key & (pred == ex["targets"])
        exempt = np.isin(kinds, [task.KINDS.index(k) + 1 for k in allowed_unscored_predictable])
        np.testing.assert_array_equal(ex["mask"] == 1, predictable & ~exempt)
        assert (pred[ex["mask"] == 1] >= 0).all()
        # Only keys, values, BLANK and SWITCH occur; every key is followed by a value.
        lo, hi, vlo = key_range(task.vocab_size)
        keys_at = np.flatnonzero(is_key)
        assert (ex["targets"][keys_at] >= vlo).all()


def test_overwrite_queries_want_the_latest_value():
    task = get_task("overwrite", **SMALL["overwrite"])
    check_pair_solver(task)
    n_overwritten = 0
    for i in range(N_EXAMPLES):
        ex, kinds = task[i], task.info(i)["kinds"]
        tok, tgt = ex["tokens"], ex["targets"]
        for t in np.flatnonzero(ex["mask"]):
            earlier = {int(tgt[s]) for s in range(t) if tok[s] == tok[t]}
            # "original": one value so far; "overwritten": re-bound, the old value differs.
            assert (len(earlier) == 1) == (kinds[t] == 1)
            n_overwritten += kinds[t] == 2
    assert n_overwritten > N_EXAMPLES  # the probe really tests overwriting


def test_fade_documents():
    task = get_task("fade", **SMALL["fade"])
    check_pair_solver(task, allowed_unscored_predictable=("stale",))
    lo, hi, _ = key_range(task.vocab_size)
    for i in range(N_EXAMPLES):
        ex, info = task[i], task.info(i)
        tok, kinds = ex["tokens"], info["kinds"]
        sw = np.flatnonzero(tok == SWITCH)
        assert sw.tolist() == [info["switch_position"]]
        keys_a, keys_b = set(info["keys_a"].tolist()), set(info["keys_b"].tolist())
        assert len(keys_a) == 8 and len(keys_b) == 6 and not keys_a & keys_b
        before = tok[: sw[0]]
        assert set(before[(before >= lo) & (before < hi)].tolist()) == keys_a
        a_q = np.flatnonzero(kinds == 1)
        b_q = np.flatnonzero(kinds == 2)
        stale = np.flatnonzero(kinds == 3)
        assert len(a_q) == 8 and (a_q < sw[0]).all() and set(tok[a_q].tolist()) == keys_a
        assert len(b_q) >= 6 and (b_q > sw[0]).all() and set(tok[b_q].tolist()) == keys_b
        # Stale queries come last, ask about A, and are not scored.
        assert len(stale) == 3 and stale.min() > b_q.max() and set(tok[stale].tolist()) <= keys_a
        assert (ex["mask"][stale] == 0).all()
        # Between the switch and the stale queries no A key appears: only B facts load the memory.
        middle = tok[sw[0] : stale.min()]
        assert not set(middle.tolist()) & keys_a


def test_mixed_half_lives_structure():
    task = get_task("mixed_half_lives", **SMALL["mixed_half_lives"])
    check_pair_solver(task)
    keys, _ = syn._key_value_ranges(task.vocab_size)
    long_range = set(keys[: len(keys) // 2].tolist())
    for i in range(N_EXAMPLES):
        ex, info = task[i], task.info(i)
        tok, tgt, kinds = ex["tokens"], ex["targets"], info["kinds"]
        long_q, junk_q = np.flatnonzero(kinds == 1), np.flatnonzero(kinds == 2)
        assert len(long_q) == 4 and set(tok[long_q].tolist()) <= long_range
        assert not set(tok[junk_q].tolist()) & long_range
        # Long facts: bound in the first pairs, queried after all junk.
        assert (long_q > junk_q.max()).all()
        assert set(tok[long_q].tolist()) == set(tok[0:8:2].tolist())
        # Every junk binding is queried exactly once, 1..max_lag pairs later, then never again.
        junk_bind = [t for t in range(8, len(tok) - 8, 2) if tok[t] not in (BLANK,) and kinds[t] == 0]
        assert len(junk_bind) == len(junk_q) == info["num_junk"] > 20
        for t in junk_bind:
            later = [s for s in junk_q if s > t and tok[s] == tok[t]]
            assert later and 2 <= later[0] - t <= 2 * task.max_lag
            assert tgt[later[0]] == tgt[t]
            rebound = [s for s in junk_bind if s > t and tok[s] == tok[t]]
            assert not rebound or later[0] < rebound[0]


# --------------------------------------------------------------------------- errors


def test_registry_errors():
    with pytest.raises(ValueError, match=r"name.*'fade'.*'mixed_half_lives'.*'mqar'.*'niah'.*'overwrite'"):
        get_task("copy")
    with pytest.raises(ValueError, match=r"num_pairs.*valid arguments.*num_kv_pairs"):
        get_task("mqar", num_pairs=4)
    assert isinstance(get_task("overwrite"), syn.OverwriteProbe)


@pytest.mark.parametrize(
    "name, kwargs, arg",
    [
        ("mqar", dict(seq_len=30, num_kv_pairs=8), "seq_len"),
        ("mqar", dict(vocab_size=10, num_kv_pairs=8), "vocab_size"),
        ("mqar", dict(power_a=0.0), "power_a"),
        ("mqar", dict(num_kv_pairs=0), "num_kv_pairs"),
        ("mqar", dict(seed=-1), "seed"),
        ("niah", dict(tokenizer="bpe"), "name"),
        ("niah", dict(seq_len=50), "seq_len"),
        ("niah", dict(depth=1.5), "depth"),
        ("niah", dict(num_digits=0), "num_digits"),
        ("overwrite", dict(seq_len=40, num_facts=8), "seq_len"),
        ("overwrite", dict(rebind_prob=1.0), "rebind_prob"),
        ("overwrite", dict(vocab_size=12, num_facts=8), "vocab_size"),
        ("fade", dict(num_stale_queries=99), "num_stale_queries"),
        ("fade", dict(seq_len=60, num_facts=8), "seq_len"),
        ("fade", dict(num_facts_a=0), "num_facts_a"),
        ("mixed_half_lives", dict(max_lag=0), "max_lag"),
        ("mixed_half_lives", dict(seq_len=20, num_facts=8), "seq_len"),
        ("mixed_half_lives", dict(vocab_size=12, max_lag=4), "vocab_size"),
    ],
)
def test_bad_arguments(name, kwargs, arg):
    with pytest.raises(ValueError, match=arg):
        get_task(name, **kwargs)
