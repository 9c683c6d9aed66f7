"""The loop watch inside GuardedOptimizer: each invariant has a triggering loop and a clean twin."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from torch import nn

from guardtower.errors import ConfigError, LoopInvariantError
from guardtower.guard import GuardedOptimizer
from guardtower.guard.watch import Watch
from guardtower.testing import InMemorySink


class Net(nn.Module):
    """A small model with a frozen eval-mode BatchNorm 'teacher', a trainable head and tied weights."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.teacher = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8))
        self.body = nn.Linear(8, 8)
        self.drop = nn.Dropout(0.1)
        self.head = nn.Linear(8, 10, bias=False)
        self.head.weight = self.emb.weight  # tied

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x).mean(1)
        return self.head(self.drop(self.body(h) + self.teacher(h)))


def make(lr_groups: bool = True, opt: str = "adam", **watch: Any) -> tuple[Net, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = Net()
    model.teacher.requires_grad_(False)
    model.teacher.eval()
    params = [{"params": [model.emb.weight], "lr": 1e-3 if lr_groups else 1e-2},
              {"params": list(model.body.parameters()), "lr": 1e-2}]
    cls = torch.optim.Adam if opt == "adam" else torch.optim.SGD
    return model, cls(params, lr=1e-2)


def guard_for(opt: torch.optim.Optimizer, model: nn.Module, tmp_path: Path, **watch: Any) -> GuardedOptimizer:
    return GuardedOptimizer(opt, model, verbose=False, log_dir=tmp_path, warmup_steps=0,
                            watch=Watch(**watch) if watch else True)


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randint(0, 10, (16, 4)), torch.randint(0, 10, (16,))


def train(model: Net, guard: GuardedOptimizer, *, epochs: int = 4, steps: int = 5,
          each_epoch: Callable[[int], None] | None = None, each_step: Callable[[int], None] | None = None,
          zero: bool = True, micro: int = 1, zero_in_window: bool = False) -> list[str]:
    """A plain epoch loop; the hooks inject the bug. Returns the watch's finding ids."""
    for epoch in range(epochs):
        model.train()
        model.teacher.eval()
        if each_epoch is not None:
            each_epoch(epoch)
        for i in range(steps):
            for _ in range(micro):
                if zero_in_window:
                    guard.zero_grad()
                x, y = batch()
                nn.functional.cross_entropy(model(x), y).backward()
            guard.step()
            if each_step is not None:
                each_step(i)
            if zero:
                guard.zero_grad()
    guard.close()
    assert guard.watch is not None
    return [f.catalog_id for f in guard.watch.findings]


# ---------------------------------------------------------------------------------- healthy
def test_healthy_loop_raises_nothing_and_publishes_no_finding(tmp_path: Path) -> None:
    model, opt = make()
    sink = InMemorySink()
    guard = GuardedOptimizer(opt, model, verbose=False, log_dir=tmp_path, sinks=[sink])
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=[1e-3, 1e-2], total_steps=20)
    assert train(model, guard, each_step=lambda i: sched.step()) == []
    assert sink.of_kind("finding") == []


# ---------------------------------------------------------------------------------- optimizer continuity
def test_new_optimizer_each_epoch_is_opt_009(tmp_path: Path) -> None:
    model, opt = make()
    guard = guard_for(opt, model, tmp_path)
    holder: dict[str, Any] = {"opt": guard}

    def rebuild(epoch: int) -> None:
        if epoch:  # the bug: a fresh optimizer every epoch, guarded again
            holder["opt"].close()
            holder["opt"] = guard_for(torch.optim.Adam(model.parameters(), lr=1e-3), model, tmp_path)

    ids: list[str] = []
    for epoch in range(3):
        rebuild(epoch)
        for _ in range(4):
            x, y = batch()
            nn.functional.cross_entropy(model(x), y).backward()
            holder["opt"].step()
            holder["opt"].zero_grad()
        ids += [f.catalog_id for f in holder["opt"].watch.findings]
    holder["opt"].close()
    assert "OPT-009" in ids


def test_new_plain_optimizer_is_seen_through_the_parameters(tmp_path: Path) -> None:
    model, opt = make()
    guard = guard_for(opt, model, tmp_path)
    x, y = batch()
    for _ in range(3):
        nn.functional.cross_entropy(model(x), y).backward()
        guard.step()
        guard.zero_grad()
    plain = torch.optim.Adam([p for g in opt.param_groups for p in g["params"]], lr=1e-3)
    nn.functional.cross_entropy(model(x), y).backward()
    plain.step()
    assert guard.watch is not None and [f.catalog_id for f in guard.watch.findings] == ["OPT-009"]
    guard.close()


