"""The loop watch's benchmark: findings on healthy runs, recall on a corpus of real loop bugs, and its cost.

(a) Healthy runs: every plain-loop configuration of ``bench/_healthy.py`` (LMs, MLPs, BatchNorm CNNs, with
    constant and warmup+cosine schedules), plus loops the watch must know: a LoRA GPT-2 (peft), a frozen
    eval-mode BatchNorm teacher distilled into a student, gradient accumulation declared to the watch, a
    OneCycleLR stepped per batch, a two-group fine-tune (backbone at lr/10) under a LambdaLR; the HF Trainer
    runs of ``bench/_trainer_runs.py`` (LoRA GPT-2, BERT classifier, once with accumulation) and a Lightning
    run with an lr schedule, accumulation and a frozen eval-mode teacher. Target: 0 findings.
(b) The corpus: loop bugs reported in public issue threads, each reproduced as a small real loop with its
    fixed twin. Target: >= 90% caught, 0 twin alarms.
(c) Cost: tensor ops and host time the watch adds to a guarded step, on a sampled step and on the others,
    and amortised over its 2,000-step window (``TorchDispatchMode`` counting, as ``bench/overhead.py``).

    python bench/watch.py            # all three (CPU, ~10 min on 2 loaded cores)
    python bench/watch.py --quick    # healthy runs shortened to 120 steps, Trainer/Lightning runs to 60
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from guardtower.guard import GuardedOptimizer  # noqa: E402
from guardtower.guard.watch import Watch  # noqa: E402

warnings.filterwarnings("ignore")


def _guard(opt: torch.optim.Optimizer, model: nn.Module | None, **watch: Any) -> GuardedOptimizer:
    return GuardedOptimizer(opt, model, verbose=False, log_dir=tempfile.mkdtemp(prefix="gt-watch-"),
                            watch=Watch(**watch) if watch else True)


WATCHED: list[int] = []  # steps each closed guard's watch saw (a run the watch never saw proves nothing)


def _ids(guard: GuardedOptimizer) -> list[str]:
    guard.close()
    WATCHED.append(guard.watch._seen_steps if guard.watch is not None else 0)
    return [f.catalog_id for f in guard.watch.findings] if guard.watch is not None else []


# ---------------------------------------------------------------------------------- (a) healthy runs
def healthy_plain(steps_cap: int | None) -> dict[str, list[str]]:
    from _healthy import CONFIGS

    out: dict[str, list[str]] = {}
    for config in CONFIGS:
        model, opt, mult, batches = config.build(0)
        guard = _guard(opt, model)
        base = [g["lr"] for g in opt.param_groups]
        steps = min(config.steps, steps_cap or config.steps)
        model.train()
        for step in range(steps):
            for group, lr in zip(opt.param_groups, base):
                group["lr"] = lr * mult(step)
            guard.zero_grad()
            config.loss(model, next(batches)).backward()
            guard.step()
        out[config.name] = _ids(guard)
    return out


class Student(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class Distill(nn.Module):
    """A student and a frozen eval-mode BatchNorm teacher, kept in eval after every ``train()``."""

    def __init__(self) -> None:
        super().__init__()
        self.student, self.teacher = Student(), Student()
        self.teacher.requires_grad_(False)
        self.teacher.eval()

    def train(self, mode: bool = True) -> Distill:
        super().train(mode)
        self.teacher.eval()
        return self

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        s = self.student(x)
        with torch.no_grad():
            t = self.teacher(x)
        return nn.functional.cross_entropy(s, y) + nn.functional.mse_loss(s, t)


def _digits() -> tuple[torch.Tensor, torch.Tensor]:
    from _healthy import _sklearn

    return _sklearn("digits")


def _epochs(x: torch.Tensor, y: torch.Tensor, batch: int, steps: int) -> Any:
    gen = torch.Generator().manual_seed(0)
    done = 0
    while done < steps:
        order = torch.randperm(x.shape[0], generator=gen)
        batches = [(x[order[i:i + batch]], y[order[i:i + batch]]) for i in range(0, x.shape[0] - batch + 1, batch)]
        yield batches[:steps - done]
        done += len(batches)


def healthy_extra(steps: int) -> dict[str, list[str]]:
    """Loops that exercise what the watch looks at: teachers, accumulation, per-step schedules, groups, LoRA."""
    out: dict[str, list[str]] = {}
    x, y = _digits()
    torch.manual_seed(0)

    # distillation from a frozen eval-mode BatchNorm teacher, epochs with model.train(), validation in between
    model = Distill()
    opt = torch.optim.AdamW(model.student.parameters(), lr=2e-3)
    guard = _guard(opt, model)
    for epoch in _epochs(x, y, 32, steps):
        model.train()
        for xb, yb in epoch:
            guard.zero_grad()
            model.loss(xb, yb).backward()
            guard.step()
        model.eval()
        with torch.no_grad():
            model.student(x[:64])
    out["distill-frozen-bn-teacher"] = _ids(guard)

    # gradient accumulation over 4 micro-batches, declared; OneCycleLR stepped per optimizer step
    model2 = Student()
    opt = torch.optim.SGD(model2.parameters(), lr=0.05, momentum=0.9)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=steps)
    guard = _guard(opt, model2, accumulation=4, total_steps=steps)
    micro = 0
    for epoch in _epochs(x, y, 8, steps * 4):
        model2.train()
        for xb, yb in epoch:
            (nn.functional.cross_entropy(model2(xb), yb) / 4).backward()
            micro += 1
            if micro % 4 == 0 and micro // 4 <= steps:
                guard.step()
                if micro // 4 < steps:
                    sched.step()
                guard.zero_grad()
    out["accumulation4-onecycle-per-step"] = _ids(guard)

    # a fine-tune with the backbone at lr/10 under a warmup LambdaLR, scheduler found by the watch itself
    model3 = Student()
    opt = torch.optim.AdamW([{"params": model3.net[:3].parameters(), "lr": 1e-4},
                             {"params": model3.net[3:].parameters(), "lr": 1e-3}])
    sched2 = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 20) * max(0.0, 1 - s / steps))
    guard = _guard(opt, model3)
    for epoch in _epochs(x, y, 32, steps):
        model3.train()
        for xb, yb in epoch:
            guard.zero_grad()
            nn.functional.cross_entropy(model3(xb), yb).backward()
            guard.step()
            sched2.step()
    out["two-groups-warmup-linear"] = _ids(guard)

    out["lora-gpt2-plain"] = _lora_loop(steps)
    return out


def _lora_loop(steps: int) -> list[str]:
    from _healthy import gpt2, lm_batches
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(gpt2(), LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], fan_in_fan_out=True))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))
    guard = _guard(opt, model)
    batches = lm_batches(0)
    model.train()
    for _ in range(steps):
        batch = next(batches)
        guard.zero_grad()
        model(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss.backward()
        guard.step()
        sched.step()
    return _ids(guard)


def healthy_trainer(steps: int) -> dict[str, list[str]]:
    from _trainer_runs import TRAINER_CONFIGS, _trainer

    from guardtower.integrations.huggingface import StabilityGuardCallback

    out: dict[str, list[str]] = {}
    for config in TRAINER_CONFIGS:
        for accumulation in (1, 2):
            cfg = copy.copy(config)
            cfg.steps = steps
            cfg.args = {**config.args, "gradient_accumulation_steps": accumulation,
                        "warmup_steps": min(config.args.get("warmup_steps", 0), steps // 3)}
            with tempfile.TemporaryDirectory() as tmp:
                callback = StabilityGuardCallback(log_dir=f"{tmp}/sg_logs", verbose=False)
                trainer = _trainer(cfg, 0, tmp, [callback])
                trainer.train()
                assert callback.guard is not None
                out[f"{config.name}-accum{accumulation}"] = _ids(callback.guard)
                callback.close()
    return out


def healthy_lightning(steps: int) -> dict[str, list[str]]:
    import lightning.pytorch as pl

    from guardtower.integrations.lightning import GuardtowerGuard

    x, y = _digits()

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = Distill()

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            return self.model.loss(*batch)

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            self.model.student(batch[0])

        def configure_optimizers(self) -> Any:
            opt = torch.optim.AdamW(self.model.student.parameters(), lr=2e-3)
            sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=steps + 1)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    data = torch.utils.data.TensorDataset(x, y)
    loader = torch.utils.data.DataLoader(data, batch_size=16, shuffle=True)
    callback = GuardtowerGuard(verbose=False, log_dir=tempfile.mkdtemp(prefix="gt-watch-"), log_counters=False)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, accumulate_grad_batches=2,
                         val_check_interval=25, limit_val_batches=2, num_sanity_val_steps=0, callbacks=[callback])
    trainer.fit(Module(), loader, torch.utils.data.DataLoader(data, batch_size=64))
    callback.close()
    ids = [i for g in callback.guards for i in _ids(g)]
    return {"lightning-distill-accum2-onecycle": ids}


# ---------------------------------------------------------------------------------- (b) the corpus
class Net(nn.Module):
    """Embedding (tied to the head), a frozen eval-mode BatchNorm block, a trainable body, dropout."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(10, 16)
        self.backbone = nn.Sequential(nn.Linear(16, 16), nn.BatchNorm1d(16))
        self.body = nn.Linear(16, 16)
        self.drop = nn.Dropout(0.1)
        self.head = nn.Linear(16, 10, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x).mean(1)
        return self.head(self.drop(torch.relu(self.body(h) + self.backbone(h))))

    def freeze_backbone(self) -> None:
        self.backbone.requires_grad_(False)
        self.backbone.eval()


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [(torch.randint(0, 10, (16, 4), generator=gen), torch.randint(0, 10, (16,), generator=gen))
            for _ in range(n)]


