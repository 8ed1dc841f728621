"""Every entry of docs/errors.md, produced and compared with the documented text.

The doc shows each error as ``ExceptionType: message`` in a ``text`` block under a
``### Ennn`` heading; ``…`` stands for a part that varies (a path, a port). This test
triggers each case and requires the message to match the doc exactly otherwise, so
the catalogue cannot drift from what users see.
"""

from __future__ import annotations

import argparse
import os
import re
from functools import partial
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from support.catalogue import _matches, documented, message_of, run_stderr_of
from fullshard.testing import run_distributed

class _Pair(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x):
        return self.b(self.a(x))


def _sharded(model, **kwargs):
    from fullshard import fully_shard
    return fully_shard(model, **kwargs)


def _library_cases(tmp: str) -> dict[str, str]:
    """The cases that need a process group (world size 2)."""
    from torch.distributed.device_mesh import init_device_mesh

    from fullshard import (FSDP, MixedPrecision, MixedPrecisionPolicy, ShardingStrategy,
                           StateDictType, apply_activation_checkpointing, fully_shard)
    from fullshard import checkpoint as ckpt

    out = {}

    def optimizer_first():
        model = _Pair()
        opt = torch.optim.AdamW(model.parameters())
        fully_shard(model)
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
    out["E01"] = message_of(optimizer_first)

    def child_after_parent():
        model = _Pair()
        fully_shard(model)
        fully_shard(model.a)
    out["E02"] = message_of(child_after_parent)

    def twice():
        model = fully_shard(_Pair())
        fully_shard(model)
    out["E03"] = message_of(twice)
    out["E05"] = message_of(lambda: fully_shard(nn.ModuleList([nn.Linear(2, 2)])))

    def shared_across_units():
        model = _Pair()
        model.b.weight = model.a.weight
        fully_shard(model.a)
        fully_shard(model.b)
    out["E06"] = message_of(shared_across_units)

    def zero_dim():
        model = nn.Linear(2, 2)
        model.scale = nn.Parameter(torch.tensor(1.0))
        fully_shard(model)
    out["E07"] = message_of(zero_dim)

    def integer_param():
        model = nn.Linear(2, 2)
        model.steps = nn.Parameter(torch.zeros(3, dtype=torch.long), requires_grad=False)
        fully_shard(model)
    out["E08"] = message_of(integer_param)
    out["E09"] = message_of(lambda: fully_shard(_mixed()))
    out["E10"] = message_of(lambda: fully_shard(nn.Linear(2, 2), mesh=init_device_mesh(
        "cpu", (1, 1, 2), mesh_dim_names=("a", "b", "c"))))
    out["E145"] = message_of(lambda: fully_shard(nn.Linear(2, 2), mesh=init_device_mesh(
        "cpu", (1, 2))))
    out["E11"] = message_of(lambda: fully_shard(nn.Linear(2, 2), reshard_after_forward=3))
    out["E12"] = message_of(lambda: fully_shard(nn.Linear(2, 2), mp_policy=MixedPrecisionPolicy(
        param_dtype=torch.int8)))

    def meta_at_forward():
        with torch.device("meta"):
            model = nn.Linear(4, 4)
        fully_shard(model)
        model(torch.randn(2, 4))
    out["E13"] = message_of(meta_at_forward)

    def plain_over_dtensor():
        model = fully_shard(nn.Linear(4, 4))
        model.weight = nn.Parameter(torch.zeros(4, 4))
        model(torch.randn(2, 4))
    out["E14"] = message_of(plain_over_dtensor)

    def plain_state_dict():
        torch.manual_seed(0)
        full = _Pair().state_dict()
        fully_shard(_Pair()).load_state_dict(full)
    out["E167"] = message_of(plain_state_dict)
    out["E15"] = message_of(lambda: fully_shard(nn.Linear(4, 4))(torch.randn(2, 4, device="meta")))

    def bucket_after_forward():
        model = fully_shard(nn.Linear(4, 4))
        model(torch.randn(2, 4))
        model.set_bucket_numel(0)
    out["E16"] = message_of(bucket_after_forward)
    out["E17"] = message_of(lambda: fully_shard(nn.Linear(4, 4)).set_requires_gradient_sync(1))
    out["E18"] = message_of(lambda: FSDP(nn.Linear(2, 2), sharding_strategy="FULL_SHARD"))
    out["E19"] = message_of(lambda: FSDP(nn.Linear(2, 2), mixed_precision=MixedPrecision(
        param_dtype=torch.float16, keep_low_precision_grads=True)))
    out["E20"] = message_of(lambda: FSDP.set_state_dict_type(
        FSDP(nn.Linear(2, 2)), StateDictType.LOCAL_STATE_DICT))
    out["E21"] = message_of(lambda: FSDP(nn.Linear(2, 2), sharding_strategy=(
        ShardingStrategy.FULL_SHARD), process_group=(dist.group.WORLD, dist.group.WORLD)))
    out["E22"] = message_of(lambda: FSDP(nn.Linear(2, 2), device_id=0))

    def sync_meta():
        with torch.device("meta"):
            model = nn.Linear(2, 2)
        FSDP(model, sync_module_states=True, param_init_fn=lambda m: None)
    out["E23"] = message_of(sync_meta)

    def summon_rank0_writeback():
        model = FSDP(nn.Linear(2, 2))
        with FSDP.summon_full_params(model, rank0_only=True):
            pass
    out["E24"] = message_of(summon_rank0_writeback)

    def reentrant():
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (CheckpointImpl,
                                                                                 checkpoint_wrapper)
        apply_activation_checkpointing(_Pair(), checkpoint_wrapper_fn=partial(
            checkpoint_wrapper, checkpoint_impl=CheckpointImpl.REENTRANT))
    out["E25"] = message_of(reentrant)

    def stale_optimizer():
        model = fully_shard(nn.Linear(4, 4))
        opt = torch.optim.AdamW(model.parameters())
        model.load_state_dict({k: v.detach().clone() for k, v in model.state_dict().items()},
                              assign=True)
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
    out["E36"] = message_of(stale_optimizer)

    def local_tensor_replaced():
        model = fully_shard(nn.Linear(4, 4))
        opt = torch.optim.AdamW(model.parameters())
        model.weight._local_tensor = model.weight._local_tensor.clone()
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
    out["E37"] = message_of(local_tensor_replaced)
    out["E38"] = message_of(lambda: fully_shard(nn.Linear(4, 4)).load_state_dict(
        {"weight": torch.zeros(3, 4), "bias": torch.zeros(4)}))

    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from fullshard import DataParallelMeshDims
    out["E40"] = message_of(lambda: fully_shard(nn.Linear(5, 4),
                                              shard_placement_fn=lambda p: Shard(p.dim() - 1)))
    out["E49"] = message_of(lambda: fully_shard(nn.Linear(4, 4),
                                              shard_placement_fn=lambda p: Replicate()))
    dp_tp = init_device_mesh("cpu", (2, 1), mesh_dim_names=("dp", "tp"))
    out["E360"] = message_of(lambda: fully_shard(nn.Linear(4, 4), mesh=dp_tp,
                                               dp_mesh_dims=DataParallelMeshDims(
                                                   shard="dp", replicate="dp")))
    out["E361"] = message_of(lambda: fully_shard(nn.Linear(4, 4), mesh=dp_tp,
                                               dp_mesh_dims=DataParallelMeshDims(shard=())))
    out["E48"] = message_of(lambda: fully_shard(nn.Linear(4, 4), mesh=dp_tp,
                                              dp_mesh_dims=DataParallelMeshDims(shard="dp")))

    def on_dp_tp(*placements) -> nn.Linear:
        linear = nn.Linear(4, 4)
        for name, p in list(linear.named_parameters()):
            setattr(linear, name, nn.Parameter(distribute_tensor(p.detach(), dp_tp, placements)))
        return linear
    out["E335"] = message_of(lambda: fully_shard(on_dp_tp(Shard(0), Replicate()), mesh=dp_tp,
                                               dp_mesh_dims=DataParallelMeshDims(shard="dp")))
    out["E336"] = message_of(lambda: fully_shard(
        on_dp_tp(Replicate(), Replicate()), mesh=dp_tp,
        dp_mesh_dims=DataParallelMeshDims(shard="nonexistent")))
    out["E337"] = message_of(lambda: fully_shard(
        on_dp_tp(Replicate(), Replicate()), mesh=dp_tp, reshard_after_forward=2,
        dp_mesh_dims=DataParallelMeshDims(shard="dp")))

    def setting_after_merge():
        model = _Pair()
        fully_shard(model.a)
        fully_shard(model.b)
        fully_shard(model)
        model(torch.randn(2, 4))
        model.a.set_gradient_divide_factor(4.0)
    out["E42"] = message_of(setting_after_merge)

    def deepcopy_sharded():
        import copy
        copy.deepcopy(fully_shard(nn.Linear(4, 4)))
    out["E43"] = message_of(deepcopy_sharded)
    out["E44"] = message_of(lambda: fully_shard(nn.Linear(4, 4)).set_custom_all_gather(None))
    def hooks_set_after_sharding():
        model = fully_shard(nn.Sequential(nn.Linear(4, 4)))
        local = model[0].weight._local_tensor
        local.fsdp_pre_all_gather = lambda *args: ((local,), None)
        local.fsdp_post_all_gather = lambda outputs, *args, **kwargs: (outputs[0], ())
        model(torch.randn(2, 4))
    out["E331"] = message_of(hooks_set_after_sharding)
    from fullshard import share_comm_ctx
    out["E330"] = message_of(lambda: share_comm_ctx([fully_shard(nn.Linear(4, 4)),
                                                     nn.Linear(4, 4)]))

    from torch.distributed.device_mesh import DeviceMesh
    rank0_only_mesh = DeviceMesh("cpu", torch.tensor([0]))  # every rank builds it; rank 1 is outside
    if dist.get_rank() == 1:
        out["E35"] = message_of(lambda: fully_shard(nn.Linear(2, 2), mesh=rank0_only_mesh))

    path = os.path.join(tmp, "step_1")
    ckpt.save(path, fully_shard(_Pair()))
    out["E26"] = message_of(lambda: ckpt.load(path, fully_shard(nn.Linear(4, 4))))
    dist.barrier()
    if dist.get_rank() == 0:  # flip bytes in one shard file
        shard = sorted(p for p in Path(path).iterdir() if p.suffix == ".distcp")[0]
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(data))
    dist.barrier()
    out["E27"] = message_of(lambda: ckpt.load(path, fully_shard(_Pair())))
    out["E28"] = message_of(lambda: ckpt.load(os.path.join(tmp, "nothing_here"),
                                            fully_shard(_Pair())))

    def optimizer_does_not_fit():
        model = fully_shard(nn.Linear(4, 4))
        sgd = torch.optim.SGD(model.parameters(), lr=0.1)
        model(torch.randn(2, 4)).sum().backward()
        sgd.step()
        saved = ckpt.save(os.path.join(tmp, "sgd", "step_1"), model, sgd)
        ckpt.load(saved, model, torch.optim.AdamW(model.parameters()))
    out["E39"] = message_of(optimizer_does_not_fit)
    out.update(_install_order_cases())

    def load_fails_on_one_rank():
        model = fully_shard(nn.Linear(4, 4))
        sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        model(torch.randn(2, 4)).sum().backward()
        sgd.step()
        saved = ckpt.save(os.path.join(tmp, "one_rank", "step_1"), model, sgd)
        from fullshard.checkpoint import io

        def refuse(*args, **kwargs):
            raise RuntimeError("refused on this rank")
        adopt = io.set_optimizer_state_dict
        if dist.get_rank() == 1:
            io.set_optimizer_state_dict = refuse
        try:
            ckpt.load(saved, model, sgd)
        finally:
            io.set_optimizer_state_dict = adopt
    out["E160"] = message_of(load_fails_on_one_rank)

    def load_hf_fails_on_one_rank():
        from safetensors.torch import save_file

        from fullshard.checkpoint.safetensors_files import SafetensorsFiles
        pair = _Pair()
        path = os.path.join(tmp, "hf_pair.safetensors")
        if dist.get_rank() == 0:
            save_file(pair.state_dict(), path)
        dist.barrier()
        model = fully_shard(pair)
        read = SafetensorsFiles.read

        def unreadable(self, key, index=None, into=None):
            raise OSError(5, "Input/output error")
        if dist.get_rank() == 1:
            SafetensorsFiles.read = unreadable
        try:
            ckpt.load_hf(model, path)
        finally:
            SafetensorsFiles.read = read
    out["E206"] = message_of(load_hf_fails_on_one_rank)

    def save_fails_on_one_rank():
        import resource
        import signal
        model = fully_shard(nn.Linear(64, 64))
        ckpt.save(os.path.join(tmp, "full", "step_1"), model)
        soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        if dist.get_rank() == 1:  # a full disk on rank 1's side (EFBIG stands for ENOSPC)
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (4096, hard))
        try:
            ckpt.save(os.path.join(tmp, "full", "step_2"), model)
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    out["E161"] = message_of(save_fails_on_one_rank)

    def checkpoints_not_a_directory():
        from fullshard.train.checkpoints import check_shared
        run = os.path.join(tmp, "out-with-a-file")
        if dist.get_rank() == 0:
            os.makedirs(run, exist_ok=True)
            open(os.path.join(run, "checkpoints"), "w").close()
        dist.barrier()
        check_shared(run)
    out["E173"] = message_of(checkpoints_not_a_directory)
    if dist.get_rank() == 0:
        assert sorted(os.listdir(os.path.join(tmp, "full"))) == ["latest", "step_1"]

    from fullshard import DiskOffloadPolicy
    out["E136"] = message_of(lambda: fully_shard(nn.Linear(4, 4), offload_policy=DiskOffloadPolicy(
        path=os.path.join(tmp, "no-such-dir"))))

    out["E386"] = message_of(lambda: fully_shard(nn.Linear(4, 4), offload_policy=DiskOffloadPolicy(
        path=tmp, params=True, params_on_device=True)))

    def not_elementwise():
        class Lion(torch.optim.AdamW):
            pass
        model = fully_shard(nn.Linear(4, 4), offload_policy=DiskOffloadPolicy(path=tmp))
        model(torch.randn(2, 4)).sum().backward()
        Lion(model.parameters()).step()
    out["E137"] = message_of(not_elementwise)

    def sparse_adam():
        model = fully_shard(nn.Linear(4, 4))
        model(torch.randn(2, 4)).sum().backward()
        torch.optim.SparseAdam(model.parameters()).step()
    out["E168"] = message_of(sparse_adam)

    def disk_full():
        import resource
        import signal
        model = fully_shard(nn.Linear(64, 64), offload_policy=DiskOffloadPolicy(path=tmp))
        model(torch.randn(2, 64)).sum().backward()
        opt = torch.optim.AdamW(model.parameters())
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, hard))
        try:
            opt.step()
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    out["E138"] = message_of(disk_full)

    out["E141"] = message_of(lambda: fully_shard(nn.Linear(4, 4), mesh=init_device_mesh(
        "cpu", (2, 1), mesh_dim_names=("replicate", "shard"))).set_quantized_communication(
            grads=True))

    class Gather:
        def allocate(self, size, *, dtype, device):
            return torch.empty(*size, dtype=dtype, device=device)

        def __call__(self, output_tensor, input_tensor, group, async_op=False):
            return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group,
                                               async_op=async_op)

    def custom_and_quantized():
        model = fully_shard(nn.Linear(4, 4))
        model.set_custom_all_gather(Gather())
        model.set_quantized_communication(weights=True)
    out["E142"] = message_of(custom_and_quantized)
    out.update(_comm_setter_cases(Gather))

    def torch_root_then_fullshard_child():
        from torch.distributed.fsdp import fully_shard as torch_fully_shard
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        torch_fully_shard(model)
        fully_shard(model[0])
    out["E270"] = message_of(torch_root_then_fullshard_child)

    def tp_mesh_made_apart():
        from torch.distributed.tensor import Shard, distribute_tensor
        dp = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
        tp = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
        layer = nn.Linear(4, 4)
        layer.weight = nn.Parameter(distribute_tensor(layer.weight.detach(), tp, [Shard(0)]))
        fully_shard(layer, mesh=dp)
    out["E271"] = message_of(tp_mesh_made_apart)
    return out


