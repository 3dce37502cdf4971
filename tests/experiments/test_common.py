"""experiments.common: the provenance every record starts with."""

import pytest

from experiments import common as C


def test_a_named_commit_is_recorded_and_its_status_left_unknown(monkeypatch):
    """``LINEAGE_COMMIT`` names the code of a copy whose git metadata names an older commit: the record takes
    it, and ``git_dirty`` (git's status against the older commit) becomes None; naming git's own commit
    changes nothing."""
    head = C.git_commit()
    monkeypatch.setenv("LINEAGE_COMMIT", "abc1234")
    assert C.provenance("x", False)["git_commit"] == "abc1234" and C.recorded_dirty() is None
    if head:
        monkeypatch.setenv("LINEAGE_COMMIT", head[:7])
        assert C.recorded_commit() == head[:7] and C.recorded_dirty() == C.git_dirty()
    monkeypatch.setenv("LINEAGE_COMMIT", "")
    assert C.recorded_commit() == head
    monkeypatch.delenv("LINEAGE_COMMIT")
    assert C.recorded_commit() == head


@pytest.mark.parametrize("value", ["abc", "ABC1234", "main", "abc1234 extra", "g" * 40, "a" * 41])
def test_a_named_commit_that_is_not_one_is_refused(monkeypatch, value):
    monkeypatch.setenv("LINEAGE_COMMIT", value)
    with pytest.raises(ValueError, match="LINEAGE_COMMIT must name a commit"):
        C.provenance("x", False)


def test_an_unrelated_commit_variable_is_not_read(monkeypatch):
    """Only ``LINEAGE_COMMIT`` names the commit: a ``COMMIT`` variable of the user's shell is not a record's."""
    monkeypatch.delenv("LINEAGE_COMMIT", raising=False)
    monkeypatch.setenv("COMMIT", "abc1234")
    assert C.recorded_commit() == C.git_commit()
