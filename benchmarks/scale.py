"""fullshard at world sizes 8 to 1,024 in one process (torch's fake process group), beside
torch's FSDP2 under the same fake world.

    OMP_NUM_THREADS=1 python benchmarks/scale.py
    OMP_NUM_THREADS=1 python benchmarks/scale.py --sizes 8,1024 --rounds 5

Per world size N, as rank 0: the bytes of its shards (parameters, gradients, AdamW's
states) of ``row_blocks`` (fullshard.testing.scale) and ``fullshard estimate``'s figures
for the same model, the collectives one step issues, and the host CPU milliseconds per step
(median over interleaved rounds) of three steps: fullshard on ``row_blocks``, torch's
FSDP2 on ``row_blocks``, and the trainer's step on the ``debug`` preset. "host" is a
step's CPU time with the collectives moving nothing (``QuietBackend``): the caller's own
work. In brackets, a step's whole time over the fake backend, which copies the input into
each of the N chunks of an all-gather's output: work that grows with N and stands for the
wire, not for the caller (and cools the caches for what follows). Ratios are against N=8. The divergence guard does not run
under the fake backend (it needs processes talking over a real backend), so it adds
nothing here; the table says so rather than show a cost it did not measure.
"""

from __future__ import annotations

import argparse

import torch

from fullshard.core.guard import divergence
from fullshard.memory.byte_ledger import OPTIMIZER, SHARDED_PARAMS
from fullshard.memory.estimate import estimate
from fullshard.testing import scale
from fullshard.testing.dispatch_log import DispatchLog
from fullshard.testing.fake_world import fake_world


def blocks_step(shard):
    """``build(world)`` for scale.host_times: row_blocks sharded by ``shard``, one step."""
    return lambda world: scale.BlocksRun(shard).step


def trainer_step(world: int):
    """``build(world)`` for scale.host_times: the trainer's step on the debug preset."""
    run = scale.trainer(world)
    return lambda: scale.trainer_step(run)


def static_figures(world: int) -> dict:
    """Shard bytes, the collectives of one step, whether the guard runs, at ``world``."""
    with fake_world(world):
        run = scale.BlocksRun()
        run.step()  # AdamW's states exist from here on
        with DispatchLog() as log:
            run.step()
        run.forward_backward()
        shards = scale.shard_bytes(run.model, run.optimizer)
        guarded = divergence.guarded(list(range(world)))
    kinds = [op.kind for op in log.collectives]
    return {"shards": shards, "gathers": kinds.count("all_gather"),
            "scatters": kinds.count("reduce_scatter"), "guard": "on" if guarded else "off"}


def estimated(world: int) -> int:
    """``fullshard estimate``'s shards and optimizer states per rank for row_blocks."""
    with torch.device("meta"):
        model = scale.row_blocks()
    x = torch.empty(scale.BATCH, scale.WIDTH, device="meta")
    result = estimate(model, world_size=world, device="cpu", process_baseline=0,
                      bucket_numel=0, seq_len=1,
                      loss_of=lambda m, batch, seq: m(x).square().mean())
    return result.lines[SHARDED_PARAMS] + result.lines[OPTIMIZER]


def main() -> None:
    """Measure at each ``--sizes`` and print the table (markdown)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default=",".join(map(str, scale.WORLD_SIZES)))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    builds = (("fullshard", blocks_step(scale.fully_shard)),
              ("fsdp2", blocks_step(torch_fully_shard())), ("trainer", trainer_step))
    # host work alone (collectives moving nothing), and with the fake backend's copies
    quiet = {name: scale.host_times(build, sizes, args.rounds, args.steps, quiet=True)
             for name, build in builds}
    copying = {name: scale.host_times(build, sizes, args.rounds, args.steps)
               for name, build in builds}
    print_table(sizes, {n: static_figures(n) for n in sizes}, quiet, copying)


def torch_fully_shard():
    """torch's FSDP2 ``fully_shard``, imported only when measured."""
    from torch.distributed.fsdp import fully_shard
    return fully_shard


def print_table(sizes, figures, quiet, copying) -> None:
    """One row per world size; ratios against the first size."""
    first = sizes[0]
    print(f"| N | shard bytes/rank (params+grads+states) | x N | estimate (params+states) | "
          f"all-gathers, reduce-scatters/step | fullshard host ms/step (with copies) | "
          f"FSDP2 host ms/step (with copies) | trainer step host ms (with copies) | host "
          f"vs N={first}: fullshard, FSDP2, trainer | guard |")
    print("|" + "---|" * 10)
    for n in sizes:
        f, s = figures[n], figures[n]["shards"]
        stats = ratios = ""
        for name in ("fullshard", "fsdp2", "trainer"):
            q = quiet[name][n]
            stats += f" {q.own * 1e3:.2f} ({copying[name][n].total * 1e3:.2f}) |"
            ratios += f"{q.own / quiet[name][first].own:.2f}, "
        print(f"| {n:,} | {s.params:,}+{s.grads:,}+{s.states:,} = {s.total:,} | "
              f"{s.total * n:,} | {estimated(n):,} | {f['gathers']}, {f['scatters']} |"
              f"{stats} {ratios[:-2]} | {f['guard']} (fake backend) |")


if __name__ == "__main__":
    main()
