"""Packed-document helpers: one definition of a document boundary."""

import numpy as np

from lineage_jax.memory.segments import document_index, segment_starts


def test_segment_starts_and_document_index():
    seg = np.array([[7, 7, 3, 3, 7], [0, 1, 2, 2, 2]])
    np.testing.assert_array_equal(segment_starts(seg), [[0, 0, 1, 0, 1], [0, 1, 1, 0, 0]])
    np.testing.assert_array_equal(document_index(seg), [[0, 0, 1, 1, 2], [0, 1, 2, 2, 2]])
    assert document_index(seg).dtype == np.int32


def test_random_ids_match_a_python_loop():
    rng = np.random.default_rng(0)
    seg = rng.integers(0, 3, size=(4, 33))
    want = np.zeros_like(seg)
    for b in range(seg.shape[0]):
        for t in range(1, seg.shape[1]):
            want[b, t] = want[b, t - 1] + (seg[b, t] != seg[b, t - 1])
    np.testing.assert_array_equal(document_index(seg), want)


def test_one_token_rows():
    """T = 1 (a one-token prefill with segment ids): one start-less document per row."""
    seg = np.array([[4], [0]], np.int32)
    assert segment_starts(seg).shape == (2, 1) and not np.any(np.asarray(segment_starts(seg)))
    np.testing.assert_array_equal(np.asarray(document_index(seg)), [[0], [0]])
