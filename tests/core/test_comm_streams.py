"""The CUDA stream rules of Note [streams and events], checked on CPU with a stand-in for
``torch.cuda``'s streams and events that records what is asked of it; and a custom
reduce-scatter's input kept alive until its collective finishes (Note [custom
collectives]). What only a GPU shows (the copies overlapping compute, no block reused
under a read) stays for the CUDA lane."""

import pytest
import weakref

import torch
import torch.distributed as dist

from fullshard import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from fullshard.core.group import GroupState
from fullshard.core.state import unit_of
from fullshard.core.comm import HostCopies, SharedCopies
from fullshard.gpt import GPT, GPTConfig, lm_loss
from fullshard.testing import collectives_at_one_rank, run_distributed
from fullshard.testing.models import token_batch
from fullshard.testing.parity import check_parity
from support.recording_streams import RecordingStreams, RecordedStream

CFG = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_layers=2, n_heads=4)


def test_the_copy_stream_waits_for_reads_on_every_compute_stream():
    """Two pipeline stages on their own compute streams share one copy stream
    (share_comm_ctx): a gather from stage B must not reuse a block stage A still reads."""
    fake = RecordingStreams()
    copies = HostCopies(torch.device("cpu"), streams=fake)
    stage_a, stage_b = fake.current, RecordedStream(fake, "stage_b")
    with copies.to_device():
        pass
    copies.reads_done()  # stage A copied out of the gathered buffer
    read_a = fake.log[-1][2]
    assert fake.log[-1][:2] == ("record", "compute")
    fake.current = stage_b
    fake.log.clear()
    with copies.to_device():
        pass
    assert ("wait_stream", "to_device", "stage_b") in fake.log
    assert ("wait_event", "to_device", read_a) in fake.log
    assert fake.log.index(("wait_event", "to_device", read_a)) < fake.log.index(
        ("enter", "to_device"))  # before anything is allocated on the copy stream
    fake.log.clear()
    with copies.to_device():  # each read is waited for once
        pass
    assert not [e for e in fake.log if e[0] == "wait_event"]
    fake.current = stage_a


def _model_with_recorded_streams(offload: bool):
    model = GPT(CFG)
    # offloaded, computing in bf16: the one-rank gather copies (casts) the host shard as
    # it would copy it to an accelerator; an fp32 shard computed on the host it already
    # is needs no copy at all (Note [shard groups of one rank])
    options = {"offload_policy": CPUOffloadPolicy(pin_memory=False),
               "mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16)} if offload else {}
    for layer in model.layers:
        fully_shard(layer, reshard_after_forward=True, **options)
    fully_shard(model, **options)
    x, y = token_batch(0, 2, CFG.vocab_size, CFG.seq_len)
    lm_loss(model(x), y).backward()  # the root exists from here on
    fake = RecordingStreams()
    shared = SharedCopies()
    shared._copies = HostCopies(torch.device("cpu"), streams=fake)
    unit_of(model).root.use_copies(shared)
    return model, fake


def _one_rank_offload_copies_on_the_copy_stream():
    model, fake = _model_with_recorded_streams(offload=True)
    group = unit_of(model.layers[0]).group
    assert group.state is GroupState.SHARDED
    group.unshard(async_op=True)  # a prefetch: the copy is queued, nothing waits yet
    assert group.state is GroupState.GATHERING
    kinds = [e[:2] for e in fake.log]
    assert ("enter", "to_device") in kinds and ("record", "to_device") in kinds
    issued = next(e[2] for e in fake.log if e[:2] == ("record", "to_device"))
    assert ("wait_event", "compute", issued) not in fake.log
    group.wait_unshard()  # the compute stream waits for the copy only now
    assert fake.log[-1] == ("wait_event", "compute", issued)
    assert group.state is GroupState.UNSHARDED
    group.reshard()
    return True


def test_offload_at_one_rank_copies_on_the_copy_stream_and_prefetches():
    assert run_distributed(_one_rank_offload_copies_on_the_copy_stream, 1) == [True]


def _copy_out_is_followed_by_reads_done():
    collectives_at_one_rank()
    model, fake = _model_with_recorded_streams(offload=False)
    group = unit_of(model.layers[0]).group
    group.unshard(async_op=True)
    fake.log.clear()
    group.wait_unshard()
    # the gathered rows (made on the copy stream) were copied out on the compute stream:
    # an event there marks the end of those reads
    assert fake.log[-1][:2] == ("record", "compute"), fake.log
    group.reshard()
    return True


def test_a_gathers_copy_out_is_marked_for_the_copy_stream():
    assert run_distributed(_copy_out_is_followed_by_reads_done, 1) == [True]


class _DeferredWork:
    """A collective still running after the call returned (NCCL's asynchronous work):
    it reads its input only when waited on, holding no reference of its own."""

    def __init__(self, run):
        self._run = run

    def wait(self, timeout=None):
        self._run()
        return True

    def is_completed(self):
        return True


class _DeferredReduceScatter:
    """torch's ReduceScatter protocol; the reduction happens when its work is waited on."""

    def __init__(self):
        self.freed_early = 0

    def allocate(self, size, *, dtype, device):
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        held = weakref.ref(input_tensor)

        def reduce():
            full = held()
            if full is None:
                self.freed_early += 1
                raise AssertionError("the reduce-scatter's input was freed before the "
                                     "collective finished")
            received = torch.empty_like(full)
            dist.all_to_all_single(received, full, group=group)
            torch.sum(received.view(group.size(), -1), dim=0, out=output_tensor)
        return _DeferredWork(reduce)


def _custom_reduce_scatter_keeps_its_input():
    comms = []

    def shard(model):
        for layer in model.layers:
            fully_shard(layer)
            comms.append(_DeferredReduceScatter())
            layer.set_custom_reduce_scatter(comms[-1])
        fully_shard(model)

    def loss(model, batch):
        return lm_loss(model(batch[0]), batch[1])

    check_parity(lambda: GPT(CFG), shard,
                 lambda step: token_batch(step, 4, CFG.vocab_size, CFG.seq_len), loss, steps=3)
    return sum(c.freed_early for c in comms)


@pytest.mark.slow
def test_a_custom_reduce_scatters_input_lives_until_its_collective_finishes():
    assert run_distributed(_custom_reduce_scatter_keeps_its_input, 2) == [0, 0]
