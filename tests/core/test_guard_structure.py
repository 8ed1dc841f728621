"""Ranks that shard different models are told so, by name, before the first collective
(Note [ranks shard the same model])."""

import pytest
import torch
import torch.distributed as dist

from fullshard import fully_shard
from fullshard.core.guard import structure
from fullshard.core.guard.structure import ParamShape, UnitShape
from fullshard.gpt import GPT, GPTConfig, lm_loss
from fullshard.testing import run_distributed
from fullshard.testing.models import token_batch
from support.catalogue import matches_documented
from support.rank_failures import failure_report, first_error

CFG = dict(vocab_size=40, seq_len=8, d_model=16, n_layers=3, n_heads=2)


def _unit(name, *params, param_dtype="-"):
    return UnitShape(name, (2,), param_dtype, "-", "None", tuple(params))


def _param(fqn, shape, dtype="float32"):
    return ParamShape(fqn, shape, dtype, "Shard(dim=0)", True)


def test_the_first_difference_is_named_in_words():
    a = (_unit("GPT", _param("tok.weight", (40, 16))), _unit("layers.0", _param("w", (4, 4))))
    assert structure.first_difference(a, a) == ("the same units", "the same units")
    wider = (_unit("GPT", _param("tok.weight", (48, 16))), a[1])
    assert structure.first_difference(a, wider) == (
        "parameter 'tok.weight' float32 [40, 16] (Shard(dim=0))",
        "parameter 'tok.weight' float32 [48, 16] (Shard(dim=0))")
    longer = a + (_unit("layers.1", _param("w", (4, 4))),)
    assert structure.first_difference(a, longer) == (
        "2 sharded units", "3 sharded units (unit #2 is 'layers.1')")
    renamed = (a[0], _unit("blocks.0", _param("w", (4, 4))))
    assert structure.first_difference(a, renamed) == ("unit #1 'layers.0'", "unit #1 'blocks.0'")
    fewer = (a[0], _unit("layers.0"))
    assert structure.first_difference(a, fewer) == (
        "parameter 'w' float32 [4, 4] (Shard(dim=0)) in unit 'layers.0'",
        "no parameter after 0 in unit 'layers.0'")
    cast = (a[0], _unit("layers.0", _param("w", (4, 4)), param_dtype="bfloat16"))
    assert structure.first_difference(a, cast) == ("unit 'layers.0' with param_dtype -",
                                                   "unit 'layers.0' with param_dtype bfloat16")


def test_digests_are_equal_for_equal_models_and_differ_otherwise():
    a = (_unit("GPT", _param("tok.weight", (40, 16))),)
    b = (_unit("GPT", _param("tok.weight", (40, 16), "bfloat16")),)
    assert structure.digest(a) == structure.digest(tuple(a))
    assert structure.digest(a) != structure.digest(b)
    assert 0 <= structure.digest(a) < 2 ** 63  # its negative fits an int64 too


def _different_model_on_the_last_rank(change):
    config = dict(CFG)
    last = dist.get_rank() == dist.get_world_size() - 1
    if last and change == "vocab":
        config["vocab_size"] = 48
    if last and change == "layers":
        config["n_layers"] = 4
    model = GPT(GPTConfig(**config))
    if last and change == "dtype":
        model = model.to(torch.float64)
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    x, y = token_batch(0, 2, CFG["vocab_size"], CFG["seq_len"])
    lm_loss(model(x), y).backward()


@pytest.mark.parametrize("change,expected", [
    ("vocab", "rank 0 has parameter 'tok_emb.weight' float32 [40, 16] (Shard(dim=0)) where "
              "rank 1 has parameter 'tok_emb.weight' float32 [48, 16] (Shard(dim=0))"),
    ("layers", "rank 0 has 4 sharded units where rank 1 has 5 sharded units (unit #4 is "
               "'layers.3')"),
    ("dtype", "rank 0 has parameter 'tok_emb.weight' float32 [40, 16] (Shard(dim=0)) where "
              "rank 1 has parameter 'tok_emb.weight' float64 [40, 16] (Shard(dim=0))"),
])
def test_different_models_are_named_on_every_rank(change, expected):
    text = failure_report(_different_model_on_the_last_rank, change)
    assert "2 of 2 ranks failed" in text, text[-3000:]
    assert text.count("DivergenceError: fullshard: the ranks sharded different models") == 2, \
        text[-3000:]
    assert expected in text, text[-3000:]
    assert "gloo" not in text.lower(), text[-3000:]  # named before any collective broke
    assert matches_documented("E260", first_error(text, "DivergenceError")), text[-3000:]


def test_the_odd_rank_out_is_named_against_the_others():
    with pytest.raises(AssertionError) as failure:
        run_distributed(_different_model_on_the_last_rank, 3, "vocab", timeout=120)
    text = str(failure.value)
    assert "3 of 3 ranks failed" in text, text[-3000:]
    assert ("ranks 0, 1 have parameter 'tok_emb.weight' float32 [40, 16] (Shard(dim=0)) "
            "where rank 2 has parameter 'tok_emb.weight' float32 [48, 16]") in text, text[-3000:]


def _channel_traffic_of_two_steps(check: bool):
    """Which control-channel operations two training steps of one model issue, with the
    check of the model or without it."""
    from fullshard.core.guard.divergence import Guard

    if not check:
        Guard.agree_on_model = lambda *_args: None
    seen = []
    originals = {name: getattr(dist, name) for name in
                 ("all_reduce", "all_gather", "broadcast_object_list", "all_gather_object")}

    def counting(name):
        def call(*args, group=None, **kwargs):
            if group is not None and "fullshard_control" in (group.group_desc or ""):
                seen.append(name)
            return originals[name](*args, group=group, **kwargs)
        return call

    for name in originals:
        setattr(dist, name, counting(name))
    model = GPT(GPTConfig(**CFG))
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    x, y = token_batch(0, 2, CFG["vocab_size"], CFG["seq_len"])
    for _ in range(2):
        lm_loss(model(x), y).backward()
    return seen


def test_the_same_model_costs_one_small_all_reduce_and_no_exchange():
    with_check = run_distributed(_channel_traffic_of_two_steps, 2, True)
    without = run_distributed(_channel_traffic_of_two_steps, 2, False)
    assert with_check[0] == with_check[1]
    # no exchange of descriptions when the models agree: one all-reduce more, nothing else
    assert sorted(with_check[0]) == sorted(without[0] + ["all_reduce"]), (with_check, without)