def test_one_optimizer_kept_is_clean_and_sgd_rebuilt_loses_nothing(tmp_path: Path) -> None:
    model, opt = make(opt="sgd")  # plain SGD has no state to lose
    guard = guard_for(opt, model, tmp_path)
    x, y = batch()
    for _ in range(3):
        nn.functional.cross_entropy(model(x), y).backward()
        guard.step()
        guard.zero_grad()
    torch.optim.SGD(model.parameters(), lr=1e-3).step()
    assert guard.watch is not None and guard.watch.findings == []
    guard.close()


def test_state_emptied_is_opt_010(tmp_path: Path) -> None:
    model, opt = make()
    guard = guard_for(opt, model, tmp_path)

    def reset(epoch: int) -> None:
        if epoch == 2:
            opt.state.clear()

    assert train(model, guard, each_epoch=reset) == ["OPT-010"]


def test_step_count_backwards_is_opt_010_and_a_guard_rollback_is_not(tmp_path: Path) -> None:
    model, opt = make()
    guard = guard_for(opt, model, tmp_path)
    early: dict[str, Any] = {}

    def restore(epoch: int) -> None:
        if epoch == 1:
            early["state"] = copy.deepcopy(opt.state_dict())
        if epoch == 3:
            opt.load_state_dict(early["state"])  # a stale state dict loaded mid-run

    assert train(model, guard, each_epoch=restore) == ["OPT-010"]
    model, opt = make()
    guard = guard_for(opt, model, tmp_path)
    guard.load_state_dict(guard.state_dict())  # through the guard: re-baselined
    assert train(model, guard) == []


# ---------------------------------------------------------------------------------- learning rates
def adjust_learning_rate(opt: torch.optim.Optimizer, lr: float) -> None:
    for group in opt.param_groups:
        group["lr"] = lr


def test_adjust_learning_rate_collapsing_groups_is_opt_011(tmp_path: Path) -> None:
    model, opt = make()
    guard = guard_for(opt, model, tmp_path)
    assert train(model, guard, each_epoch=lambda e: adjust_learning_rate(opt, 1e-2 * 0.5 ** e) if e else None) \
        == ["OPT-011"]


def test_per_group_decay_keeps_ratios_and_is_clean(tmp_path: Path) -> None:
    model, opt = make()
    guard = guard_for(opt, model, tmp_path)

    def decay(epoch: int) -> None:
        for group in opt.param_groups:
            group["lr"] *= 0.5

    assert train(model, guard, each_epoch=decay) == []


def test_lr_written_outside_the_scheduler_is_opt_012(tmp_path: Path) -> None:
    model, opt = make()
    guard = guard_for(opt, model, tmp_path)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)

    def override(epoch: int) -> None:
        if epoch == 2:
            opt.param_groups[1]["lr"] = 5e-3  # a resumed run's new lr written into the groups only

    assert train(model, guard, each_epoch=override, each_step=lambda i: None) == ["OPT-012"]
    del sched


def test_lr_through_the_scheduler_is_clean(tmp_path: Path) -> None:
    model, opt = make()
    guard = guard_for(opt, model, tmp_path)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.99 ** s)
    assert train(model, guard, each_step=lambda i: sched.step()) == []


def test_lr_decayed_to_zero_is_opt_013_and_warmup_from_zero_is_not(tmp_path: Path) -> None:
    model, opt = make()
    guard = guard_for(opt, model, tmp_path)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.01)  # stepped per batch: lr -> 0
    assert train(model, guard, epochs=8, each_step=lambda i: sched.step()) == ["OPT-013"]
    model, opt = make()
    guard = guard_for(opt, model, tmp_path)
    warm = torch.optim.lr_scheduler.LinearLR(opt, start_factor=1e-9, total_iters=10)
    assert train(model, guard, epochs=8, each_step=lambda i: warm.step()) == []


