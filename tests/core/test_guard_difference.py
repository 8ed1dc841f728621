"""The first difference between ranks' exchanged records (core/guard/difference.py): named the
same on every rank, consistent when the ranks behind are only stalled, and never an
entry a rank dropped because a comparison had already shown it agreed everywhere."""

from fullshard.core.guard.difference import CHECK, ELSEWHERE, STALLED, Record, first_difference
from fullshard.core.guard.ledger import FORWARD_WITH_GRAD, REDUCE_SCATTER, Entry


def _entries(first: int, last: int, unit: int = 0) -> dict:
    return {c: (1000 + c, tuple(Entry(1, FORWARD_WITH_GRAD, REDUCE_SCATTER, unit, c)))
            for c in range(first, last + 1)}


def test_a_peer_at_another_models_check_behind_a_stalled_rank_is_named():
    entry = Entry(1, FORWARD_WITH_GRAD, 0, 0, 0)
    entries = {7: (123, tuple(entry))}
    stalled = Record(STALLED, -1, 7, 6, entries, {}, 0)  # waits in the model's entry #7
    at_other = Record(ELSEWHERE, -1, 6, 6, {}, {}, 0)    # never issued it
    problem = first_difference([stalled, at_other], lambda e: "the all-gather of 'GPT'")
    assert problem is not None and problem.count == 7, problem
    assert problem.what[1] == "went on to another sharded model's check after entry #6"
    assert first_difference([stalled, at_other._replace(count=7, entries=entries)],
                            lambda e: "") is None  # it did issue it: consistent


def test_entries_one_rank_already_saw_agreed_are_not_a_difference():
    """A slow rank: rank 0 stalled in a gather after entry #5 and kept entries #1-#6;
    rank 1, late, has since gone through a reduction whose digests showed both ranks
    equal up to #9, dropped what it held up to there and is at its check after #12.
    Rank 0 is merely behind: consistent (it used to be named "kept no record of entry
    #6")."""
    stalled = Record(STALLED, -1, 6, 0, _entries(1, 6), {}, 0)
    late = Record(CHECK, 2, 12, 9, _entries(10, 12), {}, 0)
    assert first_difference([stalled, late], lambda e: "") is None
    assert first_difference([late, stalled], lambda e: "") is None


def test_a_rank_at_its_check_with_fewer_entries_is_named():
    ahead = Record(CHECK, 2, 8, 4, _entries(5, 8), {}, 0)
    behind = Record(CHECK, 2, 7, 4, _entries(5, 7), {}, 0)
    problem = first_difference([ahead, behind], lambda e: "the reduce-scatter of 'x'")
    assert problem is not None and problem.count == 8
    assert problem.what == ["ran the reduce-scatter of 'x' (forward of step 1)",
                            "ended the backward after entry #7"]