DATA = _batches(8)
EPOCHS, PER_EPOCH = 8, 5


def _loss(model: nn.Module, i: int) -> torch.Tensor:
    x, y = DATA[i % len(DATA)]
    return nn.functional.cross_entropy(model(x), y)


def _groups(model: Net, backbone_lr: float = 1e-3, head_lr: float = 1e-2) -> list[dict[str, Any]]:
    return [{"params": [model.emb.weight, *model.backbone.parameters()], "lr": backbone_lr},
            {"params": list(model.body.parameters()), "lr": head_lr}]


def loop(*, bug: bool, opt_fn: Callable[[Net], torch.optim.Optimizer] | None = None,
         sched_fn: Callable[[torch.optim.Optimizer], Any] | None = None, per_step: bool = True,
         per_epoch: bool = False, epoch_start: Callable[[Net, Any, int], None] | None = None,
         after_step: Callable[[Net, Any, int], None] | None = None, zero: str = "after",
         micro: int = 1, rebuild: bool = False, freeze: bool = True, clip: bool = False,
         epochs: int = EPOCHS, **watch: Any) -> list[str]:
    """One small epoch loop; the keyword hooks are where a case puts its bug (or its fix)."""
    model = Net()
    if freeze:
        model.freeze_backbone()
    make = opt_fn or (lambda m: torch.optim.Adam(_groups(m)))
    opt = make(model)
    guard = _guard(opt, model, **watch)
    sched = sched_fn(opt) if sched_fn is not None else None
    ids: list[str] = []
    i = 0
    for epoch in range(epochs):
        if rebuild and epoch:
            ids += _ids(guard)
            opt = make(model)
            guard = _guard(opt, model, **watch)
        model.train()
        if freeze:
            model.backbone.eval()  # the frozen backbone stays in eval (what the gt-pyg case forgets)
        if epoch_start is not None:
            epoch_start(model, opt, epoch)
        for _ in range(PER_EPOCH):
            for _ in range(micro):
                if zero == "each_micro":
                    guard.zero_grad()
                (_loss(model, i) / micro).backward()
                i += 1
            if clip:
                nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            guard.step()
            if sched is not None and per_step:
                sched.step()
            if after_step is not None:
                after_step(model, opt, i)
            if zero == "after":
                guard.zero_grad()
            elif zero == "after_keep":
                guard.zero_grad(set_to_none=False)
        if sched is not None and per_epoch:
            sched.step()
    return ids + _ids(guard)


