"""Muon on sharded parameters: the optimizer step's time beside AdamW's, and the bytes it moves.

    OMP_NUM_THREADS=1 python benchmarks/whole_matrix.py --world-size 2
    OMP_NUM_THREADS=1 python benchmarks/whole_matrix.py --world-size 4 --steps 6

Two copies of the W1 GPT (d=512, 8 layers, vocab 8192, batch 8 x 128 per rank; or a
smaller one: --d-model, --layers) train side by side, steps interleaved: one with AdamW on
every parameter, one with torch.optim.Muon on the hidden matrices and AdamW on the rest
(the embeddings, norms and biases), as the Muon recipe does; fullshard steps each Muon
matrix whole on one rank (Note [whole-matrix optimizers]). Reported: the median
``optimizer.step()`` time of each and their difference, split into the whole-matrix
exchange (fullshard's agreement, each round's all-to-all to the owners and the assembling
of whole gradients; each round's all-to-all back, the last of which waits for the slowest
owner) and the rest (the stock step: Newton-Schulz in bf16, which a CPU computes slowly
whatever the sharding); the bytes the
whole-matrix step sends per step (every rank's all-to-alls and agreements, summed; the
first step apart, which also brings every parameter to its owner) against the least a
whole-matrix step can move (each matrix's gradient to one rank and its update back:
2 x (N-1)/N of the matrices); and rank 0's peak RSS (with --step-peak, also the peak
above its start within ``step()``, each freed tensor's memory returned at once).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

from fullshard import fully_shard
from fullshard.gpt import GPT, GPTConfig, lm_loss
from fullshard.testing import run_distributed

W1 = GPTConfig(vocab_size=8192, seq_len=128, d_model=512, n_layers=8, n_heads=8)


def _hidden_matrices(model) -> tuple[list, list]:
    embeddings = {id(model.tok_emb.weight), id(model.pos_emb.weight)}
    matrices = [p for p in model.parameters() if p.ndim == 2 and id(p) not in embeddings]
    rest = [p for p in model.parameters() if id(p) not in {id(m) for m in matrices}]
    return matrices, rest


def _build(kind: str, config: GPTConfig):
    torch.manual_seed(0)
    model = GPT(config)
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    if kind == "adamw":
        return model, [torch.optim.AdamW(model.parameters(), lr=1e-4)]
    matrices, rest = _hidden_matrices(model)
    return model, [torch.optim.Muon(matrices, lr=1e-4, adjust_lr_fn="match_rms_adamw"),
                   torch.optim.AdamW(rest, lr=1e-4)]


def _worker(steps: int, warmup: int, config: GPTConfig) -> dict:
    from fullshard.whole_matrix import rounds
    rank, world = dist.get_rank(), dist.get_world_size()
    # fullshard's part of the step, on this rank: "before", bringing the gradients to the
    # owners (the agreement, each round's gather, waiting for it and assembling the whole
    # gradients); "after", sending the updated rows back (each round's return, waiting
    # for it, which for the last round includes waiting for the slowest owner, and the
    # copy into the shards). The rest of step() is this rank's stock step.
    exchange = {"before": 0.0, "after": 0.0}
    phase = {"now": "other"}  # which part of the step the counted bytes belong to
    timed_parts = [(rounds, "plan_rounds", "before"), (rounds.Round, "start_gather", "before"),
                   (rounds.Round, "assemble", "before"), (rounds.Round, "start_return", "after"),
                   (rounds.Round, "finish_return", "after")]
    for owner, attr, name in timed_parts:
        real_fn = getattr(owner, attr)

        def timed(*a, _real=real_fn, _name=name, **k):
            start = time.perf_counter()
            phase["now"] = _name
            try:
                return _real(*a, **k)
            finally:
                phase["now"] = "other"
                exchange[_name] += time.perf_counter() - start
        setattr(owner, attr, timed)
    runs = {kind: _build(kind, config) for kind in ("adamw", "muon")}
    sent = {"before": 0, "after": 0, "other": 0}
    real = dist.all_to_all_single
    real_reduce = dist.all_reduce

    def counted(output, input, output_split_sizes=None, input_split_sizes=None, group=None,
                **kwargs):
        # what leaves this rank: its chunk for itself is a local copy
        me, n = dist.get_rank(group), dist.get_world_size(group)
        own = input_split_sizes[me] if input_split_sizes else input.numel() // n
        sent[phase["now"]] += (input.numel() - own) * input.element_size()
        return real(output, input, output_split_sizes, input_split_sizes, group=group, **kwargs)

    def counted_reduce(tensor, *args, **kwargs):
        # the whole-matrix step's small agreements (which parameters changed); the
        # benchmark's own timing reductions run outside before/after and are not counted
        if phase["now"] != "other":
            group = kwargs.get("group")
            n = dist.get_world_size(group)
            sent[phase["now"]] += 2 * (n - 1) * tensor.numel() * tensor.element_size() // n
        return real_reduce(tensor, *args, **kwargs)

    dist.all_to_all_single = counted
    dist.all_reduce = counted_reduce
    times: dict[str, list[float]] = {kind: [] for kind in runs}
    step_peaks: dict[str, list[int]] = {kind: [] for kind in runs}
    sent_per_step, exchange_per_step = [], []
    gen = torch.Generator().manual_seed(rank)
    for step in range(warmup + steps):
        x = torch.randint(0, config.vocab_size, (8, config.seq_len), generator=gen)
        for kind, (model, opts) in runs.items():
            lm_loss(model(x), torch.roll(x, -1, 1)).backward()
            dist.barrier()
            before, exchanged = dict(sent), dict(exchange)
            rss_start = _reset_peak_rss()
            start = time.perf_counter()
            for opt in opts:
                opt.step()
            elapsed = torch.tensor(time.perf_counter() - start, dtype=torch.float64)
            if step >= warmup:
                step_peaks[kind].append(_kib("VmHWM") - rss_start)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            for opt in opts:
                opt.zero_grad(set_to_none=True)
            if kind == "muon":  # every step's bytes: the first one differs
                sent_per_step.append({k: sent[k] - before[k] for k in sent})
            if step >= warmup:
                times[kind].append(elapsed.item())
                if kind == "muon":
                    exchange_per_step.append({k: exchange[k] - exchanged[k] for k in exchange})
    dist.all_to_all_single, dist.all_reduce = real, real_reduce
    matrices, _ = _hidden_matrices(runs["muon"][0])
    matrix_bytes = sum(p.numel() * p.element_size() for p in matrices)
    total_sent = torch.tensor([statistics.median(s[k] for s in sent_per_step[warmup:])
                               for k in ("before", "after")], dtype=torch.float64)
    dist.all_reduce(total_sent)
    first = torch.tensor([sent_per_step[0][k] for k in ("before", "after")], dtype=torch.float64)
    dist.all_reduce(first)
    import resource
    return {"median_s": {k: statistics.median(v) for k, v in times.items()},
            "exchange_s": {k: statistics.median(e[k] for e in exchange_per_step)
                           for k in ("before", "after")},
            "sent_bytes": dict(zip(("before", "after"), total_sent.tolist())),
            "first_step_bytes": sum(first.tolist()), "matrix_bytes": matrix_bytes,
            "minimum_bytes": 2 * (world - 1) / world * matrix_bytes,
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "step_peak_mib": {k: max(v) / 1024 for k, v in step_peaks.items()}}


def _kib(field: str) -> int:
    """This process's /proc/self/status ``field`` (VmRSS, VmHWM), in KiB."""
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith(field + ":"))


