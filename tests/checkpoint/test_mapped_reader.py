"""fullshard's DCP reader (checkpoint/mapped_reader.py) reads what torch's reads: tensors
of every dtype and layout straight out of a memory map, and anything else through DCP's
own code."""

from __future__ import annotations

import tempfile
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

from fullshard.checkpoint import mapped_reader
from fullshard.checkpoint.mapped_reader import MappedReader

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings, strategies as st  # noqa: E402

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64,
          torch.int32, torch.int8, torch.uint8, torch.bool]


def _tensor(dtype: torch.dtype, shape: list[int], layout: str, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    padded = [n + 2 for n in shape]
    base = (torch.randn(padded, generator=g) * 100).to(dtype) if dtype.is_floating_point \
        else torch.randint(0, 2 if dtype == torch.bool else 100, padded, generator=g).to(dtype)
    whole = base[tuple(slice(1, 1 + n) for n in shape)]  # a view into a larger storage
    if layout == "transposed" and whole.dim() >= 2:
        return whole.transpose(0, 1).contiguous().transpose(0, 1)  # strides, no padding
    if layout == "view":
        return whole
    return whole.contiguous()


def _load(path: str, like: dict, reader) -> dict:
    state = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else None
             for k, v in like.items()}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, checkpoint_id=path, storage_reader=reader, no_dist=True)
    return state


def _save(state: dict, path: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(state, checkpoint_id=path, no_dist=True)


_states = st.dictionaries(
    st.from_regex(r"[a-z]{1,6}(\.[a-z0-9]{1,4}){0,2}", fullmatch=True),
    st.tuples(st.sampled_from(DTYPES), st.lists(st.integers(0, 5), max_size=3),
              st.sampled_from(["contiguous", "view", "transposed"]), st.integers(0, 2**16)),
    min_size=1, max_size=6)


@settings(max_examples=40, deadline=None, database=None)
@given(_states)
def test_every_tensor_reads_as_torch_reads_it(spec):
    state = {k: _tensor(*v) for k, v in spec.items()}
    with tempfile.TemporaryDirectory() as path:
        _save(state, path)
        mine = _load(path, state, MappedReader(path))
        torchs = _load(path, state, FileSystemReader(path))
    for key, value in state.items():
        assert mine[key].dtype == value.dtype
        assert torch.equal(mine[key], value), key
        assert torch.equal(mine[key], torchs[key]), key


def test_tensors_skip_torch_load_and_the_rest_goes_through_dcp(tmp_path, monkeypatch):
    """The fast path serves every plain tensor; bytes (and any archive it does not know,
    here all of them) are read by DCP's reader, with the same result."""
    state = {"w": torch.randn(4, 3), "t": torch.randn(3, 4).t(), "n": torch.tensor(7)}
    _save({**state, "extra": {"step": 3}}, str(tmp_path))
    handed_on = []
    original = FileSystemReader.read_data

    def spy(self, plan, planner):
        handed_on.extend(item.storage_index.fqn for item in plan.items)
        return original(self, plan, planner)

    monkeypatch.setattr(FileSystemReader, "read_data", spy)
    loaded = {"w": torch.zeros(4, 3), "t": torch.zeros(4, 3), "n": torch.tensor(0),
              "extra": {"step": 0}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(loaded, checkpoint_id=str(tmp_path), storage_reader=MappedReader(str(tmp_path)),
                 no_dist=True)
    assert handed_on == ["extra.step"]
    assert loaded["extra"] == {"step": 3}
    assert all(torch.equal(loaded[k], v) for k, v in state.items())

    handed_on.clear()
    monkeypatch.setattr(mapped_reader, "locate", lambda *args: None)
    again = _load(str(tmp_path), state, MappedReader(str(tmp_path)))
    assert sorted(handed_on) == ["n", "t", "w"]
    assert all(torch.equal(again[k], v) for k, v in state.items())


def test_an_archive_holding_more_than_a_plain_tensor_is_not_guessed_at():
    """``locate`` knows one plain little-endian tensor stored uncompressed; a tensor with
    Python attributes, or bytes that are no zip, are left to torch.load."""
    import io
    for obj in (torch.nn.Parameter(torch.ones(3)), ):
        buffer = io.BytesIO()
        torch.save(obj, buffer)
        data = memoryview(buffer.getvalue())
        assert mapped_reader.locate(data, 0, len(data)) is None
    tagged = torch.ones(2)
    tagged.note = "kept"
    buffer = io.BytesIO()
    torch.save(tagged, buffer)
    assert mapped_reader.locate(memoryview(buffer.getvalue()), 0, len(buffer.getvalue())) is None
    junk = memoryview(b"\0" * 64)
    assert mapped_reader.locate(junk, 0, 64) is None
    plain = io.BytesIO()
    torch.save(torch.arange(6.0).view(2, 3), plain)
    stored = mapped_reader.locate(memoryview(plain.getvalue()), 0, len(plain.getvalue()))
    assert stored is not None and stored.size == (2, 3) and stored.dtype == torch.float32
