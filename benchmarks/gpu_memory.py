"""The memory estimate against the measured CUDA peak, under a 24 GiB cap, at world size 1.

    python benchmarks/gpu_memory.py                     # plain, qlora, float8 on one GPU
    python benchmarks/gpu_memory.py --cases qlora --json out.json
    python benchmarks/gpu_memory.py --dry-run           # the same code on CPU, tiny shapes

Each case runs in a process of its own (a clean peak): the process caps its GPU memory
at 24 GiB (``torch.cuda.set_per_process_memory_fraction``: the 24 GB cards QLoRA users
plan for), builds the model, shards it (``fully_shard`` per block, then the root), trains
two AdamW steps under ``fullshard.memory.MemoryTracker`` and compares the second step's
peak (``max_memory_allocated``) with ``fullshard.memory.estimate`` of the same run:

  plain   the gpt2-124m shape (fullshard.gpt), bf16 compute, fp32 reduce, batch 8 x 1024
  qlora   a Llama (hidden 1024, 12 layers, vocab 32000) with rank-8 peft adapters over an
          NF4 base (the trainer's ``add_lora``), bf16 compute, batch 4 x 1024
  float8  the gpt2-124m shape with torchao's Float8Linear in the blocks
          (``enable_fsdp_float8_all_gather``), bf16 compute, batch 8 x 1024

The check passes within 10% (docs/memory.md). qlora and float8 need torchao (and peft);
without them the case is skipped with one line saying so. The sizes are chosen to build
and run in seconds inside a short GPU window; they are not the largest models that fit.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import torch
import torch.distributed as dist

GIB = 2 ** 30
CAP_BYTES = 24 * GIB
TOLERANCE = 0.10
CASES = ("plain", "qlora", "float8")
LLAMA = {"model_type": "llama", "hidden_size": 1024, "intermediate_size": 2816,
         "num_hidden_layers": 12, "num_attention_heads": 16, "num_key_value_heads": 8,
         "vocab_size": 32000, "max_position_embeddings": 1024, "rms_norm_eps": 1e-5,
         "tie_word_embeddings": False}
TINY_LLAMA = {**LLAMA, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 256}


def _shapes(case: str, dry_run: bool) -> tuple[object, int, int]:
    """(model description, batch, sequence length) of ``case``."""
    from fullshard.gpt import PRESET_SHAPES, GPTConfig
    if case == "qlora":
        return (TINY_LLAMA, 2, 32) if dry_run else (LLAMA, 4, 1024)
    if dry_run:
        return GPTConfig(vocab_size=256, seq_len=32, d_model=64, n_layers=2, n_heads=2), 2, 32
    return PRESET_SHAPES["gpt2-124m"], 8, 1024


def _missing_packages(case: str) -> str | None:
    import importlib.util
    needed = {"plain": [], "qlora": ["torchao", "peft", "transformers"],
              "float8": ["torchao"]}[case]
    missing = [name for name in needed if importlib.util.find_spec(name) is None]
    return ", ".join(missing) or None


def _build(case: str, shape, device: torch.device):
    """The sharded model and its loss function."""
    from fullshard import MixedPrecisionPolicy, fully_shard
    from fullshard.gpt import GPT, lm_loss
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if case == "qlora":
        import transformers

        from fullshard.train.config.schema import LoraConfig
        from fullshard.train.lora import add_lora
        fields = dict(shape)
        config = transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
        model = add_lora(model, LoraConfig(rank=8, base="nf4"), 1).to(device)
        blocks = model.base_model.model.model.layers
        loss_of = lambda x, y: model(input_ids=x, labels=x, use_cache=False).loss  # noqa: E731
    else:
        model = GPT(shape).to(device)
        if case == "float8":
            from torchao.float8 import Float8LinearConfig, convert_to_float8_training
            convert_to_float8_training(
                model, config=Float8LinearConfig(enable_fsdp_float8_all_gather=True),
                module_filter_fn=lambda module, fqn: fqn.startswith("layers."))
        blocks = model.layers
        loss_of = lambda x, y: lm_loss(model(x).float(), y)  # noqa: E731
    for block in blocks:
        fully_shard(block, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    return model, loss_of


def measure(case: str, dry_run: bool) -> dict:
    """One case in this process: the measured peak beside the estimate."""
    from fullshard.memory import MemoryTracker, estimate
    from fullshard.testing.memory import tracked_steps
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, CAP_BYTES / total), device)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    from fullshard.testing import free_port
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
    try:
        shape, batch, seq = _shapes(case, dry_run)
        tracker = MemoryTracker(device, warm_up=True)
        torch.manual_seed(0)
        model, loss_of = _build(case, shape, device)
        vocab = shape["vocab_size"] if isinstance(shape, dict) else shape.vocab_size
        gen = torch.Generator().manual_seed(0)
        tokens = [torch.randint(0, vocab, (batch, seq + 1), generator=gen).to(device)
                  for _ in range(2)]
        report = tracked_steps(model, tracker, ((t[:, :-1], t[:, 1:]) for t in tokens),
                               loss_of)
        kind = {"plain": {}, "qlora": {"quantize": "nf4", "lora_rank": 8},
                "float8": {"quantize": "float8"}}[case]
        est = estimate(shape, world_size=1, batch_size=batch, seq_len=seq,
                       mp_policy=torch.bfloat16, device=device.type,
                       process_baseline=report["baseline_bytes"], **kind)
        measured = report["peak_bytes"]
        return {"case": case, "device": _device_name(device), "torch": torch.__version__,
                "params": est.num_params, "batch": batch, "seq": seq,
                "measured_bytes": measured, "estimated_bytes": est.total,
                "error": (est.total - measured) / measured,
                "peak_phase": report["peak_phase"],
                "peak_reserved_bytes": report.get("peak_reserved_bytes"),
                "cap_bytes": CAP_BYTES if device.type == "cuda" else None}
    finally:
        dist.destroy_process_group()


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def line(r: dict, dry_run: bool = False) -> str:
    mib = 2 ** 20
    verdict = ("not checked (dry run)" if dry_run else "ok" if abs(r["error"]) <= TOLERANCE
               else f"OFF BY MORE THAN {TOLERANCE:.0%}")
    return (f"{r['case']}: {r['params'] / 1e6:.0f}M parameters, batch {r['batch']} x {r['seq']} "
            f"on {r['device']}: measured {r['measured_bytes'] / mib:,.0f} MiB, estimated "
            f"{r['estimated_bytes'] / mib:,.0f} MiB ({r['error']:+.1%}, peak in "
            f"{r['peak_phase']}): {verdict}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes (CPU is fine)")
    parser.add_argument("--json", metavar="FILE", help="also write the results here")
    parser.add_argument("--case", help=argparse.SUPPRESS)  # one case, in this process
    args = parser.parse_args()
    if args.case:
        print("RESULT " + json.dumps(measure(args.case, args.dry_run)), flush=True)
        return 0
    results, failed = [], False
    for case in args.cases.split(","):
        missing = _missing_packages(case)
        if missing:
            print(f"{case}: skipped, {missing} not installed here")
            continue
        cmd = [sys.executable, os.path.abspath(__file__), "--case", case] + (
            ["--dry-run"] if args.dry_run else [])
        proc = subprocess.run(cmd, capture_output=True, text=True)
        found = [json.loads(x[len("RESULT "):]) for x in proc.stdout.splitlines()
                 if x.startswith("RESULT ")]
        if proc.returncode != 0 or not found:
            tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-12:])
            print(f"{case}: failed (exit {proc.returncode}):\n{tail}")
            failed = True
            continue
        results.append(found[0])
        print(line(found[0], args.dry_run), flush=True)
        failed |= abs(found[0]["error"]) > TOLERANCE and not args.dry_run
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