def _reset_peak_rss() -> int:
    """Set the peak RSS to the current RSS (Linux's clear_refs 5); returns the RSS, KiB."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _kib("VmRSS")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=1)
    # a smaller model for iterating: torch's bf16 Newton-Schulz takes ~100 s per W1 step
    # on a CPU without bf16 matrix units
    parser.add_argument("--d-model", type=int, default=W1.d_model)
    parser.add_argument("--layers", type=int, default=W1.n_layers)
    # glibc then returns every freed tensor's memory at once, so the RSS follows the
    # tensors alive and the step's own peak shows (slower: each tensor maps its pages)
    parser.add_argument("--step-peak", action="store_true",
                        help="report step()'s peak RSS above its start (MALLOC_MMAP_THRESHOLD_)")
    args = parser.parse_args(argv)
    if args.step_peak:
        os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"
    config = GPTConfig(vocab_size=W1.vocab_size, seq_len=W1.seq_len, d_model=args.d_model,
                       n_layers=args.layers, n_heads=W1.n_heads)
    if not hasattr(torch.optim, "Muon"):
        sys.exit("torch.optim.Muon needs torch >= 2.9")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    out = run_distributed(_worker, args.world_size, args.steps, args.warmup, config,
                          timeout=3600)[0]
    med = out["median_s"]
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, world {args.world_size}, "
          f"GPT d={config.d_model}, {config.n_layers} layers, command: {' '.join(sys.argv)}\n")
    print("| optimizer | median step() (ms) |\n|---|---:|")
    for kind, t in med.items():
        print(f"| {kind} | {t * 1e3:.1f} |")
    ex = out["exchange_s"]
    print(f"\nMuon's step over AdamW's: +{(med['muon'] - med['adamw']) * 1e3:.1f} ms "
          f"({med['muon'] / med['adamw']:.2f}x). On rank 0: sending the gradients to the owners "
          f"{ex['before'] * 1e3:.1f} ms; sending the updates back "
          f"{ex['after'] * 1e3:.1f} ms, which includes waiting for the slowest owner's "
          f"stock step; the rest is rank 0's own stock step (Newton-Schulz in bf16)")
    sent = out["sent_bytes"]
    total = sent["before"] + sent["after"]
    print(f"bytes sent to other ranks per step (median over the timed steps), every rank "
          f"together: {total / 2**20:.1f} MiB ({sent['before'] / 2**20:.1f} MiB to the "
          f"owners, {sent['after'] / 2**20:.1f} MiB back); "
          f"the least a whole-matrix step moves: {out['minimum_bytes'] / 2**20:.1f} MiB "
          f"({total / out['minimum_bytes']:.2f}x); hidden matrices "
          f"{out['matrix_bytes'] / 2**20:.1f} MiB; the first step "
          f"{out['first_step_bytes'] / 2**20:.1f} MiB")
    print(f"peak RSS of rank 0 (both copies): {out['peak_rss_mib']:.0f} MiB")
    if args.step_peak:
        peaks = out["step_peak_mib"]
        print("step()'s peak RSS above its start, rank 0, the largest of the timed steps: "
              + ", ".join(f"{k} {v:.1f} MiB" for k, v in peaks.items()))


if __name__ == "__main__":
    main()
