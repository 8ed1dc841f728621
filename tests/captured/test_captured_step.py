"""capture_step (Note [capturing the steady step]) as far as a CPU can run it: every
refusal, before anything runs; the copy into the static inputs and the replay-time
checks; that eager fullshard steps after the first issue the same collectives in the same
order (what a replay of the captured one issues), and that warm-up steps which do not are
refused; the guard recording without exchanging while quiet and comparing after; the
copy stream forgetting events recorded before a capture. The capture and replay
themselves need CUDA and are not tested here."""

import pytest
import torch
import torch.distributed as dist

from fullshard import CaptureError, CPUOffloadPolicy, capture_step, fully_shard
from fullshard.captured import quiet_guards
from fullshard.captured.inputs import StaticInputs
from fullshard.captured.numbers import GroupNumbers
from fullshard.captured.steady import check_steady, record_steps
from fullshard.core.comm import HostCopies
from fullshard.core.guard.divergence import BACKWARD, DivergenceError, Guard
from fullshard.core.state import unit_of
from fullshard.gpt import GPT, GPTConfig, lm_loss
from fullshard.testing import run_distributed
from fullshard.testing.counting import count_collectives
from fullshard.testing.models import token_batch
from support.catalogue import matches_documented
from support.recording_streams import RecordingStreams

CFG = GPTConfig(vocab_size=40, seq_len=8, d_model=16, n_layers=3, n_heads=2)
CPU = torch.device("cpu")


def _model(**kwargs):
    torch.manual_seed(0)
    model = GPT(CFG)
    for layer in model.layers:
        fully_shard(layer, **kwargs)
    return fully_shard(model, **kwargs)


def _step_of(model, opt, every_third_evaluates=False):
    calls = []

    def step(x, y):
        calls.append(None)
        loss = lm_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if every_third_evaluates and len(calls) % 3 == 0:
            with torch.no_grad():
                model(x)  # an evaluation every third step: its gathers are extra
        return loss
    return step


def _cases():
    """Every case that needs ranks, in one launch (each launch costs seconds)."""
    return {"steady": _steady_steps(), "quiet": _quiet_guard(), "refused": _refusals()}


@pytest.fixture(scope="module")
def ranks():
    return run_distributed(_cases, 2)


# -- the warm-up's collectives --------------------------------------------------------------
def _steady_steps():
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = token_batch(dist.get_rank(), 4, CFG.vocab_size, CFG.seq_len)
    records = record_steps(_step_of(model, opt), (x, y), 3)
    with count_collectives() as counted:
        _step_of(model, opt)(x, y)
    check_steady(records)  # raises if the last two differ
    unsteady = record_steps(_step_of(model, opt, every_third_evaluates=True), (x, y), 3)
    try:
        check_steady(unsteady)
        refused = "NO ERROR RAISED"
    except CaptureError as err:
        refused = f"CaptureError: {err}"
    kinds = [[(kind, async_op) for kind, _, async_op in r] for r in records]
    return kinds, dict(counted), refused


@pytest.mark.slow
def test_eager_steps_after_the_first_issue_the_same_collectives_and_unsteady_ones_are_refused(
        ranks):
    for kinds, counted, refused in (r["steady"] for r in ranks):
        assert kinds[1] == kinds[2] and kinds[1], kinds
        names = [kind for kind, _ in kinds[2]]
        assert counted["reduce_scatter"] == names.count("reduce_scatter") > 0
        assert names.count("all_gather") == counted.get("all_gather", 0) + counted.get(
            "all_gather_async", 0) > 0
        # the third step's evaluation gathers again: the comparison names where
        assert matches_documented("E378", refused), refused
        assert "warm-up steps 2 and 3" in refused and "then all_gather" in refused, refused


# -- the guard while a step is captured ------------------------------------------------------
def _quiet_guard():
    model = _model()
    x, y = token_batch(dist.get_rank(), 4, CFG.vocab_size, CFG.seq_len)
    lm_loss(model(x), y).backward()
    guard = unit_of(model).root.guard
    posts = []
    real_post = Guard._post

    def counted(self, *args, **kwargs):
        posts.append(args)
        return real_post(self, *args, **kwargs)
    Guard._post = counted
    try:
        with torch.no_grad():
            model(x)  # a forward without grad compares at once (nothing checks it later)
        loud = len(posts)
        with quiet_guards([guard]):
            lm_loss(model(x), y).backward()  # on gloo its reductions' digests vouch in-band
            with torch.no_grad():
                model(x)  # recorded after the last reduction: nothing vouched for it
        quiet = len(posts) - loud
        unchecked = guard.ledger.count - guard.ledger.agreed
        guard.check(BACKWARD)
        agreed = guard.ledger.agreed == guard.ledger.count
        with quiet_guards([guard]):
            if dist.get_rank() == 1:
                guard.forward(unit_of(model.layers[0]).ledger_code)  # a forward rank 0 lacks
        try:
            guard.check(BACKWARD)
            diverged = "NO ERROR RAISED"
        except DivergenceError as err:
            diverged = str(err)
    finally:
        Guard._post = real_post
    return loud, quiet, unchecked, agreed, diverged


@pytest.mark.slow
def test_a_quiet_guard_records_without_exchanging_and_the_check_after_names_a_difference(ranks):
    for loud, quiet, unchecked, agreed, diverged in (r["quiet"] for r in ranks):
        assert loud >= 1  # the same forward, not quiet, is compared on the channel
        assert quiet == 0 and unchecked > 0  # recorded, not exchanged
        assert agreed
        assert "NO ERROR RAISED" not in diverged and "layers.0" in diverged, diverged