# ---------------------------------------------------------------------------------- scheduler cadence
def test_onecycle_stepped_per_epoch_is_loop_006(tmp_path: Path) -> None:
    model, opt = make()
    guard = guard_for(opt, model, tmp_path)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=[1e-3, 1e-2], epochs=6, steps_per_epoch=5)
    assert train(model, guard, epochs=6, each_epoch=lambda e: sched.step() if e else None) == ["LOOP-006"]


def test_onecycle_stepped_per_batch_and_cosine_per_epoch_are_clean(tmp_path: Path) -> None:
    model, opt = make()
    guard = guard_for(opt, model, tmp_path, total_steps=30)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=6)  # sized in epochs, stepped per epoch
    assert train(model, guard, epochs=6, each_epoch=lambda e: sched.step() if e else None) == []


def test_planned_end_judges_a_cosine_sized_in_steps(tmp_path: Path) -> None:
    model, opt = make()
    guard = guard_for(opt, model, tmp_path, total_steps=30)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=30)  # sized in steps, stepped per epoch
    assert train(model, guard, epochs=6, each_epoch=lambda e: sched.step() if e else None) == ["LOOP-006"]


def test_scheduler_stepped_per_batch_and_per_epoch_is_loop_007(tmp_path: Path) -> None:
    model, opt = make()
    guard = guard_for(opt, model, tmp_path)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s) ** 0.1)
    assert train(model, guard, epochs=4, steps=4, each_epoch=lambda e: sched.step() if e else None,
                 each_step=lambda i: sched.step()) == ["LOOP-007"]


# ---------------------------------------------------------------------------------- what must not move
def test_model_train_waking_a_frozen_batchnorm_is_mode_005_and_drift_002(tmp_path: Path) -> None:
    model, opt = make()
    guard = guard_for(opt, model, tmp_path)

    def forget(epoch: int) -> None:
        if epoch >= 1:
            model.teacher.train()  # model.train() without re-freezing the teacher

    assert sorted(train(model, guard, epochs=4, steps=5, each_epoch=forget)) == ["DRIFT-002", "MODE-005"]


def test_frozen_param_moved_by_momentum_is_drift_001(tmp_path: Path) -> None:
    model, opt = make(opt="sgd")
    for group in opt.param_groups:
        group["momentum"] = 0.9
    guard = guard_for(opt, model, tmp_path)

    def freeze(epoch: int) -> None:
        if epoch == 1:
            model.body.weight.requires_grad_(False)  # frozen, but zero_grad(set_to_none=False) keeps a grad

    ids = []
    for epoch in range(4):
        model.train()
        model.teacher.eval()
        freeze(epoch)
        for _ in range(5):
            x, y = batch()
            nn.functional.cross_entropy(model(x), y).backward()
            guard.step()
            guard.zero_grad(set_to_none=False)
    guard.close()
    assert guard.watch is not None
    ids = [f.catalog_id for f in guard.watch.findings]
    assert ids == ["DRIFT-001"]


def test_frozen_params_unchanged_and_eval_teacher_are_clean(tmp_path: Path) -> None:
    model, opt = make()
    guard = guard_for(opt, model, tmp_path, every=3)
    assert train(model, guard, epochs=4) == []


def test_model_left_in_eval_after_validation_is_mode_006(tmp_path: Path) -> None:
    model, opt = make()
    guard = guard_for(opt, model, tmp_path)

    def validate(i: int) -> None:
        if i == 2:
            model.eval()  # validation mid-epoch, no model.train() afterwards

    assert train(model, guard, each_step=validate) == ["MODE-006"]


def test_ties_broken_is_tie_003(tmp_path: Path) -> None:
    model, opt = make()
    guard = guard_for(opt, model, tmp_path)

    def untie(epoch: int) -> None:
        if epoch == 1:
            model.head.weight = nn.Parameter(model.emb.weight.detach().clone())

    assert train(model, guard, epochs=4, steps=5, each_epoch=untie) == ["TIE-003"]


# ---------------------------------------------------------------------------------- accumulation
def test_gradients_never_cleared_is_loop_003(tmp_path: Path) -> None:
    model, opt = make()
    guard = guard_for(opt, model, tmp_path)
    assert train(model, guard, zero=False) == ["LOOP-003"]


def test_zero_grad_inside_the_accumulation_window_is_loop_008(tmp_path: Path) -> None:
    model, opt = make()
    guard = guard_for(opt, model, tmp_path, accumulation=4)
    assert train(model, guard, micro=4, zero=False, zero_in_window=True) == ["LOOP-008"]