def _comm_setter_cases(custom_gather) -> dict[str, str]:
    """torch's communication setters (core/comm_groups.py), at world size 2."""
    from fullshard import fully_shard

    def allocation_beside_custom():
        model = fully_shard(nn.Linear(4, 4))
        model.set_custom_all_gather(custom_gather())
        model.set_allocate_memory_from_process_group_for_comm(True)

    def symmetric_beside_allocation():
        model = fully_shard(nn.Linear(4, 4))
        model.set_allocate_memory_from_process_group_for_comm(True)
        model.set_symm_mem_for_comm()

    def merged_then_separated():
        model = _Pair()
        fully_shard(model.a)
        fully_shard(model)  # merged with the root's group at the first forward
        model(torch.randn(2, 4))
        model.a.set_separate_reduce_scatter_group()

    return {"E300": message_of(allocation_beside_custom),
            "E301": message_of(symmetric_beside_allocation),
            "E302": message_of(lambda: fully_shard(nn.Linear(4, 4)).set_symm_mem_for_comm()),
            "E303": message_of(merged_then_separated)}


def _install_order_cases() -> dict[str, str]:
    """torch's fully_shard bound before fullshard.install(), then mixed with fullshard's."""
    import sys
    import types
    import warnings

    import fullshard
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    early = types.ModuleType("early_user_code")
    early.fully_shard = torch_fully_shard
    sys.modules["early_user_code"] = early
    out = {}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", fullshard.InstallOrderWarning)
            out["E164"] = message_of(fullshard.install)
        fullshard.install()
        torch_child = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        torch_fully_shard(torch_child[0])
        out["E162"] = message_of(lambda: fullshard.fully_shard(torch_child))
        ours_child = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        fullshard.fully_shard(ours_child[1])
        out["E163"] = message_of(lambda: torch_fully_shard(ours_child))
    finally:
        fullshard.uninstall()
        del sys.modules["early_user_code"]
    return out


