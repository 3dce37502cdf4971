"""experiments.common: the provenance every record starts with."""

from experiments import common as C


def test_a_named_commit_is_recorded_and_its_status_left_unknown(monkeypatch):
    """``COMMIT`` names the code of a copy whose git metadata names an older commit: the record takes it, and
    ``git_dirty`` (git's status against the older commit) becomes None; naming git's own commit changes
    nothing."""
    head = C.git_commit()
    monkeypatch.setenv("COMMIT", "abc1234")
    assert C.provenance("x", False)["git_commit"] == "abc1234" and C.recorded_dirty() is None
    if head:
        monkeypatch.setenv("COMMIT", head[:7])
        assert C.recorded_commit() == head[:7] and C.recorded_dirty() == C.git_dirty()
    monkeypatch.delenv("COMMIT")
    assert C.recorded_commit() == head
