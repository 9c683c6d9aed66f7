"""Incidents in one process: the rank and batch an incident names, the quarantine and its replay, triage."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from guardtower.errors import ConfigError
from guardtower.events import SkipEvent, SpikeEvent
from guardtower.guard import GuardedOptimizer, read_report
from guardtower.guard.quarantine import Quarantine, fingerprint
from guardtower.testing import InMemorySink


def make(tmp_path: Path, **kwargs: object) -> tuple[nn.Module, GuardedOptimizer, InMemorySink]:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 1))
    sink = InMemorySink()
    guard = GuardedOptimizer(torch.optim.SGD(net.parameters(), lr=0.01), net, log_dir=tmp_path, verbose=False,
                             sinks=[sink], **kwargs)
    return net, guard, sink


def batch(step: int, bad: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    x, y = torch.randn(8, 4, generator=gen), torch.randn(8, 1, generator=gen)
    if bad:
        x[0, 0] = float("inf")
    return x, y


def spikes(sink: InMemorySink) -> dict[int, SpikeEvent]:
    return {e.step: e for e in sink.events if isinstance(e, SpikeEvent)}


def _train_seven_steps_with_a_nan_at_step_5(net: nn.Module, guard: GuardedOptimizer, epoch: int) -> None:
    for step in range(1, 8):
        x, y = batch(step, bad=step == 5)
        guard.zero_grad()
        loss = ((net(x) - y) ** 2).mean()
        loss.backward()
        guard.observe_batch((x, y), index=step - 1, epoch=epoch)
        guard.step(loss=loss)


def test_a_rejected_step_names_its_rank_and_batch_and_is_quarantined(tmp_path: Path) -> None:
    net, guard, sink = make(tmp_path)
    _train_seven_steps_with_a_nan_at_step_5(net, guard, epoch=2)
    guard.flush()  # events reach the sink on the bus's worker thread
    event = spikes(sink)[5]
    assert event.ranks == (0,) and event.rank_values[0][:2] == (0, "nonfinite")
    assert event.batch == {"step": 5, "epoch": 2, "index": 4, "batch_size": 8,
                           "fingerprint": fingerprint(batch(5, bad=True))}
    skip = next(e for e in sink.events if isinstance(e, SkipEvent))
    assert skip.ranks == (0,) and skip.batch == event.batch
    assert read_report(event.report_path)["batch"] == event.batch
    lines = (tmp_path / "quarantine-rank0.jsonl").read_text().splitlines()
    assert [json.loads(line)["batch"]["index"] for line in lines] == [4]
    assert guard.quarantine.positions() == {(2, 4)}
    assert Quarantine.read(tmp_path).positions() == {(2, 4)}
    # the quarantine rides in the guard's state and comes back with it
    _, resumed, _ = make(tmp_path / "resumed")
    resumed.load_state_dict(guard.state_dict())
    assert resumed.quarantine.positions() == {(2, 4)}
    assert [i for i, _ in resumed.quarantine.skip("abcdef", epoch=2)] == [0, 1, 2, 3, 5]
    assert [i for i, _ in resumed.quarantine.skip("abcdef", epoch=1)] == [0, 1, 2, 3, 4, 5]
    assert [i for i, _ in resumed.quarantine.skip("cdef", epoch=2, start=2)] == [2, 3, 5]
    guard.close()
    resumed.close()


def test_the_fingerprint_is_of_the_content_and_indices_replace_it(tmp_path: Path) -> None:
    x = torch.arange(6.0)
    assert fingerprint({"a": x}) == fingerprint({"a": x.clone()}) != fingerprint({"a": x + 1})
    assert fingerprint({"a": x}) != fingerprint({"b": x}) and fingerprint("text") is None
    net, guard, sink = make(tmp_path)
    x, y = batch(1, bad=True)
    ((net(x) - y) ** 2).mean().backward()
    guard.observe_batch((x, y), indices=torch.tensor([7, 3, 9]))
    guard.step()
    guard.flush()
    assert spikes(sink)[1].batch == {"step": 1, "indices": [7, 3, 9], "batch_size": 3}
    guard.close()


def closure_for(net: nn.Module, guard: GuardedOptimizer, x: torch.Tensor, y: torch.Tensor,
                corrupt_first: bool, calls: list[int]) -> Callable[[], torch.Tensor]:
    def closure() -> torch.Tensor:
        calls.append(1)
        guard.zero_grad()
        loss = ((nn.functional.dropout(net(x), 0.2) - y) ** 2).mean()
        loss.backward()
        if corrupt_first and len(calls) == 1:
            next(net.parameters()).grad.mul_(float("nan"))
        return loss

    return closure


def test_triage_labels_a_one_off_fault_transient_and_a_bad_batch_deterministic(tmp_path: Path) -> None:
    net, guard, sink = make(tmp_path, triage=True)
    per_step: dict[int, int] = {}
    for step in range(1, 12):
        x, y = batch(step, bad=step == 8)
        calls: list[int] = []
        guard.observe_batch(x, index=step - 1)
        guard.step(closure_for(net, guard, x, y, step == 4, calls))
        per_step[step] = len(calls)
    guard.flush()
    found = spikes(sink)
    assert sorted(found) == [4, 8]
    assert (found[4].triage, found[4].ranks, found[4].triage_ranks) == ("transient", (0,), ())
    assert (found[8].triage, found[8].triage_ranks) == ("deterministic", (0,))
    assert per_step == {s: 2 if s in (4, 8) else 1 for s in per_step}  # one recompute per incident, none else
    assert guard.quarantine.positions() == {(None, 7)}  # a transient incident's batch is not replayed
    assert guard.total_skips == 2 and all(torch.isfinite(p).all() for p in net.parameters())
    guard.close()


@pytest.mark.parametrize("fused", [False, True])
def test_triage_under_a_grad_scaler_judges_the_recompute_unscaled(tmp_path: Path, fused: bool) -> None:
    """The recompute backpropagates the scaled loss as the step did: judged at the scaler's scale, a one-off
    spike is transient and a bad batch deterministic (at 2**10 every recompute would look like a spike)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 1))
    sink = InMemorySink()
    guard = GuardedOptimizer(torch.optim.AdamW(net.parameters(), lr=1e-2, fused=fused), net, log_dir=tmp_path,
                             verbose=False, sinks=[sink], triage=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1000)
    calls: list[int] = []
    for step in range(1, 19):
        x, y = batch(step)
        if step == 16:
            x = x * 1e3  # a batch that reproduces its spike

        def closure(x: torch.Tensor = x, y: torch.Tensor = y) -> torch.Tensor:
            calls.append(step)
            guard.zero_grad()
            loss = ((net(x) - y) ** 2).mean()
            scaler.scale(loss).backward()
            return loss

        # a fused optimizer is handed the scale by scaler.step; a plain one needs the scaler named
        guard.observe_recompute(closure, scaler=None if fused else scaler)
        closure()
        if step == 12:
            next(net.parameters()).grad.mul_(1e4)  # a one-off fault: finite, so the scaler lets it through
        scaler.step(guard)
        scaler.update()
    guard.flush()
    found = spikes(sink)
    assert sorted(found) == [12, 16]
    assert found[12].triage == "transient" and found[16].triage == "deterministic"
    assert calls.count(12) == calls.count(16) == 2 and len(calls) == 20  # one recompute per incident
    assert scaler.get_scale() == 2.0**10  # no overflow anywhere: the spikes were the guard's, not the scaler's
    with pytest.raises(ConfigError, match="scaler"):
        guard.observe_recompute(closure, scaler=object())
    guard.close()


