"""Lightning's ModelParallelStrategy, unchanged, on 2 CPU ranks.

``python lightning_model_parallel.py fullshard OUT`` opts in with ``fullshard.install()``
first; ``... torch OUT`` runs torch's FSDP2. Each rank writes its losses, the batches it
trained on, the final weights and the kind of its sharded modules to
``OUT/rank<N>.json``. Lightning re-launches this file for rank 1.
"""

import json
import os
import sys

if sys.argv[1] == "fullshard":
    import fullshard

    fullshard.install()

import lightning.pytorch as L  # noqa: E402
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from lightning.pytorch.strategies import ModelParallelStrategy  # noqa: E402
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard  # noqa: E402


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(),
                                 nn.Linear(16, 4))
        self.losses, self.batches = [], []

    def configure_model(self):  # the strategy's contract: shard here, with its mesh
        mesh = self.device_mesh["data_parallel"]
        for i in (0, 2, 4):
            fully_shard(self.net[i], mesh=mesh, mp_policy=MixedPrecisionPolicy())
        fully_shard(self.net, mesh=mesh)

    def training_step(self, batch, _):
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        self.losses.append(loss.item())
        self.batches.append((x.tolist(), y.tolist()))
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.net.parameters(), lr=1e-2)


def main(out: str) -> None:
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(32, 8, generator=g),
                                          torch.randn(32, 4, generator=g))
    model = Model()
    trainer = L.Trainer(accelerator="cpu", devices=2, max_steps=4, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False,
                        strategy=ModelParallelStrategy(data_parallel_size=2,
                                                       tensor_parallel_size=1))
    trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=4))
    kinds = sorted({type(m).__module__ for m in model.modules() if isinstance(m, FSDPModule)})
    weights = {k: v.full_tensor().tolist() for k, v in model.net.state_dict().items()}
    with open(os.path.join(out, f"rank{trainer.global_rank}.json"), "w") as f:
        json.dump({"losses": model.losses, "kinds": kinds, "weights": weights,
                   "batches": model.batches}, f)


if __name__ == "__main__":
    main(sys.argv[2])
