"""Quantized weights as tensor-subclass parameters: an int8-rows subclass that defines
torch's FSDP2 hooks (``fsdp_pre_all_gather`` / ``fsdp_post_all_gather``) and counts their
calls, and a QLoRA linear over an int8, NF4 (torchao) or plain base weight."""

from __future__ import annotations

import math
from collections import Counter

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._pytree import tree_map

D, RANK = 32, 4  # the test models' width and the adapters' rank
HOOK_CALLS: Counter = Counter()  # per process: what the Int8Rows hooks saw


class Int8Rows(torch.Tensor):
    """int8 rows and one fp32 scale per row: two all-gather inputs of different dtypes.
    Anything but the ops sharding needs computes on the dequantized values."""

    @staticmethod
    def __new__(cls, qdata, scale, shape=None):
        return torch.Tensor._make_wrapper_subclass(cls, shape or qdata.shape,
                                                   dtype=torch.float32, device=qdata.device,
                                                   requires_grad=False)

    def __init__(self, qdata, scale, shape=None):
        self.qdata, self.scale = qdata, scale

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def quantize(cls, w: torch.Tensor) -> "Int8Rows":
        scale = w.abs().amax(dim=1).clamp(min=1e-8) / 127
        return cls(torch.round(w / scale[:, None]).to(torch.int8), scale)

    def dequantize(self) -> torch.Tensor:
        return self.qdata.float() * self.scale[:, None]

    def __tensor_flatten__(self):
        return ["qdata", "scale"], None

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return Int8Rows(inner["qdata"], inner["scale"])

    def __repr__(self):
        return f"Int8Rows({tuple(self.shape)})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        aten = torch.ops.aten
        x = args[0]
        if func in (aten.detach.default, aten.alias.default, aten.clone.default):
            return type(x)(func(x.qdata), func(x.scale))
        if func is aten.split.Tensor:
            return [type(x)(q, s) for q, s in zip(x.qdata.split(args[1]), x.scale.split(args[1]))]
        if func is aten.new_zeros.default:
            return type(x)(x.qdata.new_zeros(args[1]), x.scale.new_zeros(args[1][0]))
        if func is aten.slice.Tensor and args[1] == 0:
            start, end = args[2], min(args[3], x.shape[0])
            return type(x)(x.qdata[start:end], x.scale[start:end])
        if func is aten.as_strided.default and tuple(args[1][1:]) == tuple(x.shape[1:]):
            return type(x)(x.qdata[:args[1][0]], x.scale[:args[1][0]])
        if func is aten.view.default and list(args[1]) == [-1]:  # torch FSDP2 flattens it
            return type(x)(x.qdata, x.scale, shape=(x.numel(),))
        if func is aten.copy_.default and isinstance(args[1], Int8Rows):
            x.qdata.copy_(args[1].qdata)
            x.scale.copy_(args[1].scale)
            return x
        if func is aten.copy_.default:  # a plain source: quantize it
            return x.copy_(Int8Rows.quantize(args[1]))
        plain = tree_map(lambda t: t.dequantize() if isinstance(t, Int8Rows) else t,
                         (args, kwargs))
        return func(*plain[0], **plain[1])

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        HOOK_CALLS["pre"] += 1
        HOOK_CALLS["module:" + type(module).__name__] += 1
        return (self.qdata, self.scale), (tuple(outer_size),)

    def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):
        qdata, scale = outputs
        if out is not None:  # the later gathers land in the same storage
            assert out.qdata.untyped_storage().data_ptr() == qdata.untyped_storage().data_ptr()
            assert out.scale.untyped_storage().data_ptr() == scale.untyped_storage().data_ptr()
            HOOK_CALLS["post_out"] += 1
            return None
        HOOK_CALLS["post"] += 1
        return Int8Rows(qdata, scale), (qdata, scale)


def _quantize(kind: str, w: torch.Tensor) -> torch.Tensor:
    if kind == "int8":
        return Int8Rows.quantize(w)
    if kind == "nf4":
        from torchao.quantization import to_nf4
        return to_nf4(w, 32, 16)
    return w  # "plain": the same shapes in fp32


class QLoRALinear(nn.Module):
    """A frozen quantized base weight and trainable low-rank adapters A, B."""

    def __init__(self, kind: str, d_in: int, d_out: int):
        super().__init__()
        base = torch.randn(d_out, d_in) / math.sqrt(d_in)
        self.weight = nn.Parameter(_quantize(kind, base), requires_grad=False)
        self.lora_a = nn.Parameter(torch.randn(RANK, d_in) / math.sqrt(d_in))
        self.lora_b = nn.Parameter(torch.randn(d_out, RANK) * 0.1)
        self.kind = kind

    def forward(self, x):
        if self.kind == "nf4":
            from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import linear_nf4
            base = linear_nf4(x, self.weight)
        else:
            base = F.linear(x, self.weight)
        return base + F.linear(F.linear(x, self.lora_a), self.lora_b)