def test_triage_restores_the_rng_so_dropout_recomputes_alike(tmp_path: Path) -> None:
    net, guard, sink = make(tmp_path, triage=True, warmup_steps=0)
    x, y = batch(1)
    losses: list[float] = []

    def closure() -> torch.Tensor:
        guard.zero_grad()
        loss = ((nn.functional.dropout(net(x), 0.5) - y) ** 2).mean()
        loss.backward()
        losses.append(float(loss.detach()))
        if len(losses) == 1:
            next(net.parameters()).grad.fill_(float("inf"))
        return loss

    guard.step(closure)
    guard.flush()  # the spike event reaches the sink on the bus's worker thread
    assert len(losses) == 2 and losses[0] == losses[1]  # same dropout mask: the RNG was restored
    assert spikes(sink)[1].triage == "transient"
    guard.close()


def test_bad_incident_arguments_raise_config_errors_naming_them(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="triage"):
        make(tmp_path, triage="yes")
    net, guard, _ = make(tmp_path, triage=True)
    ((net(torch.ones(2, 4))) ** 2).mean().backward()
    with pytest.raises(ConfigError, match="closure"):
        guard.step()
    assert guard.step_count == 0  # nothing changed
    for kwargs, name in (({"index": -1}, "index"), ({"epoch": 1.5}, "epoch"), ({"indices": 3}, "indices"),
                         ({"micro_batches": 0}, "micro_batches")):
        with pytest.raises(ConfigError, match=name):
            guard.observe_batch(None, **kwargs)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="closure"):
        guard.observe_recompute("not callable")  # type: ignore[arg-type]
    for kwargs, name in (({"batch_size": 0}, "batch_size"), ({"batch_size": 1.5}, "batch_size"),
                         ({"world_size": True}, "world_size")):
        with pytest.raises(ConfigError, match=f"{name}: .*Fix: pass the resumed run's {name}"):
            Quarantine(**kwargs)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="batch_size"):
        guard.quarantine.agreed(batch_size=-4)
    state = guard.state_dict()
    state["guardtower"]["quarantine"] = [{"step": "x"}]
    with pytest.raises(ConfigError, match="state_dict"):
        guard.load_state_dict(state)
    guard.close()