def _mixed():
    model = _Pair()
    model.b.double()
    return model


def _no_process_group_case() -> dict[str, str]:
    from fullshard import fully_shard
    from fullshard.testing import visible_gpus
    assert not dist.is_initialized()
    return {"E04": message_of(lambda: fully_shard(nn.Linear(2, 2))),
            "E72": message_of(lambda: run_distributed(_mixed, visible_gpus() + 1,
                                                    backend="nccl"))}


def _checksum_cases(tmp: str) -> dict[str, str]:
    """Checkpoints whose checksums cannot be computed here (one process)."""
    import json
    import sys

    from fullshard import checkpoint as ckpt

    model = nn.Linear(2, 2)
    path = ckpt.save(os.path.join(tmp, "checksums", "step_1"), model)
    manifest_path = os.path.join(path, "fullshard.json")
    with open(manifest_path) as f:
        manifest = json.load(f)

    def load_with(kind: str) -> str:
        for entry in manifest["files"].values():
            for key in [k for k in entry if k != "bytes"]:  # one checksum an entry
                del entry[key]
            entry[kind] = "0" * 32
        manifest["self_checksum"] = {kind: "0" * 32}  # sealed with it too
        with open(manifest_path, "w") as f:
            json.dump(manifest, f)
        return message_of(lambda: ckpt.load(path, model))

    out = {"E71": load_with("blake3")}
    saved, sys.modules["xxhash"] = sys.modules.get("xxhash"), None  # as if not installed
    try:
        out["E70"] = load_with("xxh3_128")
    finally:
        if saved is None:
            del sys.modules["xxhash"]
        else:
            sys.modules["xxhash"] = saved
    return out


