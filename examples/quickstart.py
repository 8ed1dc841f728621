"""Shard a small GPT over the local ranks and train it on Tiny Shakespeare.

    torchrun --standalone --nproc_per_node 2 examples/quickstart.py

Each rank holds 1/N of every weight; fully_shard gathers a block's weights just
before it runs and frees them after. The printed loss is the mean over ranks.
"""

import gc
import os
import time

import torch
import torch.distributed as dist

from fullshard import fully_shard
from fullshard.train.data import CharDataset, load_text
from fullshard.gpt import GPT, GPTConfig, lm_loss

STEPS = int(os.environ.get("QUICKSTART_STEPS", "200"))


def main() -> None:
    use_cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", rank % torch.cuda.device_count()) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)

    data = CharDataset(load_text(), seq_len=64)
    cfg = GPTConfig(vocab_size=data.vocab_size, seq_len=64, d_model=128, n_layers=4, n_heads=4)
    torch.manual_seed(0)  # same initial weights on every rank before sharding
    model = GPT(cfg).to(device)
    for layer in model.layers:  # one unit per transformer block ...
        fully_shard(layer)
    fully_shard(model)          # ... then the root (embeddings, final norm, head)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)

    if rank == 0:
        print(f"GPT {cfg.num_params() / 1e6:.2f}M params sharded over {world} ranks "
              f"({'cuda' if use_cuda else 'cpu'})")
    gen = torch.Generator().manual_seed(1000 + rank)  # each rank reads different text
    start = time.perf_counter()
    for step in range(1, STEPS + 1):
        x, y = (t.to(device) for t in data.batch(8, gen))
        loss = lm_loss(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
        optimizer.step()
        optimizer.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        if rank == 0 and (step == 1 or step % 20 == 0):
            print(f"step {step:3d}  loss {mean.item() / world:.3f}  "
                  f"({(time.perf_counter() - start) / step * 1e3:.0f} ms/step)")
    # Release everything that references the process group before destroying it:
    # gloo can abort at interpreter exit if a live object still holds the group.
    del model, optimizer
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
