"""TensorBoard and Weights & Biases: each step's ``metrics.jsonl`` record, sent on.

Both are optional (``--metrics.tensorboard true``, ``--metrics.wandb PROJECT``), imported
on rank 0 only and only when asked for; :mod:`packages` has already checked that they are
installed. A record's numbers go under their ``metrics.jsonl`` names at the record's step
(``loss``, ``val_loss``, ``lr``, ``tokens_per_s``, ``grad_norm``, memory in bytes);
per-rank lists stay in ``metrics.jsonl``.

Resuming: TensorBoard's ``purge_step`` hides what an interrupted run logged after the
checkpoint it resumes from, as ``metrics.jsonl`` drops those lines; W&B continues the
same run (its id is kept in ``OUT/wandb_run_id``).
"""

from __future__ import annotations

import dataclasses
import importlib
import os

from ..config.schema import TrainConfig
from ..config.packages import import_optional

WANDB_RUN_ID = "wandb_run_id"


def scalars(record: dict) -> dict[str, float]:
    """The record's numbers, without its step."""
    return {k: v for k, v in record.items()
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}


class TensorBoard:
    """Event files in ``out``, beside ``metrics.jsonl``."""

    def __init__(self, out: str, resume_step: int | None):
        import_optional("metrics.tensorboard")
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(
            log_dir=out, purge_step=None if resume_step is None else resume_step + 1)

    def write(self, record: dict) -> None:
        for name, value in scalars(record).items():
            self.writer.add_scalar(name, value, global_step=record["step"])
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandB:
    """One W&B run per ``out``: a fresh run starts a new one, ``--resume`` continues it."""

    def __init__(self, cfg: TrainConfig, out: str, resume_step: int | None):
        self.wandb = import_optional("metrics.wandb")
        id_path = os.path.join(out, WANDB_RUN_ID)
        run_id = None
        if resume_step is not None and os.path.isfile(id_path):
            with open(id_path) as f:
                run_id = f.read().strip()
        self.run = self.wandb.init(project=cfg.metrics.wandb, dir=out, id=run_id,
                                   resume="allow" if run_id else None,
                                   name=os.path.basename(os.path.abspath(out)),
                                   config=dataclasses.asdict(cfg))
        with open(id_path, "w") as f:
            f.write(self.run.id)

    def write(self, record: dict) -> None:
        self.run.log(scalars(record), step=record["step"])

    def close(self) -> None:
        self.run.finish()


def import_dashboards(cfg: TrainConfig) -> None:
    """Import what the dashboards ``cfg.metrics`` asks for need (rank 0, early)."""
    if cfg.metrics.tensorboard:
        import_optional("metrics.tensorboard")
        importlib.import_module("torch.utils.tensorboard")  # imports tensorboard's writer
    if cfg.metrics.wandb:
        import_optional("metrics.wandb")


def open_dashboards(cfg: TrainConfig, out: str, resume_step: int | None) -> list:
    """The dashboards ``cfg.metrics`` asks for (rank 0)."""
    dashboards: list = []
    if cfg.metrics.tensorboard:
        dashboards.append(TensorBoard(out, resume_step))
    if cfg.metrics.wandb:
        dashboards.append(WandB(cfg, out, resume_step))
    return dashboards