def _adjust_all(model: Net, opt: Any, epoch: int) -> None:  # PENet helper.adjust_learning_rate
    for group in opt.param_groups:
        group["lr"] = 1e-2 * (0.5 ** epoch)


def _adjust_each(model: Net, opt: Any, epoch: int) -> None:
    for group, base in zip(opt.param_groups, (1e-3, 1e-2)):
        group["lr"] = base * (0.5 ** epoch)


def _retrain(model: Net, opt: Any, epoch: int) -> None:
    model.train()  # gt-pyg: freeze() put BN in eval once; the epoch's model.train() undoes it


def _retrain_fixed(model: Net, opt: Any, epoch: int) -> None:
    model.train()
    model.backbone.eval()  # the fix: re-apply eval() to the frozen part after every model.train()


def _validate(model: Net, opt: Any, i: int) -> None:
    if i % PER_EPOCH == 2:
        model.eval()  # vsepp: validation every val_step, model.train() only at the epoch start


def _validate_fixed(model: Net, opt: Any, i: int) -> None:
    if i % PER_EPOCH == 2:
        model.eval()
        model.train()
        model.backbone.eval()


def _set_lr_only(model: Net, opt: Any, epoch: int) -> None:
    if epoch == 3:  # ModernBERT: a resumed run's new lr written into the param groups only
        for group in opt.param_groups:
            group["lr"] *= 0.5


