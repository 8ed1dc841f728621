"""Feature combinations of ``fullshard train``, run as a new user would (docs/reliability.md).

    OMP_NUM_THREADS=1 python tests/train/red_team.py            # every combination (~6 minutes)
    OMP_NUM_THREADS=1 python tests/train/red_team.py 03 25      # some, by number

Not collected by pytest (a survey, not a check: its outcomes are recorded in
docs/reliability.md). Each combination of strategy x offload x precision x quantized
communication x accumulation (x LoRA) trains the debug preset (or a tiny Llama) 4 steps
on 2 ranks with checkpoints at steps 2 and 4, after the command line's checks
(``validate``), then resumes at another world size to step 6. It prints, per
combination, what each phase ended with (``ok``, or the exception's type and first
line, how many lines it had and where it was raised), the step losses, and what was left
in the offload directory.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
import traceback

import torch
import torch.distributed as dist

from fullshard.testing import run_distributed
from fullshard.train.config.schema import get_preset, validate
from fullshard.train.config.flags import apply_overrides
from fullshard.train.launch.launcher import Worker
from fullshard.train.loop import Trainer

FS, SGO, Z1, NS, HY = "full_shard", "shard_grad_op", "zero1", "no_shard", "hybrid_shard"
WG = "weights,grads"

# number: (strategy, offload, precision, quantize, accumulation, resume world size, extra)
COMBINATIONS = {
    "01": (FS, "none", "fp32", "none", 1, 3, {}),
    "02": (FS, "cpu", "bf16", WG, 2, 1, {}),
    "03": (FS, "disk", "fp32", WG, 2, 3, {}),
    "04": (FS, "disk+params", "bf16", "none", 1, 1, {}),
    "05": (SGO, "none", "bf16", WG, 1, 1, {}),
    "06": (SGO, "cpu", "fp32", "none", 2, 3, {}),
    "07": (SGO, "disk", "bf16", "none", 2, 1, {}),
    "08": (SGO, "disk+params", "fp32", WG, 1, 3, {}),
    "09": (Z1, "none", "fp32", WG, 2, 1, {}),
    "10": (Z1, "cpu", "bf16", "none", 1, 3, {}),
    "11": (Z1, "disk", "fp32", "none", 1, 1, {}),
    "12": (Z1, "disk+params", "bf16", WG, 2, 3, {}),
    "13": (NS, "none", "bf16", "none", 2, 3, {}),
    "14": (NS, "cpu", "fp32", "none", 1, 1, {}),
    "15": (NS, "disk", "bf16", "none", 1, 3, {}),
    "16": (NS, "disk+params", "fp32", "none", 2, 1, {}),
    "17": (HY, "none", "fp32", WG, 1, 1, {"parallel.replicas": 2}),
    "18": (HY, "cpu", "bf16", "none", 2, 3, {"parallel.replicas": 2}),
    "19": (HY, "disk", "fp32", "none", 2, 1, {"parallel.replicas": 2}),
    "20": (HY, "disk+params", "bf16", WG, 1, 3, {"parallel.replicas": 1}),
    "21": (FS, "none", "fp16", "none", 2, 3, {}),
    "22": (FS, "disk", "fp16", WG, 1, 1, {}),
    "23": (FS, "cpu", "fp32", "none", 1, 3, {"parallel.reshard_after_forward": 1}),
    "24": (FS, "disk", "fp32", "none", 2, 1, {"parallel.activation_checkpointing": True}),
    # a tiny Llama (Hugging Face), LoRA adapters over NF4 or fp32 bases, or every weight
    "25": (FS, "cpu", "bf16", "none", 2, 1, {"lora.rank": 4}),
    "26": (FS, "disk", "fp32", WG, 1, 3, {"lora.rank": 4, "lora.base": "fp32"}),
    "27": (SGO, "disk+params", "fp32", "none", 2, 3, {"lora.rank": 4}),
    "28": (Z1, "none", "bf16", WG, 1, 1, {"lora.rank": 4}),
    "29": (NS, "none", "fp32", "none", 1, 1, {"lora.rank": 4}),
    "30": (FS, "disk+params", "fp16", WG, 2, 3, {"model": "hf"}),
}


def _phase(out: str, fields: dict, resume: bool) -> str:
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        cfg = validate(apply_overrides(get_preset("debug"), fields, "red team"))
        Trainer(cfg, out, Worker(rank, world, rank, world, torch.device("cpu"))).run(resume)
        return "ok"
    except Exception as err:  # noqa: BLE001 - the survey records whatever happens
        lines = str(err).strip().splitlines()
        where = traceback.extract_tb(err.__traceback__)[-1]
        place = where.filename.split("site-packages/")[-1].split("src/")[-1]
        return (f"{type(err).__name__}: {lines[0] if lines else ''} "
                f"[{len(lines)} line(s), raised in {place}:{where.lineno}]")


def _fields(number: str, root: str, llama: str, data: str) -> tuple[dict, int]:
    strategy, offload, precision, quantize, accum, resume_ws, extra = COMBINATIONS[number]
    fields = {"steps": 4, "checkpoint.every": 2, "eval.every": 0, "eval.sample_tokens": 0,
              "parallel.strategy": strategy, "parallel.precision": precision,
              "parallel.quantize": quantize, "batch.grad_accum": accum, **extra}
    if offload.startswith("disk"):
        fields["parallel.offload"] = f"disk:{os.path.join(root, number + '-offload')}"
        fields["parallel.offload_params"] = offload == "disk+params"
    elif offload == "cpu":
        fields["parallel.offload"] = "cpu"
    if "lora.rank" in fields or fields.get("model") == "hf":
        fields.update({"model": f"hf:{llama}", "data": data, "batch.seq_len": 16})
    return fields, resume_ws


def _losses(out: str) -> list[float]:
    try:
        with open(os.path.join(out, "metrics.jsonl")) as f:
            return [round(r["loss"], 6) for r in map(json.loads, f) if "loss" in r]
    except OSError:
        return []


def run(number: str, root: str, llama: str, data: str) -> dict:
    fields, resume_ws = _fields(number, root, llama, data)
    offload = os.path.join(root, number + "-offload")
    os.makedirs(offload)
    out = os.path.join(root, number)
    began = time.time()
    result = {"train@2": sorted(set(run_distributed(_phase, 2, out, fields, False,
                                                     timeout=300)))}
    if result["train@2"] == ["ok"]:
        resumed = run_distributed(_phase, resume_ws, out, dict(fields, steps=6), True,
                                  timeout=300)
        result[f"resume@{resume_ws}"] = sorted(set(resumed))
    result["losses"] = _losses(out)
    result["left in offload dir"] = os.listdir(offload)
    result["seconds"] = round(time.time() - began, 1)
    return result


def _tiny_llama(root: str) -> tuple[str, str]:
    import transformers

    from fullshard.train.data import load_text

    folder, data = os.path.join(root, "llama"), os.path.join(root, "data.jsonl")
    config = transformers.LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    with open(data, "w") as f:
        for paragraph in load_text()[:30_000].split("\n\n"):
            f.write(json.dumps({"text": paragraph}) + "\n")
    return folder, data


def main(numbers: list[str]) -> None:
    root = tempfile.mkdtemp(prefix="fullshard-red-team-")
    llama, data = _tiny_llama(root)
    for number in numbers or list(COMBINATIONS):
        print(number, COMBINATIONS[number][:6], json.dumps(run(number, root, llama, data)),
              flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
