"""``Candidate``: one training configuration ``plan`` weighs (strategy, recomputation,
offload, micro-batch, expert-parallel degree) and its relative cost (Note [how plans are
ranked] in memory/plan.py). Its own file so that the search (memory/plan_search.py) and
the planner both read it without importing each other."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Candidate:
    strategy: str
    activation_checkpointing: bool
    offload: bool
    micro_batch: int
    grad_accum: int
    cost: float
    states_on_disk: bool = False  # offload with DiskOffloadPolicy
    params_on_disk: bool = False  # ... and params=True
    ep: int = 1                   # experts split over this many ranks
    offload_blocks: int = 0       # offload only the last k ...
    blocks: int = 0               # ... of the model's L blocks (cpu:k/L, disk:k/L)

    @property
    def offload_mode(self) -> str:
        """estimate's ``offload`` and the trainer's ``--parallel.offload`` value. A
        fraction is written as ``repr(k / L)``: the shortest text that reads back as
        the same float, which the trainer's parser turns into exactly k blocks (tested
        for every k <= L <= 96, Note [which blocks a fraction offloads])."""
        kind = ("disk+params" if self.params_on_disk else "disk") if self.states_on_disk \
            else "cpu"
        if self.offload_blocks:
            return f"{kind}:{self.offload_blocks / self.blocks!r}"
        return kind if self.offload else "none"

    @property
    def family(self) -> tuple[str, bool, int, int, bool, bool]:
        """What the partial offloads that differ only in k share."""
        return (self.strategy, self.activation_checkpointing, self.micro_batch, self.ep,
                self.states_on_disk, self.params_on_disk)

    @property
    def rank(self) -> tuple[float, int, int]:
        """The order of preference: cheapest, then the larger micro-batch, then fewer
        ranks per expert."""
        return (self.cost, -self.micro_batch, self.ep)