def _freeze_body(model: Net, opt: Any, epoch: int) -> None:
    if epoch == 2:  # fairseq: freeze some layers mid-run with requires_grad=False
        model.body.requires_grad_(False)


def _untie(model: Net, opt: Any, epoch: int) -> None:
    if epoch == 2:  # Megatron-LM: the LM head's weight becomes a separate copy during training
        model.head.weight = nn.Parameter(model.emb.weight.detach().clone())


def _bn_frozen_by_grad_only(model: Net, opt: Any, epoch: int) -> None:
    model.backbone.requires_grad_(False)  # frozen with requires_grad=False only: BN stays in training mode


def _bn_frozen_fixed(model: Net, opt: Any, epoch: int) -> None:
    model.backbone.requires_grad_(False)
    model.backbone.eval()


@dataclass
class Case:
    reference: str
    what: str
    expect: str  # the catalog id that should be raised
    bug: Callable[[], list[str]]
    fixed: Callable[[], list[str]]



class _Momentum:
    def __call__(self, model: Net) -> torch.optim.Optimizer:
        return torch.optim.SGD(_groups(model), momentum=0.9)


CASES: list[Case] = [
    Case("https://github.com/alan-turing-institute/deepsensor/issues/47",
         "train_epoch re-instantiates Adam every epoch", "OPT-009",
         lambda: loop(bug=True, rebuild=True), lambda: loop(bug=False)),
    Case("https://github.com/JUGGHM/PENet_ICRA2021/issues/29",
         "adjust_learning_rate writes one lr into the backbone and head groups", "OPT-011",
         lambda: loop(bug=True, epoch_start=_adjust_all), lambda: loop(bug=False, epoch_start=_adjust_each)),
    Case("https://github.com/pytorch/pytorch/issues/65417",
         "OneCycleLR(steps_per_epoch, epochs) stepped once per epoch", "LOOP-006",
         lambda: loop(bug=True, sched_fn=lambda o: torch.optim.lr_scheduler.OneCycleLR(
             o, max_lr=[1e-3, 1e-2], epochs=EPOCHS, steps_per_epoch=PER_EPOCH), per_step=False, per_epoch=True),
         lambda: loop(bug=False, sched_fn=lambda o: torch.optim.lr_scheduler.OneCycleLR(
             o, max_lr=[1e-3, 1e-2], epochs=EPOCHS, steps_per_epoch=PER_EPOCH + 1))),
    Case("https://github.com/aimagelab/meshed-memory-transformer/issues/71",
         "scheduler.step() per batch and again per epoch", "LOOP-007",
         lambda: loop(bug=True, sched_fn=lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: 0.999 ** s),
                      per_step=True, per_epoch=True),
         lambda: loop(bug=False, sched_fn=lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: 0.999 ** s))),
    Case("https://github.com/Lornatang/SRGAN-PyTorch/issues/1",
         "StepLR(step_size=epochs // 2, gamma=0.1) stepped every batch: lr -> 0", "OPT-013",
         lambda: loop(bug=True, sched_fn=lambda o: torch.optim.lr_scheduler.StepLR(o, EPOCHS // 2 + 1, 0.1),
                      epochs=14),
         lambda: loop(bug=False, sched_fn=lambda o: torch.optim.lr_scheduler.StepLR(o, EPOCHS // 2 + 1, 0.1),
                      per_step=False, per_epoch=True, epochs=14)),
    Case("https://github.com/pgniewko/gt-pyg/issues/112",
         "freeze() puts BatchNorm in eval, the next model.train() undoes it", "MODE-005",
         lambda: loop(bug=True, epoch_start=_retrain), lambda: loop(bug=False, epoch_start=_retrain_fixed)),
    Case("https://github.com/fartashf/vsepp/issues/4",
         "validation mid-epoch calls model.eval(); model.train() only at the next epoch", "MODE-006",
         lambda: loop(bug=True, after_step=_validate), lambda: loop(bug=False, after_step=_validate_fixed)),
    Case("https://github.com/IDEA-Research/DN-DETR/issues/19",
         "optimizer.zero_grad() missing, gradients clipped and accumulated forever", "LOOP-003",
         lambda: loop(bug=True, zero="never", clip=True), lambda: loop(bug=False, clip=True)),
    Case("https://github.com/yueliu1999/HSAN/issues/6",
         "self.optimizer.zero_grad() never called", "LOOP-003",
         lambda: loop(bug=True, zero="never", opt_fn=lambda m: torch.optim.Adam(m.parameters(), lr=1e-3)),
         lambda: loop(bug=False, opt_fn=lambda m: torch.optim.Adam(m.parameters(), lr=1e-3))),
    Case("https://github.com/huggingface/accelerate/issues/1299",
         "zero_grad() at the start of every micro-batch discards the accumulated gradient", "LOOP-008",
         lambda: loop(bug=True, micro=4, zero="each_micro", accumulation=4),
         lambda: loop(bug=False, micro=4, accumulation=4)),
    Case("https://github.com/AnswerDotAI/ModernBERT/pull/124",
         "new lr written into param_groups while a LambdaLR is active", "OPT-012",
         lambda: loop(bug=True, sched_fn=lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0),
                      epoch_start=_set_lr_only),
         lambda: loop(bug=False, sched_fn=lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0))),
    Case("https://github.com/facebookresearch/fairseq/issues/4702",
         "layers frozen with requires_grad=False still updated (momentum, zero grads kept)", "DRIFT-001",
         lambda: loop(bug=True, opt_fn=_Momentum(), epoch_start=_freeze_body, zero="after_keep"),
         lambda: loop(bug=False, opt_fn=_Momentum(), epoch_start=_freeze_body)),
    Case("https://github.com/NVIDIA/Megatron-LM/issues/656",
         "LM head weights get untied during training", "TIE-003",
         lambda: loop(bug=True, epoch_start=_untie), lambda: loop(bug=False)),
    Case("https://github.com/pytorch/pytorch/issues/86590",
         "backbone frozen by requires_grad=False only: BatchNorm statistics keep updating", "DRIFT-002",
         lambda: loop(bug=True, freeze=False, epoch_start=_bn_frozen_by_grad_only),
         lambda: loop(bug=False, freeze=False, epoch_start=_bn_frozen_fixed)),
]


