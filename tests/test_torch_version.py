"""Every private torch name fullshard uses (Note [torch versions] lists them and why) is
still there, and behaves as fullshard relies on, in the installed torch. A torch release
that changes one fails here first, naming the torch version and the name."""

from __future__ import annotations

import importlib

import pytest
import torch

from fullshard.torch_version import FOLLOWS_PARAM_GRAD_DTYPE

VERSION = torch.__version__


def _changed(name: str, what: str) -> str:
    return (f"torch {VERSION} changed {name}: {what}; fullshard relies on it (Note [torch "
            "versions] in src/fullshard/torch_version.py says where and why)")


@pytest.mark.parametrize("module,name", [
    ("torch.distributed.tensor._dtensor_spec", "DTensorSpec"),
    ("torch.distributed.tensor._dtensor_spec", "TensorMeta"),
    ("torch.utils._pytree", "tree_flatten"),
    ("torch.utils._pytree", "tree_unflatten"),
    ("torch.utils._pytree", "tree_map"),
    ("torch.utils._python_dispatch", "TorchDispatchMode"),
    ("torch.distributed.checkpoint._nested_dict", "flatten_state_dict"),
    ("torch.autograd.profiler", "_is_profiler_enabled"),
    ("torch", "_chunk_cat"),
    ("torch.distributed._composable.contract", "_get_registry"),
    ("torch.distributed.fsdp._fully_shard._fsdp_init", "_get_managed_modules"),
])
def test_private_names_exist(module, name):
    assert hasattr(importlib.import_module(module), name), _changed(
        f"{module}.{name}", "it is gone")


def test_a_dtensor_built_from_a_spec_views_its_local_tensor_and_can_be_repointed():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        local = torch.arange(6.0).view(3, 2)
        spec = DTensorSpec(mesh, (Shard(0),), tensor_meta=TensorMeta(local.shape,
                                                                    local.stride(), local.dtype))
        d = DTensor(local, spec, requires_grad=False)
        assert d._local_tensor is local, _changed("DTensor(local, spec)", "copies its local tensor")
        assert d._spec is spec, _changed("DTensor._spec", "no longer the spec given")
        other = torch.zeros(3, 2)
        d._local_tensor = other
        assert d.to_local() is other or torch.equal(d.to_local(), other), _changed(
            "DTensor._local_tensor", "assigning it no longer re-points the DTensor")
    finally:
        dist.destroy_process_group()


def test_chunk_cat_lays_out_rank_major_and_casts_into_out():
    grads = [torch.arange(4.0).view(2, 2), torch.arange(6.0).view(3, 2)]
    out = torch.empty(2, 5, dtype=torch.float64)
    torch._chunk_cat(grads, dim=0, num_chunks=2, out=out)
    # rank 0 gets row 0 of the first and rows 0-1 of the second (ceil(3/2) padded)
    assert out.dtype == torch.float64, _changed("torch._chunk_cat(out=)", "no longer casts")
    assert out[0].tolist()[:2] == [0.0, 1.0], _changed("torch._chunk_cat", "another layout")


def test_the_autograd_engine_takes_end_of_backward_callbacks():
    from torch.autograd import Variable

    called = []
    x = torch.ones(2, requires_grad=True)
    y = x * 2
    y.register_hook(lambda g: Variable._execution_engine.queue_callback(
        lambda: called.append(True)) or g)
    y.sum().backward()
    assert called == [True], _changed("Variable._execution_engine.queue_callback",
                                      "the callback did not run at the end of backward")


def test_the_cpu_flash_attention_op_the_estimator_traces_exists():
    assert hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu"), _changed(
        "aten._scaled_dot_product_flash_attention_for_cpu", "it is gone")


@pytest.mark.skipif(not FOLLOWS_PARAM_GRAD_DTYPE, reason="grad_dtype is followed from 2.15")
def test_a_tensor_says_whether_its_grad_dtype_was_set():
    name = "Tensor._has_grad_dtype_override"
    p = torch.nn.Parameter(torch.zeros(2, dtype=torch.bfloat16))
    assert p._has_grad_dtype_override is False, _changed(name, "set on a fresh parameter")
    p.grad_dtype = None
    assert p._has_grad_dtype_override is True, _changed(name, "unset after grad_dtype=None")
    q = torch.nn.Parameter(torch.zeros(2))
    q.grad_dtype = torch.float32  # equal to its dtype, still explicit
    assert q._has_grad_dtype_override is True, _changed(name, "unset after an explicit dtype")