def test_lightning_names_the_rejected_batch_and_triage_recomputes_it(tmp_path: Path) -> None:
    pytest.importorskip("lightning")
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from _lightning_helpers import TinyModule, lightning_trainer

    from guardtower.integrations.lightning import GuardtowerGuard

    module = TinyModule()
    module.x[16 * 3 + 2, 0] = float("inf")  # batch 3 of the first epoch holds an Inf sample
    sink = InMemorySink()
    callback = GuardtowerGuard(log_dir=tmp_path / "logs", verbose=False, sinks=[sink], triage=True)
    lightning_trainer(tmp_path, max_steps=6, callbacks=[callback]).fit(module)
    event, = [e for e in sink.events if isinstance(e, SpikeEvent)]
    assert event.batch == {"step": 4, "epoch": 0, "index": 3, "batch_size": 16,
                           "fingerprint": event.batch["fingerprint"]}
    assert event.triage == "deterministic"  # Lightning's closure ran again and reproduced it
    assert Quarantine.read(tmp_path / "logs").positions() == {(0, 3)}
    callback.close()


@pytest.mark.parametrize(("incident", "fused"), [("transient", False), ("deterministic", False),
                                                 ("transient", True), ("deterministic", True)])
def test_lightning_16_mixed_triage_recomputes_at_the_grad_scalers_scale(tmp_path: Path, incident: str,
                                                                      fused: bool) -> None:
    """Under a GradScaler Lightning runs the closure itself and calls ``scaler.step(guard)`` with none; the
    recompute is scaled again, so judged without the scale a one-off spike would read as deterministic. A fused
    optimizer unscales inside its step (the plugin leaves the gradients scaled and the scaler hands the scale)."""
    pytest.importorskip("lightning")
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from _lightning_helpers import TinyModule, lightning_trainer
    from lightning.pytorch.plugins.precision.amp import MixedPrecision

    from guardtower.integrations.lightning import GuardtowerGuard

    # transient: the gradients x1e4 after the closure (a fault the recompute does not see); deterministic:
    # batch 11 scaled x10 (finite in float16 at this loss scale: the scaler itself lets it through)
    class Module(TinyModule):
        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=self.lr, fused=fused)

    module = Module(spike_at=12 if incident == "transient" else None)
    if incident == "deterministic":
        module.x[16 * 11:16 * 12] *= 10
        module.y[16 * 11:16 * 12] *= 10
    sink = InMemorySink()
    callback = GuardtowerGuard(log_dir=tmp_path / "logs", verbose=False, sinks=[sink], triage=True)
    plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=256.0))
    trainer = lightning_trainer(tmp_path, max_steps=16, callbacks=[callback], plugins=[plugin])
    trainer.fit(module)
    callback.guards[0].flush()
    event, = [e for e in sink.events if isinstance(e, SpikeEvent)]
    assert (event.step, event.batch["index"], event.triage) == (12, 11, incident)
    assert "optimizer_step" not in vars(plugin)  # the plugin is given back at the end of fit
    callback.close()