def corpus() -> tuple[int, int, int]:
    caught = alarms = 0
    print(f"\n(b) loop-bug corpus: {len(CASES)} real reports, each with its fixed twin")
    for case in CASES:
        bug, fixed = case.bug(), case.fixed()
        hit = case.expect in bug
        caught += hit
        alarms += bool(fixed)
        print(f"  {'caught' if hit else 'MISSED':6s} {case.expect:9s} bug={','.join(bug) or '-':18s} "
              f"twin={','.join(fixed) or '-':10s} {case.what}  [{case.reference}]")
    print(f"  caught {caught}/{len(CASES)} ({100 * caught / len(CASES):.0f}%), twin alarms {alarms}")
    return caught, len(CASES), alarms


# ---------------------------------------------------------------------------------- (c) cost
def cost(repeats: int = 30) -> None:
    from overhead import _OpCounter

    torch.manual_seed(0)
    model = Net()
    model.freeze_backbone()

    def build(watch: bool) -> GuardedOptimizer:
        opt = torch.optim.AdamW(_groups(model), fused=True)
        return GuardedOptimizer(opt, model, verbose=False, log_every=10**9, watch=Watch(every=100) if watch else False,
                                log_dir=tempfile.mkdtemp(prefix="gt-watch-"))

    guards = {"off": build(False), "on": build(True)}

    def one(guard: GuardedOptimizer, i: int) -> int:
        guard.zero_grad()
        _loss(model, i).backward()
        counter = _OpCounter()
        with counter:
            guard.step()
        return counter.count

    ops: dict[str, dict[int, int]] = {"off": {}, "on": {}}
    for step in range(1, 201):
        for name, guard in guards.items():
            ops[name][step] = one(guard, step)
    sampled = [s for s in range(1, 201) if s & (s - 1) == 0 or s % 100 == 0]
    plain = [s for s in range(20, 201) if s not in sampled]
    added_sampled = statistics.median(ops["on"][s] - ops["off"][s] for s in sampled if s > 2)
    added_plain = statistics.median(ops["on"][s] - ops["off"][s] for s in plain)
    watch = guards["on"].watch
    assert watch is not None and watch.active
    host_plain = _host_cost(watch, guards["on"], model)
    n_samples = sum(1 for s in range(1, 2001) if s & (s - 1) == 0 or s % 100 == 0)
    print("\n(c) what the watch adds to a guarded fused-AdamW step (frozen BN backbone, tied weights, 2 groups):")
    print(f"  tensor ops on a step it does not sample: {added_plain:.0f}; on a sampled step: {added_sampled:.0f}")
    print(f"  samples in the 2,000-step window: {n_samples} -> amortised {n_samples * added_sampled / 2000:.2f} ops/step")
    print(f"  host time per step it does not sample (its before/after calls and the optimizer hooks, "
          f"median of 2,000 calls): {1e6 * host_plain:.1f} us")
    for guard in guards.values():
        guard.close()