def _load_hf_cases(tmp: str) -> dict[str, str]:
    """What ``load_hf`` says of folders and files that do not fit (one process)."""
    import json

    from safetensors.torch import save_file

    from fullshard.checkpoint import load_hf

    def folder(name: str, **tensors: torch.Tensor) -> str:
        path = os.path.join(tmp, "hf", name)
        os.makedirs(path)
        if tensors:
            save_file(tensors, os.path.join(path, "model.safetensors"))
        return path

    pair = {"a.weight": torch.ones(4, 4), "a.bias": torch.ones(4), "b.weight": torch.ones(4, 4),
            "b.bias": torch.ones(4)}
    bin_only = folder("bin_only")
    torch.save(pair, os.path.join(bin_only, "pytorch_model.bin"))
    two_files = folder("two_files", **pair)
    save_file({"a.bias": torch.ones(4)}, os.path.join(two_files, "more.safetensors"))
    indexed = folder("indexed", **pair)
    with open(os.path.join(indexed, "model.safetensors.index.json"), "w") as f:
        json.dump({"weight_map": {"a.weight": "model-00001-of-00002.safetensors"}}, f)
    directory = folder("directory")
    os.makedirs(os.path.join(directory, "model.safetensors"))
    text = os.path.join(tmp, "hf", "weights.txt")
    open(text, "w").close()

    class _Tagged(nn.Parameter):
        pass

    tagged = _Pair()
    tagged.a.weight = _Tagged(torch.zeros(4, 4))

    class _WithBuffer(_Pair):
        def __init__(self):
            super().__init__()
            self.register_buffer("scale", torch.ones(4), persistent=False)

    with torch.device("meta"):
        on_meta = _WithBuffer()
    without_b = {k: v for k, v in pair.items() if not k.startswith("b.bias")}

    def cut_short_after_opening():
        from fullshard.checkpoint.safetensors_files import SafetensorsFiles
        files = SafetensorsFiles(folder("cut", **pair))
        try:
            stored = files.tensors["a.weight"]
            os.truncate(stored.file, stored.begin)
            files.read("a.weight")
        finally:
            files.close()
    return {
        "E195": message_of(lambda: load_hf(_Pair(), bin_only)),
        "E196": message_of(lambda: load_hf(_Pair(), folder("missing", **without_b))),
        "E197": message_of(lambda: load_hf(_Pair(), folder("extra", **pair,
                                                          **{"c.weight": torch.ones(2)}))),
        "E198": message_of(lambda: load_hf(_Pair(), folder("shape", **{
            **pair, "a.weight": torch.ones(4, 3)}))),
        "E199": message_of(lambda: load_hf(_Pair(), folder("dtype", **{
            **pair, "a.weight": torch.ones(4, 4, dtype=torch.int64)}))),
        "E200": message_of(lambda: load_hf(tagged, folder("tagged", **pair))),
        "E201": message_of(lambda: load_hf(on_meta, folder("meta", **pair))),
        "E202": message_of(lambda: load_hf(_Pair(), indexed)),
        "E203": message_of(lambda: load_hf(_Pair(), two_files)),
        "E204": message_of(lambda: load_hf(_Pair(), os.path.join(tmp, "hf", "gone"))),
        "E205": message_of(lambda: load_hf(_Pair(), text)),
        "E243": message_of(lambda: load_hf(_Pair(), directory)),
        "E265": message_of(cut_short_after_opening),
    }