def test_lightning_triage_without_a_manual_closure_is_a_clear_error_at_the_first_step(tmp_path: Path) -> None:
    pytest.importorskip("lightning")
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from _lightning_helpers import TinyModule, lightning_trainer, snapshot, same

    from guardtower.integrations.lightning import GuardtowerGuard

    module = TinyModule(manual=True)  # its training_step calls opt.step() with no closure
    before = snapshot(module)
    callback = GuardtowerGuard(log_dir=tmp_path / "logs", verbose=False, triage=True)
    with pytest.raises(ConfigError, match="triage: manual optimization called optimizer.step\(\) without a closure"):
        lightning_trainer(tmp_path, max_steps=3, callbacks=[callback]).fit(module)
    assert same(before, snapshot(module)) and callback.guards[0].step_count == 0
    callback.close()


def test_lightning_resumed_mid_epoch_skips_the_quarantined_batch_where_the_restarted_loader_brings_it(
        tmp_path: Path) -> None:
    """A plain DataLoader cannot resume mid-epoch: Lightning starts the epoch's data over while batch_idx goes on
    from the checkpoint's. The quarantine names loader positions, so the resumed run skips the bad batch where it
    comes again (batch_idx 7 carries loader batch 2), judges nothing there, and names no other batch."""
    pytest.importorskip("lightning")
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from _lightning_helpers import TinyModule, lightning_trainer

    from guardtower.integrations.lightning import GuardtowerGuard

    def module() -> TinyModule:
        m = TinyModule()
        m.x[16 * 2 + 1, 0] = float("inf")  # loader batch 2 of every epoch holds an Inf sample
        return m

    from lightning.pytorch.callbacks import ModelCheckpoint

    logs, first_sink, resumed_sink = tmp_path / "logs", InMemorySink(), InMemorySink()
    first = GuardtowerGuard(log_dir=logs, verbose=False, sinks=[first_sink])
    saved = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=5, save_top_k=-1)
    lightning_trainer(tmp_path, max_steps=6, callbacks=[first, saved], enable_checkpointing=True).fit(module())
    first.close()  # the run "killed" after step 6; its checkpoint of step 5 is 5 batches into the 16 of epoch 0
    (rejected,) = [e for e in first_sink.events if isinstance(e, SpikeEvent)]
    assert (rejected.step, rejected.batch["epoch"], rejected.batch["index"]) == (3, 0, 2)

    resumed = GuardtowerGuard(log_dir=logs, verbose=False, sinks=[resumed_sink])
    (checkpoint,) = (tmp_path / "ckpt").glob("*step=5*.ckpt")
    with pytest.warns(UserWarning, match="not resumable"):  # Lightning's own warning: the loader starts over
        lightning_trainer(tmp_path, max_steps=9, callbacks=[resumed]).fit(module(), ckpt_path=checkpoint)
    resumed.guards[0].flush()
    assert not [e for e in resumed_sink.events if isinstance(e, SpikeEvent)]  # the bad batch was never computed
    (skip,) = [e for e in resumed_sink.events if isinstance(e, SkipEvent)]
    assert (skip.reason, skip.step, skip.batch["epoch"], skip.batch["index"]) == ("quarantined", 8, 0, 2)
    resumed.close()


