"""``SafetensorsFiles.read``: a part of a tensor read as its rows, nothing more, into the
destination in its dtype, without mapping the file into the process (Note [reading rows
into the shard])."""

from __future__ import annotations

import os

import pytest
import torch

from fullshard.checkpoint import CheckpointError
from fullshard.checkpoint.safetensors_files import SafetensorsFiles

pytest.importorskip("safetensors")


def _saved(tmp_path) -> tuple[str, dict[str, torch.Tensor]]:
    from safetensors.torch import save_file
    torch.manual_seed(0)
    tensors = {"embed": torch.randn(1000, 700).bfloat16(), "norm": torch.randn(700),
               "scale": torch.tensor(2.5), "mask": torch.tensor([True, False, True]),
               "none": torch.zeros(0, 4)}
    path = str(tmp_path / "model.safetensors")
    save_file(tensors, path)
    return path, tensors


def _mapped(path: str) -> bool:
    with open("/proc/self/maps") as f:
        return any(line.rstrip().endswith(path) for line in f)


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="Linux /proc")
def test_a_part_reads_only_its_rows_into_the_destination_and_maps_nothing(tmp_path):
    path, tensors = _saved(tmp_path)
    files = SafetensorsFiles(path)
    try:
        rows = torch.empty(300, 700)  # fp32 from bf16, as a rank's shard
        assert files.read("embed", (slice(600, 900), slice(0, 700)), into=rows) is rows
        assert torch.equal(rows, tensors["embed"][600:900].float())
        assert files.bytes_read == 300 * 700 * 2  # the rows' bytes, not the tensor's
        assert not _mapped(path)  # the bytes were read, no page of the file is mapped
        files.bytes_read = 0
        same = torch.empty(300, 700, dtype=torch.bfloat16)  # straight into it, no cast
        files.read("embed", (slice(0, 300), slice(0, 700)), into=same)
        assert torch.equal(same, tensors["embed"][:300]) and files.bytes_read == 300 * 700 * 2
        files.bytes_read = 0
        columns = torch.empty(500, 200)  # a Shard(1) block: its rows whole, its part kept
        files.read("embed", (slice(500, 1000), slice(500, 700)), into=columns)
        assert torch.equal(columns, tensors["embed"][500:, 500:].float())
        assert files.bytes_read == 500 * 700 * 2
        for key in ("norm", "scale", "mask", "none"):
            assert torch.equal(files.read(key), tensors[key]), key
        scale = torch.empty((), dtype=torch.float64)
        files.read("scale", into=scale)
        assert scale.item() == 2.5
    finally:
        files.close()


def test_a_file_cut_short_after_it_was_opened_is_named(tmp_path):
    path, _ = _saved(tmp_path)
    files = SafetensorsFiles(path)
    try:
        os.truncate(path, files.tensors["embed"].begin + 100)
        with pytest.raises(CheckpointError, match="model.safetensors ends before the bytes "
                                                  "of embed do"):
            files.read("embed")
    finally:
        files.close()
