"""Which parameters the Muon recipe gives Muon, and which rank steps each: the trainer's
``--optim.name muon``, the optimizer's step and the memory estimate share these rules."""

from __future__ import annotations

import heapq

import torch.nn as nn


def muon_matrices(model: nn.Module) -> list[nn.Parameter]:
    """The trainable 2-D parameters outside embeddings and the output head: the hidden
    matrices, which Muon steps (each whole, Note [whole-matrix optimizers]). Embeddings,
    the head, norms and biases stay with AdamW, as the Muon recipe has them. A module
    whose parameters each stack several (``stacked = True``: fullshard.gpt's grouped
    experts) holds no matrix of its own: its 2-D parameters are stacked biases."""
    left_out = {id(p) for m in model.modules()
                if isinstance(m, nn.Embedding) or getattr(m, "stacked", False)
                for p in m.parameters()}
    head = getattr(model, "get_output_embeddings", lambda: None)()
    left_out |= {id(p) for p in (head.parameters() if head is not None else ())}
    return [p for p in model.parameters()
            if p.requires_grad and p.dim() == 2 and id(p) not in left_out]


def step_cost(rows: int, numel: int) -> int:
    """Multiply-adds of one Newton-Schulz iteration on an m x n matrix (m <= n): the Gram
    matrix and the product back, m x m x n each, and the Gram matrix squared, m^3."""
    cols = max(1, numel // max(1, rows))
    m, n = min(rows, cols), max(rows, cols)
    return 2 * m * m * n + m ** 3


def owners_by_cost(costs: list[int], ranks: int) -> list[int]:
    """The rank that steps each matrix: greedily, largest cost first, to the least loaded
    rank (the lowest on ties), the same on every rank. The ranks wait in a heap ordered by
    (load, rank): O(P log N) for P matrices over N ranks, not a scan of every rank each."""
    load = [(0, r) for r in range(ranks)]  # sorted, so already a heap
    owners = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: -costs[i]):
        least, owner = heapq.heappop(load)
        owners[i] = owner
        heapq.heappush(load, (least + costs[i], owner))
    return owners