def test_declared_accumulation_done_right_is_clean(tmp_path: Path) -> None:
    model, opt = make()
    guard = guard_for(opt, model, tmp_path, accumulation=4)
    assert train(model, guard, micro=4) == []


# ---------------------------------------------------------------------------------- options
def test_ignore_silences_one_id_and_strict_raises(tmp_path: Path) -> None:
    model, opt = make()
    guard = guard_for(opt, model, tmp_path, ignore=("LOOP-003",))
    assert train(model, guard, zero=False) == []
    model, opt = make()
    guard = guard_for(opt, model, tmp_path, strict=True)
    with pytest.raises(LoopInvariantError) as info:
        train(model, guard, zero=False)
    assert info.value.finding.catalog_id == "LOOP-003"
    guard.close()


def test_finding_event_carries_step_expected_observed_once(tmp_path: Path) -> None:
    model, opt = make()
    sink = InMemorySink()
    guard = GuardedOptimizer(opt, model, verbose=False, log_dir=tmp_path, sinks=[sink])
    train(model, guard, zero=False, epochs=3)
    found = sink.of_kind("finding")
    assert len(found) == 1
    event = found[0]
    assert (event.catalog_id, event.check, event.severity.name) == ("LOOP-003", "watch", "WARN")
    assert event.step == 3 and {"expected", "observed", "step"} <= set(event.details)


def test_watch_window_ends_and_false_turns_it_off(tmp_path: Path) -> None:
    model, opt = make()
    guard = guard_for(opt, model, tmp_path, steps=2)
    assert train(model, guard, zero=False) == []  # the bug shows after the window: not watched any more
    model, opt = make()
    guard = GuardedOptimizer(opt, model, verbose=False, log_dir=tmp_path, watch=False)
    x, y = batch()
    nn.functional.cross_entropy(model(x), y).backward()
    guard.step()
    assert guard.watch is None
    guard.close()


@pytest.mark.parametrize("bad", [{"steps": 0}, {"every": -1}, {"ignore": ("NOPE-1",)}, {"strict": 1},
                                 {"total_steps": 1.5}])
def test_bad_options_raise_config_error_naming_them(bad: dict[str, Any]) -> None:
    with pytest.raises(ConfigError) as info:
        Watch(**bad)
    assert info.value.argument == "watch." + next(iter(bad))


def test_bad_watch_argument_fails_before_any_side_effect(tmp_path: Path) -> None:
    model, opt = make()
    with pytest.raises(ConfigError, match="watch"):
        GuardedOptimizer(opt, model, log_dir=tmp_path / "never", watch="yes")  # type: ignore[arg-type]
    assert not (tmp_path / "never").exists()


# ---------------------------------------------------------------------------------- cost
class _Ops(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.count += 1
        return func(*args, **(kwargs or {}))


def _added_ops(tmp_path: Path, frozen_layers: int, steps: tuple[int, ...]) -> dict[int, int]:
    """Ops the watch adds to guard.step (same gradients, watch on minus off), at the given watch steps."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(frozen_layers)], nn.BatchNorm1d(4), nn.Linear(4, 4))
    model[:frozen_layers + 1].requires_grad_(False)
    model[frozen_layers].eval()
    base = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], fused=True)
    on = GuardedOptimizer(base, model, verbose=False, log_dir=tmp_path, log_every=10**9)
    off = GuardedOptimizer(base, model, verbose=False, log_dir=tmp_path, log_every=10**9, watch=False)
    added = {}
    for step in range(1, max(steps) + 1):
        counts = []
        for guard in (on, off):
            guard.zero_grad()
            model(torch.randn(8, 4)).sum().backward()
            ops = _Ops()
            with ops:
                guard.step()
            counts.append(ops.count)
        if step in steps:
            added[step] = counts[0] - counts[1]
    on.close()
    off.close()
    return added


@pytest.mark.slow  # two guards stepped side by side under a dispatch mode
def test_watch_adds_no_op_off_its_samples_and_a_flat_count_on_them(tmp_path: Path) -> None:
    few, many = _added_ops(tmp_path, 2, (13, 16)), _added_ops(tmp_path, 20, (13, 16))
    assert few[13] == many[13] == 0  # step 13 is not sampled: host facts only
    assert 0 < few[16] == many[16] <= 12  # sampled: one foreach norm pass, whatever the number of tensors