def _verification_cases(tmp: str) -> dict[str, str]:
    """What a reader says of each kind of directory and damage (one process)."""
    import warnings

    from fullshard import checkpoint as ckpt
    from support.checkpoint_dirs import (fullshard_checkpoint, shard_file, small_model,
                                         torch_checkpoint, truncate)

    root = os.path.join(tmp, "verification")
    load = partial(_message_of_load, ckpt)
    unfinished = os.path.join(root, ".step_2.tmp")
    os.makedirs(unfinished)
    plain = os.path.join(root, "plain")
    os.makedirs(plain)
    out = {"E85": load(unfinished), "E87": load(plain)}
    torch_step = torch_checkpoint(os.path.join(root, "torch_step"))
    with warnings.catch_warnings():
        warnings.simplefilter("error", ckpt.UnverifiedCheckpointWarning)
        out["E86"] = load(torch_step)
    truncate(shard_file(torch_step), 0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ckpt.UnverifiedCheckpointWarning)
        out["E93"] = load(torch_step)
    with open(os.path.join(torch_step, ".metadata"), "wb") as f:
        f.write(b"not a pickle")
    out["E92"] = load(torch_step)

    def damaged(name: str, damage) -> str:
        path = fullshard_checkpoint(os.path.join(root, name))
        damage(path)
        return message_of(lambda: ckpt.load(path, small_model()))

    def cut_manifest(path):
        text = open(os.path.join(path, "fullshard.json")).read()
        with open(os.path.join(path, "fullshard.json"), "w") as f:
            f.write(text.replace(",", "", 1))
    out["E88"] = damaged("manifest", cut_manifest)
    out["E89"] = damaged("missing", lambda p: os.remove(os.path.join(p, ".metadata")))
    out["E90"] = damaged("truncated", lambda p: truncate(shard_file(p)))
    fullshard_checkpoint(os.path.join(root, "dangling"))
    with open(os.path.join(root, "dangling", "latest"), "w") as f:
        f.write("step_9")
    out["E91"] = load(os.path.join(root, "dangling"))
    with open(os.path.join(root, "dangling", "latest"), "wb") as f:
        f.write(b"\x8f\xfe\x00\x13\xc3(\x07\xff")
    out["E240"] = load(os.path.join(root, "dangling"))
    return out


def _message_of_load(ckpt, path: str) -> str:
    from support.checkpoint_dirs import small_model
    return message_of(lambda: ckpt.load(path, small_model()))


def _trainer_cases(tmp: str) -> dict[str, str]:
    from fullshard.cli.train import _check_launch, build_parser, resolve_config

    def resolve(*argv):
        args = build_parser().parse_args(list(argv))
        resolve_config(args)
        _check_launch(args, resolve_config(args)[1])

    return {
        "E73": message_of(lambda: resolve("--optim.lr", "nan")),
        "E74": message_of(lambda: resolve("--steps", "ten")),
        "E75": message_of(lambda: resolve("--optim.lrr", "1")),
        "E31": message_of(lambda: resolve("--batch.val_fraction", "1.5")),
        "E32": message_of(lambda: resolve("--parallel.strategy", "zero3")),
        "E33": message_of(lambda: resolve("--resume", "--out", os.path.join(tmp, "empty"))),
        "E170": message_of(lambda: resolve("--model", f"hf:{_model_folder(tmp)}", "--lora.rank",
                                         "4", "--parallel.strategy", "no_shard")),
        "E172": message_of(_one_rank_shard_groups_quantized),
        "E228": message_of(lambda: resolve("--parallel.ep", "2")),
        "E229": message_of(lambda: resolve("--preset", "moe", "--parallel.ep", "3")),
        "E230": message_of(lambda: resolve("--preset", "moe", "--parallel.ep", "2",
                                           "--parallel.strategy", "hybrid_shard")),
        "E231": message_of(_expert_degree_not_dividing_the_world),
        "E233": message_of(lambda: resolve("--preset", "moe", "--optim.name", "muon")),
        "E236": message_of(lambda: resolve("--optim.name", "muon", "--parallel.offload",
                                           f"disk:{tmp}")),
        "E367": message_of(lambda: resolve("--parallel.step_in_backward", "true")),
        "E385": message_of(lambda: resolve("--parallel.delayed_update", "0")),
        "E387": message_of(lambda: resolve("--parallel.params_on_device", "true")),
        "E368": message_of(lambda: resolve("--parallel.offload", "cpu",
                                           "--parallel.step_in_backward", "true")),
        "E369": message_of(lambda: resolve("--parallel.offload", "cpu", "--optim.grad_clip",
                                           "0", "--parallel.delayed_update", "2",
                                           "--parallel.step_in_backward", "true")),
    }


def _model_folder(tmp: str) -> str:
    """A folder that passes as a Hugging Face model (its config names a model_type)."""
    folder = os.path.join(tmp, "hf-model")
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        f.write('{"model_type": "llama"}')
    return folder


def _one_rank_shard_groups_quantized():
    from fullshard.train.config.schema import ParallelConfig
    from fullshard.train.model import build_mesh
    build_mesh(ParallelConfig(strategy="hybrid_shard", replicas=2, quantize="weights,grads"),
               "cpu", 2, 2)


def _expert_degree_not_dividing_the_world():
    from fullshard.train.config.schema import ParallelConfig
    from fullshard.train.model import build_mesh
    build_mesh(ParallelConfig(ep=3), "cpu", 4, 4)


