"""One rank's record of what it did for a root's units (core/guard/ledger.py): the same entries
give the same (count, digest) on every rank, any difference changes the digest, the
entries since the ranks last agreed are kept (at most HISTORY of them) to name it."""

from fullshard.core.guard import ledger as ledger_module
from fullshard.core.guard.ledger import (ALL_GATHER, BACKWARD, FORWARD, FORWARD_WITH_GRAD,
                                   REDUCE_SCATTER, Ledger, unit_code)

UNITS = ["GPT", "layers.0", "layers.1"]  # the root is named by its class


def _step(record: Ledger, numel_of_layer_1: int = 96, skip: str | None = None) -> None:
    record.step += 1
    for name in UNITS:
        if name == skip:
            continue
        record.record(FORWARD_WITH_GRAD, FORWARD, unit_code(name))
        record.record(FORWARD_WITH_GRAD, ALL_GATHER, unit_code(name),
                      numel_of_layer_1 if name == "layers.1" else 64)
    for name in reversed(UNITS):
        if name != skip:
            record.record(BACKWARD, REDUCE_SCATTER, unit_code(name), 64)


def test_the_same_entries_give_the_same_count_and_digest():
    a, b = Ledger(UNITS), Ledger(list(reversed(UNITS)))  # the order units are listed in
    for _ in range(3):
        _step(a)
        _step(b)
    assert (a.count, a.digest) == (b.count, b.digest) == (27, a.digest)
    assert a.digest != 0


def test_any_difference_changes_the_digest():
    base = Ledger(UNITS)
    _step(base)
    for change in ({"numel_of_layer_1": 97}, {"skip": "layers.0"}):
        other = Ledger(UNITS)
        _step(other, **change)
        assert other.digest != base.digest, change
    late = Ledger(UNITS)
    late.step += 1  # the same entries one step later: the step is part of each entry
    _step(late)
    assert late.digest != base.digest


def test_entries_since_the_last_agreement_are_kept_to_name_a_difference(monkeypatch):
    record = Ledger(UNITS)
    _step(record)
    assert sorted(record.entries) == list(range(1, 10))
    record.mark_agreed(4)
    assert sorted(record.entries) == list(range(5, 10)) and record.agreed == 4
    record.mark_agreed(2)  # an older agreement changes nothing
    assert record.agreed == 4
    record.mark_agreed()
    assert record.entries == {} and record.agreed == record.count == 9
    monkeypatch.setattr(ledger_module, "HISTORY", 5)
    _step(record)
    assert sorted(record.entries) == list(range(14, 19))  # the last HISTORY only
    digest, entry = record.entries[18]
    assert digest == record.digest and entry == (1, BACKWARD, REDUCE_SCATTER, unit_code("GPT"), 64)


def test_an_entry_is_told_in_words_with_any_rank_s_unit_names():
    record = Ledger(UNITS)
    record.step = 0
    assert record.describe((0, FORWARD_WITH_GRAD, FORWARD, unit_code("layers.1"), 0)) == \
        "the forward of 'layers.1'"
    assert record.describe((0, BACKWARD, REDUCE_SCATTER, unit_code("GPT"), 64)) == \
        "the reduce-scatter of 'GPT'"
    elsewhere = unit_code("experts.3")  # a unit only another rank has
    assert record.describe((0, FORWARD_WITH_GRAD, ALL_GATHER, elsewhere, 8),
                           {elsewhere: "experts.3"}) == "the all-gather of 'experts.3'"
    assert record.describe((0, FORWARD_WITH_GRAD, ALL_GATHER, 7, 8)) == \
        "the all-gather of 'unit 0x7'"