def test_a_replayed_step_is_skipped_unjudged_and_accumulated_batches_are_quarantined_together(tmp_path: Path) -> None:
    net, guard, sink = make(tmp_path, warmup_steps=0)
    x, y = batch(1)
    ((net(x) - y) ** 2).mean().backward()
    guard.step()
    before = [p.detach().clone() for p in net.parameters()]
    for p in net.parameters():  # whatever the gradients hold, a replayed step neither judges nor applies them
        p.grad = torch.full_like(p, float("nan"))
    calls: list[int] = []
    guard.observe_batch(x, index=6, epoch=1, micro_batches=2)
    guard.skip_quarantined()
    assert guard.step(lambda: calls.append(1) or torch.tensor(0.0)) is not None and calls == [1]
    assert all(torch.equal(a, b) for a, b in zip(before, net.parameters()))
    guard.flush()
    (skip,) = [e for e in sink.events if isinstance(e, SkipEvent)]
    assert (skip.step, skip.reason, skip.batch) == (2, "quarantined", {"step": 2, "epoch": 1, "index": 6,
                                                                       "micro_batches": 2})
    assert (guard.step_count, guard.total_skips, guard.total_spikes) == (2, 1, 0) and not guard.quarantine.entries
    # a rejected step that accumulated two loader batches quarantines both; trainers replay it as one step
    guard.zero_grad()
    bad_x, bad_y = batch(3, bad=True)
    ((net(bad_x) - bad_y) ** 2).mean().backward()
    guard.observe_batch([x, bad_x], index=2, epoch=0, micro_batches=2)
    guard.step()
    quarantine = Quarantine.read(tmp_path)
    assert quarantine.positions() == {(0, 2), (0, 3)} and quarantine.contains(2, 0, micro_batches=2)
    assert not quarantine.contains(4, 0, micro_batches=2) and quarantine.contains(3, 0)
    assert [i for i, _ in quarantine.skip("abcdef", epoch=0)] == [0, 1, 4, 5]
    assert len(quarantine.merged(guard.quarantine)) == 1 and quarantine.agreed().positions() == quarantine.positions()
    guard.close()


def test_a_quarantine_recorded_at_another_world_size_is_kept_but_not_replayed(tmp_path: Path) -> None:
    net, guard, _ = make(tmp_path)
    _train_seven_steps_with_a_nan_at_step_5(net, guard, epoch=0)
    (entry,) = guard.quarantine.entries
    assert entry["world_size"] == 1
    assert guard.quarantine.agreed().positions() == {(0, 4)}  # the same world size: replayed
    at_four = Quarantine([{**entry, "world_size": 4}])
    with pytest.warns(RuntimeWarning, match="world size \\[4\\] and are not replayed at world size 1"):
        resumed = at_four.agreed()
    assert resumed.positions() == frozenset() and len(resumed) == 1 and resumed.unreplayable == resumed.entries
    legacy = {k: v for k, v in entry.items() if k != "world_size"}  # written before entries named their world size
    assert Quarantine([legacy]).agreed().positions() == {(0, 4)}


def _loader(batch_size: int) -> DataLoader[tuple[torch.Tensor, ...]]:
    """The seven batches of ``_train_seven_steps_with_a_nan_at_step_5`` as one dataset, in order."""
    xs, ys = zip(*(batch(step, bad=step == 5) for step in range(1, 8)))
    return DataLoader(TensorDataset(torch.cat(xs), torch.cat(ys)), batch_size=batch_size)


