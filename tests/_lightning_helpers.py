"""A tiny LightningModule on random regression data, with a switchable bug and an injectable spike."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn


def snapshot(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


class TinyModule(pl.LightningModule):
    """MLP regression. ``spike_at``: multiply the gradients of that optimizer step by 1e4 (on ``spike_rank``
    only, under DDP: after the all-reduce, so the ranks disagree). ``forget_layer``: the optimizer misses the
    last layer (OPT-001). ``manual``: manual optimization. Records the weights before and after every step."""

    def __init__(self, *, spike_at: int | None = None, spike_rank: int | None = None, forget_layer: bool = False,
                 manual: bool = False, lr: float = 0.1, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        self.spike_at, self.spike_rank, self.forget_layer, self.lr = spike_at, spike_rank, forget_layer, lr
        self.automatic_optimization = not manual
        self.before: dict[int, dict[str, torch.Tensor]] = {}
        self.after: dict[int, dict[str, torch.Tensor]] = {}
        gen = torch.Generator().manual_seed(seed)
        self.x = torch.randn(256, 8, generator=gen)
        self.y = self.x.sum(dim=1, keepdim=True) + 0.1 * torch.randn(256, 1, generator=gen)

    def loss(self, batch: Any) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        loss = self.loss(batch)
        self.log("train_loss", loss, on_step=True, on_epoch=False, batch_size=len(batch[0]))
        if self.automatic_optimization:
            return loss
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()
        return None

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        step = self.trainer.global_step + 1
        if step == self.spike_at and (self.spike_rank is None or self.global_rank == self.spike_rank):
            for p in self.parameters():
                if p.grad is not None:
                    p.grad.mul_(1e4)
        self.before[step] = snapshot(self)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.after[self.trainer.global_step] = snapshot(self)

    def configure_optimizers(self) -> Any:
        params = self.net[0].parameters() if self.forget_layer else self.parameters()
        return torch.optim.SGD(params, lr=self.lr)

    def train_dataloader(self) -> Any:
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(self.x, self.y), batch_size=16)


def lightning_trainer(root: Path, **overrides: Any) -> pl.Trainer:
    kwargs: dict[str, Any] = dict(
        accelerator="cpu", devices=1, max_steps=6, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=1, default_root_dir=str(root),
        num_sanity_val_steps=0,
    )
    kwargs.update(overrides)
    return pl.Trainer(**kwargs)