def _metrics_and_export_cases(tmp: str) -> dict[str, str]:
    import sys

    from fullshard import checkpoint
    from fullshard.cli.train import build_parser, resolve_config
    from fullshard.train.config.schema import get_preset, to_toml
    from fullshard.train.config.flags import apply_overrides
    from fullshard.cli.ckpt import _export as export_command
    from fullshard.train.export.adapters import export_adapters
    from fullshard.train.export.hf import export_hf, parse_size

    def resolve(*argv):
        resolve_config(build_parser().parse_args(list(argv)))

    def without_tensorboard():
        saved = sys.modules.get("tensorboard")
        sys.modules["tensorboard"] = None  # what import sees when it is not installed
        try:
            resolve("--metrics.tensorboard", "true")
        finally:
            if saved is None:
                del sys.modules["tensorboard"]
            else:
                sys.modules["tensorboard"] = saved

    alone = os.path.join(tmp, "alone", "step_1")
    checkpoint.save(alone, nn.Linear(2, 2))
    run = os.path.join(tmp, "run")
    checkpoint.save(os.path.join(run, "checkpoints", "step_000001"), nn.Linear(2, 2))
    with open(os.path.join(run, "config.toml"), "w") as f:
        f.write(to_toml(get_preset("debug")))
    moe_run = os.path.join(tmp, "moe-run")
    checkpoint.save(os.path.join(moe_run, "checkpoints", "step_000001"), nn.Linear(2, 2))
    with open(os.path.join(moe_run, "config.toml"), "w") as f:
        f.write(to_toml(get_preset("moe")))
    lora_run = os.path.join(tmp, "lora-run")
    checkpoint.save(os.path.join(lora_run, "checkpoints", "step_000001"), nn.Linear(2, 2))
    with open(os.path.join(lora_run, "config.toml"), "w") as f:
        f.write(to_toml(apply_overrides(get_preset("debug"), {
            "model": "hf:base", "lora.rank": 4}, "test")))
    return {
        "E50": message_of(without_tensorboard),
        "E51": message_of(lambda: resolve("--metrics.wandb", "team/project")),
        "E52": message_of(lambda: export_hf(alone, os.path.join(tmp, "hf"), 10**9)),
        "E53": message_of(lambda: parse_size("big")),
        "E54": message_of(lambda: export_hf(run, os.path.join(tmp, "hf"), 10**9)),
        "E232": message_of(lambda: export_hf(moe_run, os.path.join(tmp, "hf"), 10**9)),
        "E112": message_of(lambda: resolve("--lora.rank", "4")),
        "E135": message_of(lambda: resolve("--parallel.strategy", "zero1",
                                         "--parallel.reshard-after-forward", "true")),
        "E139": message_of(lambda: resolve("--parallel.offload", "ssd")),
        "E250": message_of(lambda: resolve("--parallel.offload", "cpu:half")),
        "E251": message_of(lambda: resolve("--parallel.offload", "cpu:1.5")),
        "E252": message_of(lambda: resolve("--parallel.offload", f"disk:{tmp}:1.5")),
        "E143": message_of(lambda: resolve("--parallel.strategy", "no_shard",
                                         "--parallel.quantize", "grads")),
        "E144": message_of(lambda: resolve("--parallel.offload", "cpu",
                                         "--parallel.offload-params", "true")),
        "E140": message_of(lambda: resolve("--parallel.offload",
                                         "disk:" + os.path.join(tmp, "no-states-dir"))),
        "E115": message_of(lambda: export_hf(lora_run, os.path.join(tmp, "hf"), 10**9)),
        "E113": message_of(lambda: export_adapters(run, os.path.join(tmp, "adapters"))),
        "E114": message_of(lambda: export_command(argparse.Namespace(
            dir=run, out=os.path.join(tmp, "adapters"), hf=True, adapters=True,
            max_shard_size=None))),
    }


def _command_line_cases(tmp: str) -> dict[str, str]:
    """Numbers and files of every command, through the real entry point."""
    import contextlib
    import io

    from fullshard.cli import main
    from fullshard.cli.memory import _resolve, estimate_parser
    from fullshard.memory import estimate
    from fullshard.train.config.paths import check_hf_model, check_output_dir, check_text_file

    def stderr_of(*argv):
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.suppress(SystemExit):
            main(list(argv))
        return err.getvalue().strip()

    binary = os.path.join(tmp, "binary.txt")
    with open(binary, "wb") as f:
        f.write(b"text, then \x80")
    a_file = os.path.join(tmp, "a_file")
    open(a_file, "w").close()
    parser = estimate_parser()
    return {
        "E76": stderr_of("estimate", "--world-size", "0"),
        "E241": stderr_of("estimate", "--preset", "moe", "--world-size", "4", "--ep", "3"),
        "E366": stderr_of("estimate", "--world-size", "2", "--offload", "disk",
                          "--delayed-update", "0"),
        "E365": message_of(lambda: estimate("debug", world_size=2, offload="disk+params",
                                            delayed_update=True)),
        "E77": message_of(lambda: check_text_file("data", binary)),
        "E78": message_of(lambda: check_output_dir("--out", a_file)),
        "E79": message_of(lambda: check_hf_model("--hf-config", os.path.join(tmp, "gone"))),
        "E80": message_of(lambda: _resolve(parser.parse_args(
            ["--world-size", "6", "--reshard-after-forward", "4"]))),
        "E81": message_of(lambda: _resolve(parser.parse_args(
            ["--preset", "gpt2-124m", "--world-size", "8", "--seq", "4096"]))),
        "E237": stderr_of("estimate", "--preset", "moe", "--optimizer", "muon", "--world-size",
                          "2"),
        "E238": stderr_of("plan", "--optimizer", "muon", "--world-size", "2", "--budget-gib", "1",
                          "--allow-offload", "--offload-dir", tmp),
        "E165": run_stderr_of("missing.py"),
        "E166": run_stderr_of("-m", "no_such_module"),
    }


def _overlapped_step_cases() -> dict[str, str]:
    from fullshard import OverlappedStep
    params = [nn.Parameter(torch.zeros(3))]
    clipped = OverlappedStep(torch.optim.SGD(params, lr=0.1))
    clipped.optimizer.grad_scale = torch.tensor(0.5)
    nested = OverlappedStep(torch.optim.SGD(params, lr=0.1))
    outer = nested.stepping_in_backward()
    outer.__enter__()
    return {"E290": message_of(lambda: OverlappedStep(torch.optim.LBFGS(params))),
            "E291": message_of(lambda: OverlappedStep(torch.optim.SGD(params, lr=0.1)).step(
                lambda: 0.0)),
            "E293": message_of(lambda: clipped.stepping_in_backward().__enter__()),
            "E294": message_of(lambda: nested.stepping_in_backward().__enter__()),
            "E346": message_of(lambda: OverlappedStep(torch.optim.SGD(params, lr=0.1),
                                                      delayed=True).stepping_in_backward(
                                                      ).__enter__()),
            "E347": message_of(lambda: OverlappedStep(torch.optim.SGD(params, lr=0.1),
                                                      delayed=True, delay_after=-1))}