# -- refused before anything runs ------------------------------------------------------------
def _refusals():
    x, y = token_batch(0, 4, CFG.vocab_size, CFG.seq_len)
    out = {}

    def attempt(code, model, opt, *inputs, **kwargs):
        before = [p.to_local().clone() for p in model.parameters()]
        with count_collectives() as counted:
            try:
                capture_step(_step_of(model, opt), *inputs, model=model, optimizer=opt,
                             **kwargs)
                out[code] = "NO ERROR RAISED"
            except CaptureError as err:
                out[code] = f"CaptureError: {err}"
        untouched = all(torch.equal(b, p.to_local()) for b, p in zip(before, model.parameters()))
        out[code + " ran"] = (sum(counted.values()), untouched)

    def capturable(model):
        return torch.optim.AdamW(model.parameters(), lr=1e-2, capturable=True)
    model = _model()
    attempt("E376", model, capturable(model), x, y, warmup=1)
    model = _model(offload_policy=CPUOffloadPolicy(pin_memory=False))
    attempt("E374 offload", model, capturable(model), x, y)
    model = _model(debug=True)
    attempt("E374 debug", model, capturable(model), x, y)
    model = _model()
    attempt("E375", model, torch.optim.AdamW(model.parameters(), lr=1e-2), x, y)
    attempt("E377", model, capturable(model), x, [y])
    attempt("E373", model, capturable(model), x, y)
    sgd = _model()
    attempt("E373 sgd", sgd, torch.optim.SGD(sgd.parameters(), lr=0.1), x, y)  # no option
    return out


@pytest.mark.slow
def test_what_a_graph_cannot_hold_is_refused_in_one_line_before_any_step_runs(ranks):
    out = ranks[0]["refused"]
    for case in ("E373", "E374 offload", "E374 debug", "E375", "E376", "E377", "E373 sgd"):
        code = case.split()[0]
        assert matches_documented(code, out[case]), (case, out[case])
        assert out[case + " ran"] == (0, True), case  # no warm-up step, no collective
    assert "offload_policy=CPUOffloadPolicy" in out["E374 offload"]
    assert "debug=True" in out["E374 debug"]
    assert "AdamW's param group 0 has capturable=False" in out["E375"]
    assert "input 1 is a list where the step needs a tensor on cpu" in out["E377"]
    assert "GPT computes on cpu" in out["E373"]


# -- what a replay checks, and copies in ---------------------------------------------------
def test_fresh_inputs_are_copied_into_the_captured_tensors_and_other_shapes_refused():
    x, y = torch.zeros(4, 8, dtype=torch.long), torch.zeros(4, 8)
    static = StaticInputs((x, y), CPU)
    addresses = (x.data_ptr(), y.data_ptr())
    fresh = (torch.arange(32).view(4, 8), torch.ones(4, 8))
    static.copy_in(fresh)
    assert (x.data_ptr(), y.data_ptr()) == addresses
    assert torch.equal(x, fresh[0]) and torch.equal(y, fresh[1])
    for bad in [(torch.zeros(2, 8, dtype=torch.long), y),        # a smaller batch
                (x, torch.zeros(4, 8, dtype=torch.float64)),     # another dtype
                (x,), (x, y, y)]:                                # fewer, more
        with pytest.raises(CaptureError) as err:
            static.copy_in(bad)
        assert matches_documented("E377", f"CaptureError: {err.value}"), err.value
        assert torch.equal(x, fresh[0])  # nothing copied before the refusal
    with pytest.raises(CaptureError, match=r"input 0 is an int64 tensor of shape \(2, 8\) on "
                       r"cpu where the step needs an int64 tensor of shape \(4, 8\)"):
        static.copy_in((torch.zeros(2, 8, dtype=torch.long), y))


def test_a_python_learning_rate_changed_after_capture_is_refused_a_tensor_one_is_read():
    params = [torch.nn.Parameter(torch.zeros(3))]
    scheduled = torch.optim.AdamW(params, lr=1e-3)
    numbers = GroupNumbers([scheduled])
    numbers.check_unchanged()
    scheduler = torch.optim.lr_scheduler.StepLR(scheduled, step_size=1, gamma=0.5)
    scheduled.step()
    scheduler.step()
    with pytest.raises(CaptureError) as err:
        numbers.check_unchanged()
    assert matches_documented("E379", f"CaptureError: {err.value}")
    assert "AdamW's param group 0 has lr=0.0005, captured with lr=0.001" in str(err.value)
    tensor_lr = torch.optim.AdamW(params, lr=torch.tensor(1e-3))
    numbers = GroupNumbers([tensor_lr])
    tensor_lr.param_groups[0]["lr"].mul_(0.5)  # what the graph reads, in place
    numbers.check_unchanged()


def test_the_copy_stream_forgets_events_recorded_before_a_capture():
    fake = RecordingStreams()
    copies = HostCopies(CPU, streams=fake)
    copies.reads_done()  # a gather's copy-out in the last eager step
    copies.forget_reads()
    fake.log.clear()
    with copies.to_device():  # the capture's first gather
        pass
    assert not [e for e in fake.log if e[0] == "wait_event"], fake.log
    assert ("wait_stream", "to_device", "compute") in fake.log  # forked from the capture