def _host_cost(watch: Any, guard: GuardedOptimizer, model: nn.Module, calls: int = 2000) -> float:
    """Host seconds per step of the watch's per-step work on a step it does not sample, timed directly."""
    from guardtower.guard import watch as module

    base = guard.base_optimizer
    every = watch.options.every
    watch.options = Watch(every=10**6, steps=10**7)  # no sample and no end inside the timing
    samples = []
    for i in range(calls):
        watch._seen_steps = 3 * 2 ** 20 + 1 + i  # not a power of two: a step it does not sample
        start = time.perf_counter()
        watch.before_step(1000 + i)
        module._pre_step(base, (), {})
        module._post_step(base, (), {})
        watch.after_step(1000 + i)
        samples.append(time.perf_counter() - start)
    watch.options = Watch(every=every)
    return statistics.median(samples)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--only", choices=["healthy", "corpus", "cost"], default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.only in (None, "healthy"):
        runs: dict[str, list[str]] = {}
        seen: dict[str, int] = {}
        for part in (lambda: healthy_plain(120 if args.quick else None),
                     lambda: healthy_extra(120 if args.quick else 400),
                     lambda: healthy_trainer(60 if args.quick else 200),
                     lambda: healthy_lightning(60 if args.quick else 200)):
            WATCHED.clear()
            found = part()
            runs.update(found)
            seen.update(zip(found, WATCHED[-len(found):] if len(WATCHED) >= len(found) else WATCHED))
        print("(a) healthy runs: watch findings per run (and the steps the watch saw)")
        for name, ids in runs.items():
            print(f"  {name:36s} {len(ids)} findings in {seen.get(name, 0):4d} watched steps {' '.join(ids)}")
        print(f"  total: {sum(len(v) for v in runs.values())} findings on {len(runs)} healthy runs")
    if args.only in (None, "corpus"):
        corpus()
    if args.only in (None, "cost"):
        cost()


if __name__ == "__main__":
    main()