@pytest.fixture(scope="module")
def produced(tmp_path_factory) -> dict[str, str]:
    tmp = str(tmp_path_factory.mktemp("errors"))
    messages = _no_process_group_case()
    messages.update(_trainer_cases(tmp))
    messages.update(_metrics_and_export_cases(tmp))
    messages.update(_command_line_cases(tmp))
    messages.update(_checksum_cases(tmp))
    messages.update(_load_hf_cases(tmp))
    messages.update(_verification_cases(tmp))
    messages.update(_overlapped_step_cases())
    ranks = run_distributed(_library_cases, 2, tmp)
    messages.update(ranks[0])
    messages["E35"] = ranks[1]["E35"]  # the rank outside the mesh
    return messages


@pytest.mark.slow
def test_every_catalogue_entry_is_produced_by_a_test(produced):
    entries = documented()
    assert set(_TESTED_ELSEWHERE) <= set(entries), set(_TESTED_ELSEWHERE) - set(entries)
    untested = sorted(set(entries) - set(produced) - set(_TESTED_ELSEWHERE))
    assert not untested, f"documented but not produced here: {untested}"
    undocumented = sorted(set(produced) - set(entries))
    assert not undocumented, f"produced but missing from docs/errors.md: {undocumented}"


def test_each_message_is_the_documented_text(produced):
    entries = documented()
    wrong = {code: produced[code] for code in produced
             if code in entries and not _matches(entries[code], produced[code])}
    assert not wrong, "\n\n".join(f"{c}:\n  doc:    {entries[c]}\n  actual: {m}"
                                  for c, m in wrong.items())


def test_a_heading_without_its_text_is_a_retired_number():
    """Each number heads one entry; an entry with no text block is a retired number
    (its error no longer raised, the number never given to another), marked so."""
    from support.catalogue import DOC
    headings = re.findall(r"^### (E\d+) (.*)$", DOC.read_text(), re.M)
    codes = [code for code, _ in headings]
    assert len(codes) == len(set(codes)), sorted(c for c in codes if codes.count(c) > 1)
    bare = [code for code, title in headings
            if code not in documented() and not title.startswith("(retired)")]
    assert not bare, f"entries without their text, not marked (retired): {bare}"


