"""Peak memory per rank (W3): fullshard vs FSDP2, and the memory floor.

Peak RSS is per process, so each implementation runs in its own set of ranks
(memory is deterministic enough that interleaving is not needed). The model is
built on the meta device, sharded, then materialized with ``to_empty`` so no rank
ever holds the whole model.

floor = 16 bytes x params / world  (fp32 param + grad + 2 AdamW states, sharded)
      + largest unit unsharded (params + grads)
      + activations (bytes autograd saves for backward, measured on the meta device)
      + process baseline (RSS after imports and process-group init, before the model)
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from fullshard.gpt import GPT, GPTConfig, lm_loss


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not found in /proc/self/status")


def peak_rss_bytes() -> int:
    return _status_bytes("VmHWM")


def current_rss_bytes() -> int:
    return _status_bytes("VmRSS")


def activation_bytes(cfg: GPTConfig, batch: int, seq: int) -> int:
    """Bytes of non-parameter tensors autograd saves in one forward (meta device)."""
    with torch.device("meta"):
        model = GPT(cfg)
    params = {p.untyped_storage()._cdata for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor):
        key = t.untyped_storage()._cdata
        if key not in params:
            seen[key] = t.untyped_storage().nbytes()
        return t

    x = torch.zeros(batch, seq, dtype=torch.long, device="meta")
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        lm_loss(model(x), x)
    return sum(seen.values())


def memory_floor(cfg: GPTConfig, world: int, batch: int, seq: int, baseline: int) -> dict:
    with torch.device("meta"):
        model = GPT(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    layer = sum(p.numel() for p in model.layers[0].parameters())
    root = n_params - cfg.n_layers * layer
    parts = {
        "sharded states (16 B/param / world)": 16 * n_params // world,
        "largest unit unsharded (params + grads)": 8 * max(layer, root),
        "activations": activation_bytes(cfg, batch, seq),
        "process baseline": baseline,
    }
    parts["floor"] = sum(parts.values())
    return parts


def memory_worker(impl: str, cfg: GPTConfig, batch: int, seq: int, steps: int,
                  malloc_tuning: bool = False) -> dict:
    if malloc_tuning:
        from fullshard.memory import tune_cpu_allocator
        tune_cpu_allocator()  # opt-in, process-wide: Note [glibc's mmap threshold on CPU]
    baseline = current_rss_bytes()
    with torch.device("meta"):
        model = GPT(cfg)
    if impl == "fullshard":
        from fullshard import fully_shard
    else:
        from torch.distributed.fsdp import fully_shard
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    model.to_empty(device="cpu")
    model.init_weights()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(steps):
        x = torch.randint(0, cfg.vocab_size, (batch, seq), generator=gen)
        lm_loss(model(x), torch.roll(x, -1, 1)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {"peak": peak_rss_bytes(), "baseline": baseline}


def memory_report(cfg: GPTConfig, world: int, batch: int, seq: int, steps: int) -> str:
    """Run W3 for fullshard and FSDP2, each with glibc's default allocator and with the
    opt-in ``fullshard.memory.tune_cpu_allocator()``."""
    from fullshard.testing import run_distributed

    runs = {
        "fullshard": ("fullshard", False),
        "fsdp2": ("fsdp2", False),
        "fullshard + tune_cpu_allocator()": ("fullshard", True),
        "fsdp2 + tune_cpu_allocator()": ("fsdp2", True),
    }
    peaks, baseline = {}, 0
    for label, (impl, tuning) in runs.items():
        res = run_distributed(memory_worker, world, impl, cfg, batch, seq, steps, tuning,
                              timeout=3600)
        peaks[label] = max(r["peak"] for r in res)
        baseline = max(baseline, max(r["baseline"] for r in res))
    floor = memory_floor(cfg, world, batch, seq, baseline)
    mib = 2 ** 20
    lines = [f"### W3 memory: GPT d={cfg.d_model} L={cfg.n_layers} vocab={cfg.vocab_size}, "
             f"batch {batch}x{seq}/rank, world {world}, meta init, AdamW, {steps} steps", "",
             "| run | peak RSS per rank (MiB) | fullshard / run | run / floor |",
             "|---|---:|---:|---:|"]
    for label, peak in peaks.items():
        lines.append(f"| {label} | {peak / mib:.0f} | {peaks['fullshard'] / peak:.2f} | "
                     f"{peak / floor['floor']:.2f} |")
    lines += ["", "| floor component | MiB |", "|---|---:|"]
    lines += [f"| {k} | {v / mib:.0f} |" for k, v in floor.items()]
    return "\n".join(lines)