def test_a_quarantine_recorded_at_another_batch_size_is_kept_but_not_replayed(tmp_path: Path) -> None:
    net, guard, _ = make(tmp_path)
    _train_seven_steps_with_a_nan_at_step_5(net, guard, epoch=0)
    guard.close()
    quarantine = Quarantine.read(tmp_path)
    (entry,) = quarantine.entries
    assert entry["batch"]["batch_size"] == 8
    # a plain loop resumed at the same batch size skips exactly the quarantined batch
    assert [i for i, _ in quarantine.skip(_loader(8), epoch=0)] == [0, 1, 2, 3, 5, 6]
    # at another batch size index 4 holds other samples (the bad sample is in batch 8 now): none is skipped, one warning
    with pytest.warns(RuntimeWarning, match="recorded at batch size \\[8\\] and this one holds 4") as caught:
        assert [i for i, _ in quarantine.skip(_loader(4), epoch=0)] == list(range(14))
    assert len(caught) == 1
    # the trainers say their batch size when they agree on the quarantine
    assert quarantine.agreed(batch_size=8).positions() == {(0, 4)}
    with pytest.warns(RuntimeWarning, match="recorded at batch size \\[8\\] and are not replayed at batch size 4"):
        resumed = quarantine.agreed(batch_size=4)
    assert resumed.positions() == frozenset() and resumed.unreplayable == resumed.entries
    with pytest.warns(RuntimeWarning, match="world size \\[2\\], batch size \\[8\\] and are not replayed at "
                                            "world size 1, batch size 4"):
        both = Quarantine([{**entry, "world_size": 2}]).agreed(batch_size=4)
    assert both.positions() == frozenset()
    # an entry written before entries named their batch size replays as before
    legacy = {**entry, "batch": {k: v for k, v in entry["batch"].items() if k != "batch_size"}}
    old = Quarantine([legacy]).agreed(batch_size=4)
    assert old.positions() == {(0, 4)} and [i for i, _ in old.skip(_loader(4), epoch=0)] == [*range(4), *range(5, 14)]


def test_a_short_last_batch_is_replayed_at_its_own_size(tmp_path: Path) -> None:
    """21 samples in batches of 8: the epoch's last batch holds 5, and the bad sample is in it. Resumed at batch
    size 8 that batch is skipped (it is not another layout); at batch size 4 its position holds other samples."""
    x, y = torch.randn(21, 4, generator=torch.Generator().manual_seed(3)), torch.randn(21, 1)
    x[20, 0] = float("inf")
    data = TensorDataset(x, y)
    net, guard, _ = make(tmp_path)
    for index, (bx, by) in enumerate(DataLoader(data, batch_size=8)):
        guard.zero_grad()
        ((net(bx) - by) ** 2).mean().backward()
        guard.observe_batch((bx, by), index=index, epoch=0)
        guard.step()
    guard.close()
    (entry,) = Quarantine.read(tmp_path).entries
    assert (entry["batch"]["index"], entry["batch"]["batch_size"]) == (2, 5)
    resumed = Quarantine.read(tmp_path).agreed(batch_size=8)
    assert resumed.positions() == {(0, 2)} and not resumed.unreplayable
    assert [i for i, _ in resumed.skip(DataLoader(data, batch_size=8), epoch=0)] == [0, 1]
    assert resumed.contains(2, 0, batch_size=5) and resumed.contains(2, 0)  # the size there, or not known
    with pytest.warns(RuntimeWarning, match="recorded at batch size \\[5\\] and this one holds 8"):
        assert not resumed.contains(2, 0, batch_size=8)
    with pytest.warns(RuntimeWarning, match="recorded at batch size \\[5\\] and this one holds 4"):
        skipped = Quarantine.read(tmp_path).skip(DataLoader(data, batch_size=4), epoch=0)
        assert [i for i, _ in skipped] == list(range(6))
    with pytest.warns(RuntimeWarning, match="recorded at batch size \\[5\\] and are not replayed at batch size 4"):
        assert Quarantine.read(tmp_path).agreed(batch_size=4).positions() == frozenset()
