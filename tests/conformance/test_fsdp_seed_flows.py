"""The FSDP1 wrapper flows users copy from tutorials, run with fullshard's imports.

``_tutorial_setup_and_loop`` is the setup, training loop and checkpoint code of the
"Fully Sharded Data Parallel (FSDP)" tutorial (FSDP1 API) with ``torch.distributed.fsdp``
imports replaced by fullshard's and ``device_id`` a CPU device.
``_opt_fine_tuning`` is the Hugging Face fine-tuning walkthrough (a tiny OPT built from
its config instead of downloaded, CPU instead of ``.to(local_rank)``).
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn


class TransformerDecoderLayer(nn.Module):
    """A pre-norm decoder layer (causal self-attention + MLP)."""

    def __init__(self, d=32, heads=4):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        n = x.shape[1]
        mask = torch.triu(torch.ones(n, n, dtype=torch.bool), 1)
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class TinyLM(nn.Module):
    """Returns the loss, as the tutorial's ``loss = model(batch)`` expects."""

    def __init__(self, vocab=64, d=32, layers=3):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(TransformerDecoderLayer(d) for _ in range(layers))
        self.head = nn.Linear(d, vocab)

    def forward(self, batch):
        x = self.emb(batch[:, :-1])
        for layer in self.layers:
            x = layer(x)
        logits = self.head(x)
        return nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())


def _tutorial_setup_and_loop(checkpoint_dir):
    from fullshard import FullyShardedDataParallel as FSDP, ShardingStrategy, MixedPrecision
    from fullshard.wrap import transformer_auto_wrap_policy
    from torch.distributed.checkpoint import save, load
    from fullshard import StateDictType

    torch.manual_seed(0)
    model = TinyLM()
    # Define wrapping policy: wrap each transformer layer
    wrap_policy = transformer_auto_wrap_policy(transformer_layer_cls={TransformerDecoderLayer})
    # Mixed precision configuration
    mp_policy = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16,
                               buffer_dtype=torch.bfloat16)
    # Wrap model with FSDP
    model = FSDP(model, sharding_strategy=ShardingStrategy.FULL_SHARD,  # ZeRO-3
                 mixed_precision=mp_policy, auto_wrap_policy=wrap_policy,
                 device_id=torch.device("cpu"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(dist.get_rank())
    dataloader = [torch.randint(0, 64, (4, 17), generator=g).repeat(1, 1) for _ in range(3)] * 8
    losses = []
    # Training loop is the same as DDP
    for batch in dataloader:
        loss = model(batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())

    # Save: distributed checkpoint (each rank saves its shard)
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        state_dict = model.state_dict()
        save(state_dict, checkpoint_id=checkpoint_dir)
    saved = {k: v.full_tensor() for k, v in state_dict.items()}
    with torch.no_grad():  # scramble, then load back
        for p in model.parameters():
            p.to_local().normal_()
    # Load: each rank loads its shard
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        state_dict = model.state_dict()
        load(state_dict, checkpoint_id=checkpoint_dir)
        model.load_state_dict(state_dict)
    restored = model.state_dict()  # outside the block: FSDP1's default, FULL_STATE_DICT
    full_by_default = all(not hasattr(v, "full_tensor") for v in restored.values())
    return {
        "units": sum(isinstance(m, FSDP) for m in model.modules()),
        "names_clean": all("_fsdp" not in n for n, _ in model.named_parameters()),
        "first": sum(losses[:3]) / 3, "last": sum(losses[-3:]) / 3,
        "restored": all(torch.equal(saved[k], restored[k]) for k in saved),
        "full_by_default": full_by_default,
    }


@pytest.mark.slow
def test_tutorial_fsdp1_flow(tmp_path):
    from fullshard.testing import run_distributed

    for r in run_distributed(_tutorial_setup_and_loop, 2, str(tmp_path / "step_1000")):
        assert r["units"] == 4 and r["names_clean"] and r["restored"] and r["full_by_default"]
        assert r["last"] < 0.7 * r["first"], r  # memorizes its 3 batches


def _opt_fine_tuning():
    import functools
    import os

    from fullshard import FullyShardedDataParallel as FSDP
    from fullshard.wrap import size_based_auto_wrap_policy
    from transformers import OPTConfig, OPTForCausalLM

    local_rank = int(os.environ.get("LOCAL_RANK", dist.get_rank()))
    device = torch.device("cpu")
    torch.manual_seed(0)
    config = OPTConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2, ffn_dim=64,
                       num_attention_heads=4, max_position_embeddings=64,
                       word_embed_proj_dim=32)
    model = OPTForCausalLM(config)

    def_auto_wrap_policy = functools.partial(size_based_auto_wrap_policy, min_num_params=1000)
    model = FSDP(model, auto_wrap_policy=def_auto_wrap_policy)

    from torch.optim import AdamW
    from torch.utils.data import DataLoader, Dataset

    class DummyDataset(Dataset):
        def __init__(self, num_samples=32, seq_len=16):
            self.num_samples = num_samples
            self.seq_len = seq_len
            g = torch.Generator().manual_seed(7)  # counting sequences: learnable in a few steps
            start = torch.randint(4, config.vocab_size, (num_samples, 1), generator=g)
            self.data = (start + torch.arange(seq_len)) % config.vocab_size

        def __len__(self):
            return self.num_samples

        def __getitem__(self, idx):
            input_ids = self.data[idx]
            return {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids),
                    "labels": input_ids.clone()}

    dataset = DummyDataset()
    sampler = torch.utils.data.distributed.DistributedSampler(dataset)
    dataloader = DataLoader(dataset, batch_size=4, sampler=sampler)
    optimizer = AdamW(model.parameters(), lr=1e-2)
    losses, seen = [], []
    for epoch in range(6):
        sampler.set_epoch(epoch)
        for batch in dataloader:
            input_ids = batch["input_ids"].to(device)
            attention_mask = batch["attention_mask"].to(device)
            labels = batch["labels"].to(device)
            optimizer.zero_grad()
            outputs = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels)
            loss = outputs.loss
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        seen.append(len(sampler))
    units = [type(m).__name__ for m in model.modules() if isinstance(m, FSDP)]
    return {"first": losses[0], "last": losses[-1], "units": units, "rank": local_rank,
            "per_epoch": seen}


@pytest.mark.slow
def test_hf_opt_fine_tuning_flow():
    pytest.importorskip("transformers")
    from fullshard.testing import run_distributed

    results = run_distributed(_opt_fine_tuning, 2)
    for r in results:
        assert r["per_epoch"] == [16] * 6  # DistributedSampler: half the data each
        assert r["last"] < 0.7 * r["first"], r
        # the tied input embedding stays with the root; layers' big Linears are units
        assert "FSDPOPTForCausalLM" in r["units"] and "FSDPEmbedding" not in r["units"]