# Entries whose scenario needs its own run; each names the test that checks its text.
_TESTED_ELSEWHERE = {
    # capture_step: its own file runs each case (world size 2 for the sharded models)
    **{code: "tests/captured/test_captured_step.py::"
             "test_what_a_graph_cannot_hold_is_refused_in_one_line_before_any_step_runs"
       for code in ("E373", "E374", "E375", "E376")},
    "E377": "tests/captured/test_captured_step.py::"
            "test_fresh_inputs_are_copied_into_the_captured_tensors_and_other_shapes_refused",
    "E378": "tests/captured/test_captured_step.py::"
            "test_eager_steps_after_the_first_issue_the_same_collectives_and_unsteady_ones_are_refused",
    "E379": "tests/captured/test_captured_step.py::"
            "test_a_python_learning_rate_changed_after_capture_is_refused_a_tensor_one_is_read",
    **{code: "tests/test_delayed_update.py::"
             "test_disk_offload_local_step_off_and_a_foreign_state_are_refused_in_one_line"
       for code in ("E345", "E348", "E349")},
    "E292": "tests/test_overlapped_step.py::"
            "test_an_error_on_the_host_thread_is_raised_at_the_next_forward_naming_the_unit",
    "E171": "tests/train/test_lora.py::"
            "test_a_qlora_run_resumed_from_its_checkpoint_continues_like_a_straight_run",
    "E169": "tests/checkpoint/test_verify.py::"
            "test_inspect_of_a_damaged_checkpoint_says_so_after_its_table",
    "E260": "tests/core/test_guard_structure.py::test_different_models_are_named_on_every_rank",
    "E304": "tests/train/test_loop.py::"
            "test_symmetric_memory_where_it_cannot_work_names_the_flag",
    "E29": "tests/core/test_guard_divergence.py::test_divergence_raises_on_every_rank",
    "E30": "tests/core/test_guard_divergence.py::test_without_debug_a_failed_collective_names_the_unit",
    "E130": "tests/core/test_guard_arrival.py::"
            "test_a_collective_function_called_on_one_rank_fails_on_both_in_seconds",
    "E151": "tests/whole_matrix/test_whole_matrix.py::"
            "test_what_cannot_be_stepped_whole_is_refused_at_the_first_step",
    "E225": "tests/whole_matrix/test_kept.py::"
            "test_states_loaded_on_some_ranks_only_are_refused_on_every_rank",
    "E150": "tests/core/test_guard_arrival.py::"
            "test_a_collective_function_called_on_one_rank_fails_on_both_in_seconds",
    "E133": "tests/cli/test_train.py::test_a_resume_refuses_what_it_would_otherwise_ignore",
    "E245": "tests/cli/test_train_flags.py::"
            "test_resume_without_a_latest_file_names_the_steps_when_none_verifies",
    "E244": "tests/cli/test_cli_errors.py::"
            "test_an_export_to_an_existing_directory_is_one_line_and_leaves_nothing",
    "E134": "tests/cli/test_train.py::test_a_resume_refuses_what_it_would_otherwise_ignore",
    "E132": "tests/cli/test_train.py::test_ctrl_c_saves_a_checkpoint_and_exits_cleanly",
    "E131": "tests/core/test_guard_arrival.py::test_ranks_at_different_collective_functions_both_name_them",
    "E82": "tests/cli/test_cli_errors.py::"
           "test_an_unexpected_error_is_one_line_exit_1_and_its_traceback_on_request",
    "E34": "tests/train/test_launch_reliability.py::"
           "test_a_training_that_stops_being_finite_ends_the_run_without_saving",
    **{code: "tests/test_placement_meshes.py::"
              "test_meshes_that_do_not_fit_are_one_line_naming_the_unit_and_the_meshes"
       for code in ("E210", "E211")},  # world size 4, an (efsdp, ep) mesh
    "E212": "tests/test_placement_meshes.py::"
            "test_a_module_with_parameters_on_two_meshes_is_refused_naming_the_parameter",
    # world size 4, a (dp, tp) mesh
    "E45": "tests/core/test_features_tensor_parallel.py::"
           "test_misuse_names_the_parameter_and_what_to_do",
    "E46": "tests/core/test_features_tensor_parallel.py::"
           "test_misuse_names_the_parameter_and_what_to_do",
    "E47": "tests/core/test_features_tensor_parallel.py::"
           "test_misuse_names_the_parameter_and_what_to_do",
    # torch 2.15 or later only: before it no grad_dtype is followed
    "E362": "tests/core/test_features_grad_dtype.py::"
            "test_grad_dtype_on_a_parameter_gathered_beside_the_flat_buffers_is_refused",
    "E363": "tests/core/test_features_grad_dtype.py::"
            "test_grad_dtype_none_with_unused_params_as_zeros_is_refused_as_torch_refuses_it",
    **{code: "tests/core/test_features_subclass_params.py::"
              "test_misuse_is_one_line_naming_the_parameter_on_every_rank"
       for code in ("E105", "E106", "E107", "E108", "E109", "E110", "E111")},
    # launching: in-process with a patched environment or torchrun, or several launchers
    "E60": "tests/cli/test_launch_flags.py::test_more_ranks_than_gpus_is_refused_before_nccl_sees_them",
    "E61": "tests/train/test_launch_multinode.py::test_a_node_with_another_config_is_named_on_every_node",
    "E62": "tests/cli/test_launch_flags.py::test_nodes_that_do_not_meet_are_one_line_naming_the_flag",
    "E63": "tests/cli/test_launch_flags.py::test_nodes_that_do_not_meet_are_one_line_naming_the_flag",
    "E64": "tests/train/test_launch_multinode.py::"
           "test_an_out_that_only_its_own_node_sees_stops_at_the_first_save",
    "E65": "tests/cli/test_launch_flags.py::test_nodes_that_do_not_meet_are_one_line_naming_the_flag",
    "E66": "tests/cli/test_launch_flags.py::test_nodes_that_do_not_meet_are_one_line_naming_the_flag",
    "E67": "tests/cli/test_launch_flags.py::test_srun_with_several_tasks_per_node_is_refused",
    "E68": "tests/cli/test_launch_flags.py::test_an_incomplete_worker_environment_is_named",
    "E69": "tests/cli/test_launch_flags.py::test_an_incomplete_worker_environment_is_named",
    **{code: "tests/cli/test_project.py::test_bad_input_is_one_line_naming_it"
       for code in ("E125", "E126", "E128", "E129", "E185", "E186", "E187", "E188", "E189",
                    "E213", "E226", "E227", "E242", "E393")},
    "E332": "tests/conformance/test_fsdp2_compile.py::"
            "test_compiled_sharded_models_train_as_eager_ones",  # compiling: extended
    "E127": "tests/projection/test_settings.py::test_library_sizes_must_be_positive",
    **{code: "tests/projection/test_settings.py::"
             "test_an_unknown_kernel_setting_is_refused_by_name"
       for code in ("E355", "E381", "E388")},
    **{code: "tests/projection/test_calibrate.py::"
             "test_what_one_gpu_cannot_calibrate_is_refused_in_one_line"
       for code in ("E389", "E390", "E391", "E392")},
    "E380": "tests/projection/test_published.py::"
            "test_the_compile_and_kernels_columns_are_read_and_a_wrong_value_is_refused_by_row_and_column",
    "E310": "tests/projection/test_validation.py::"
            "test_a_missing_band_is_one_line_saying_how_to_make_it",
    "E234": "tests/checkpoint/test_hf_load_tied_apart.py::"
            "test_load_hf_into_a_tied_model_names_the_stored_head",
    "E235": "tests/checkpoint/test_hf_load_tied_apart.py::"
            "test_a_stored_head_is_used_untied_as_from_pretrained_does",
}


ROOT = Path(__file__).resolve().parents[1]


def _named_test_exists(target: str) -> bool:
    path, _, name = target.partition("::")
    file = ROOT / path
    return file.exists() and re.search(rf"^\s*def {re.escape(name.split('[')[0])}\b",
                                       file.read_text(), re.M) is not None


def test_every_entry_tested_elsewhere_is_compared_with_its_documented_text():
    """A test named for an entry compares the raised message with docs/errors.md's text
    (``matches_documented`` with the code, in the named test's file), not a few words of
    it: a changed message then fails a test, as here."""
    loose = [f"{code}: {target}" for code, target in _TESTED_ELSEWHERE.items()
             if not _compares(code, ROOT / target.partition("::")[0])]
    assert not loose, loose


def _compares(code: str, test_file: Path) -> bool:
    text = test_file.read_text()
    return "matches_documented(" in text and re.search(rf"[\"']{code}\b", text) is not None


def test_every_test_named_for_an_entry_exists():
    """The tests named as checking an entry elsewhere, here and in docs/errors.md, are
    real test functions in the named files (a moved test left stale names behind)."""
    stale = [f"{code}: {target}" for code, target in _TESTED_ELSEWHERE.items()
             if not _named_test_exists(target)]
    named = re.findall(r"`(tests/[\w/]+\.py::\w+)", (ROOT / "docs" / "errors.md").read_text())
    stale += [target for target in named if not _named_test_exists(target)]
    assert not stale, stale
