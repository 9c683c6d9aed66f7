"""audit()/run_static() contract: arguments, check selection, events, crashing checks, clean real models."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import guardtower
from guardtower.preflight import _registry, audit, run_static
from guardtower.bus import EventBus
from guardtower.failure_modes import CATALOG
from guardtower.errors import ConfigError, PreflightFailed
from guardtower.events import FindingEvent, PreflightEvent
from guardtower.report import Finding
from guardtower.severity import Severity
from guardtower.testing import InMemorySink, capture_events

from tests._audit_core_helpers import SmallCNN, bert_mlm, gpt2, llama, mlp, regression_batch, token_batch

X, Y = regression_batch()


def _mlp_step() -> tuple[nn.Module, Any]:
    m = mlp()
    return m, lambda: F.mse_loss(m(X), Y)


# --- bad input ------------------------------------------------------------------------------------------------
def test_model_must_be_a_module() -> None:
    with pytest.raises(ConfigError, match="model: expected a torch.nn.Module"):
        audit(lambda x: x, lambda: torch.zeros(()))  # type: ignore[arg-type]


def test_step_fn_must_be_callable() -> None:
    m, step = _mlp_step()
    with pytest.raises(ConfigError, match="step_fn") as err:
        audit(m, step())  # called it instead of passing it
    assert err.value.argument == "step_fn"


def test_optimizer_must_be_an_optimizer() -> None:
    m, step = _mlp_step()
    with pytest.raises(ConfigError, match="optimizer"):
        audit(m, step, optimizer=m.parameters())  # type: ignore[arg-type]


@pytest.mark.parametrize("checks", ["los", ["loss", "grad_norm"], ("nonsense",)])
def test_unknown_check_names_list_the_valid_ones(checks: Any) -> None:
    m, step = _mlp_step()
    with pytest.raises(ConfigError) as err:
        audit(m, step, checks=checks)
    assert "grad_connectivity" in str(err.value) and "loss" in str(err.value)


def test_bad_arguments_change_nothing() -> None:
    m, step = _mlp_step()
    before = [p.detach().clone() for p in m.parameters()]
    with pytest.raises(ConfigError):
        audit(m, step, checks="bogus")
    assert all(torch.equal(a, b) for a, b in zip(before, m.parameters()))
    assert all(p.grad is None for p in m.parameters())


@pytest.mark.parametrize("returned", [3.14, None, {"logits": torch.zeros(2)}])
def test_step_returning_no_loss_tensor_is_a_finding(returned: Any) -> None:
    m = mlp()
    report = audit(m, lambda: returned)
    (finding,) = report.by_id("LOSS-007")
    assert finding.severity is Severity.ERROR and not report.ok


def test_a_step_that_runs_backward_and_returns_loss_item_is_judged_by_its_gradients() -> None:
    m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    x, y = torch.randn(16, 8), torch.arange(16) % 3

    def step(cut: bool) -> float:
        opt.zero_grad()
        hidden = m[1](m[0](x))
        loss = F.cross_entropy(m[2](hidden.detach() if cut else hidden), y)
        loss.backward()
        opt.step()
        return loss.item()  # what most loops log

    report = audit(m, lambda: step(False), optimizer=opt)
    (finding,) = report.by_id("LOSS-007")
    assert finding.severity is Severity.INFO and report.ok, str(report)
    silent = audit(m, lambda: [step(False)] and None, optimizer=opt)  # a loop that returns nothing at all
    (finding,) = silent.by_id("LOSS-007")
    assert finding.severity is Severity.INFO and "returned nothing" in finding.message and silent.ok, str(silent)
    (cut,) = audit(m, lambda: step(True), optimizer=opt).by_id("GRAD-001")  # the gradients are still judged
    assert cut.severity is Severity.ERROR and cut.details["params"] == ["0.weight", "0.bias"]
    nan = audit(m, lambda: step(False) * float("nan"), optimizer=opt)
    assert nan.by_id("LOSS-003") and not nan.ok


def test_a_sparse_embedding_trained_by_its_own_sparse_optimizer_is_audited_quietly() -> None:
    torch.manual_seed(0)
    bag, head = nn.EmbeddingBag(100, 8, mode="mean", sparse=True), nn.Linear(8, 2)
    m = nn.ModuleDict({"bag": bag, "head": head})
    sparse, dense = torch.optim.SparseAdam(list(bag.parameters()), lr=1e-2), torch.optim.Adam(head.parameters())
    ids, offsets = torch.randint(0, 100, (20,), generator=torch.Generator().manual_seed(0)), torch.tensor([0, 5, 9, 15])

    def step() -> torch.Tensor:
        sparse.zero_grad()
        dense.zero_grad()
        loss = F.cross_entropy(head(bag(ids, offsets)), torch.tensor([0, 1, 0, 1]))
        loss.backward()
        sparse.step()
        dense.step()
        return loss

    report = audit(m, step, optimizer=dense, inputs=(ids, offsets))
    assert not [f for f in report if f.severity >= Severity.WARN], str(report)


def test_closure_raising_names_the_exception_and_location() -> None:
    m = mlp()

    def step() -> torch.Tensor:
        return F.mse_loss(m(X[:, :5]), Y)  # wrong feature count

    report = audit(m, step)
    (finding,) = report.by_id("LOSS-006")
    assert finding.details["exception"] == "RuntimeError" and finding.details["phase"] == "step_fn"
    assert "mat1 and mat2" in finding.message
    assert report.status == "FAIL"
    with pytest.raises(PreflightFailed) as err:
        report.raise_if_errors()
    assert err.value.report is report


def test_backward_raising_is_reported_as_backward_phase() -> None:
    m = nn.Sequential(nn.Linear(8, 8), nn.Sigmoid())

    def step() -> torch.Tensor:
        h = m(X)
        h.mul_(2)  # in-place on a tensor sigmoid saved for backward
        return h.sum()

    (finding,) = audit(m, step).by_id("LOSS-006")
    assert finding.details["phase"] == "backward"


# --- check selection ------------------------------------------------------------------------------------------
def test_single_check_and_iterable_selection() -> None:
    m, step = _mlp_step()
    assert audit(m, step, checks="loss").checks_run == ["loss"]
    assert audit(m, step, checks=("grad_norms", "loss", "loss")).checks_run == ["grad_norms", "loss"]


def test_all_runs_every_registered_check() -> None:
    m, step = _mlp_step()
    assert audit(m, step).checks_run == sorted(_registry.CHECKS)  # name order, whatever registered first


def test_contract_check_names_are_registered() -> None:
    core = {"loss", "input_dependency", "grad_connectivity", "optimizer_coverage", "frozen", "weight_tying",
            "grad_norms", "nonfinite", "dead_relu", "train_mode", "device_dtype", "mixed_precision"}
    assert core <= set(_registry.CHECKS)


# --- crashing or misbehaving checks ---------------------------------------------------------------------------
def test_check_emitting_an_unknown_catalog_id_becomes_audit_001(monkeypatch: pytest.MonkeyPatch) -> None:
    def sloppy(ctx: _registry.AuditContext) -> list[Finding]:
        return [Finding("sloppy", Severity.WARN, "made-up", "NOPE-999")]

    monkeypatch.setitem(_registry.CHECKS, "sloppy", _registry.CheckSpec("sloppy", sloppy, False))
    m, step = _mlp_step()
    report = audit(m, step, checks=["sloppy", "loss"])
    (finding,) = report.by_id("AUDIT-001")
    assert finding.check == "sloppy" and "NOPE-999" in finding.message
    assert all(f.catalog_id != "NOPE-999" for f in report)


def test_check_emitting_an_id_it_did_not_declare_becomes_audit_001(monkeypatch: pytest.MonkeyPatch) -> None:
    def overreach(ctx: _registry.AuditContext) -> list[Finding]:
        return [Finding("overreach", Severity.WARN, "not mine", "GRAD-002")]

    monkeypatch.setitem(_registry.CHECKS, "overreach",
                        _registry.CheckSpec("overreach", overreach, False, emits=frozenset({"GRAD-003"})))
    m, step = _mlp_step()
    (finding,) = audit(m, step, checks=["overreach"]).by_id("AUDIT-001")
    assert finding.check == "overreach" and "GRAD-002" in finding.message and "emits=" in finding.message


def test_a_step_that_raises_is_reported_whatever_checks_were_chosen() -> None:
    m = mlp()

    def step() -> torch.Tensor:
        raise KeyError("labels")

    report = audit(m, step, checks="grad_norms")
    assert report.checks_run == ["grad_norms", "loss"] and [f.catalog_id for f in report] == ["LOSS-006"]


def test_only_the_measurements_the_chosen_checks_need_are_taken(monkeypatch: pytest.MonkeyPatch) -> None:
    from guardtower.preflight import _runner

    calls: list[str] = []
    real = _runner.measure_update
    monkeypatch.setattr(_runner, "measure_update", lambda ctx: calls.append("update") or real(ctx))
    m, step = _mlp_step()
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    audit(m, step, optimizer=opt, checks="grad_norms")
    assert calls == []
    audit(m, step, optimizer=opt, checks="update_ratio")  # declares needs=("update",)
    assert calls == ["update"]


def test_no_crash_means_no_audit_001() -> None:
    m, step = _mlp_step()
    assert not audit(m, step).by_id("AUDIT-001")


# --- events ---------------------------------------------------------------------------------------------------
def test_publishes_one_finding_event_per_finding_and_a_preflight() -> None:
    m = SmallCNN()
    x = torch.randn(4, 3, 8, 8)
    m.eval()
    with capture_events() as events:
        report = audit(m, lambda: F.cross_entropy(m(x), torch.arange(4) % 5))
    findings = [e for e in events if isinstance(e, FindingEvent)]
    preflights = [e for e in events if isinstance(e, PreflightEvent)]
    assert [(e.check, e.catalog_id) for e in findings] == [(f.check, f.catalog_id) for f in report.findings]
    assert findings and all(e.severity == f.severity for e, f in zip(findings, report.findings))
    (pre,) = preflights
    assert pre.status == report.status and pre.warnings == len(report.warnings)
    assert "MODE-001" in pre.warning_ids and pre.report == report.to_dict()
    assert events[-1] is pre


def test_sinks_receive_events_before_audit_returns() -> None:
    sink = InMemorySink()
    m = mlp()
    report = audit(m, lambda: torch.tensor(F.mse_loss(m(X), Y).item()), sinks=[sink])
    kinds = [e.kind for e in sink.events]
    assert kinds.count("finding") == len(report.findings) and kinds[-1] == "preflight"
    assert sink.of_kind("preflight")[0].error_ids == ("LOSS-001",)


def test_a_given_bus_is_used_and_left_open() -> None:
    sink = InMemorySink()
    bus = EventBus([sink])
    m, step = _mlp_step()
    audit(m, step, bus=bus)
    assert bus.flush(5) and not bus.stats()["closed"]
    assert [e.kind for e in sink.events] == ["preflight"]
    bus.close(5)


def test_bad_bus_is_a_config_error() -> None:
    m, step = _mlp_step()
    with pytest.raises(ConfigError, match="bus"):
        audit(m, step, bus="wandb")  # type: ignore[arg-type]


# --- static runner (used by lora_summary) ---------------------------------------------------------------------
def test_run_static_runs_static_checks_without_a_forward() -> None:
    m = gpt2()
    m.lm_head = nn.Linear(32, m.config.vocab_size, bias=False)
    opt = torch.optim.Adam(m.transformer.parameters(), lr=1e-3)
    calls = []
    handle = m.register_forward_pre_hook(lambda *a: calls.append(1))
    report = run_static(m, opt)
    handle.remove()
    assert not calls
    assert {f.catalog_id for f in report.findings} >= {"OPT-001", "TIE-002"}
    assert set(report.checks_run) == {n for n, s in _registry.CHECKS.items() if s.static}


def test_run_static_rejects_dynamic_check_names() -> None:
    with pytest.raises(ConfigError, match="static check"):
        run_static(mlp(), checks=["grad_norms"])


# --- clean real models: no false alarms -----------------------------------------------------------------------
def _hf_case(build: Any) -> tuple[nn.Module, Any, torch.optim.Optimizer]:
    m = build()
    batch = token_batch(pad_last=3)
    if m.config.model_type == "bert":  # masked-LM: predict masked tokens (a label on every visible one is a copy task)
        labels = torch.full_like(batch["labels"], -100)
        labels[:, ::3] = batch["input_ids"][:, ::3]
        labels[batch["attention_mask"] == 0] = -100
        batch = {**batch, "input_ids": batch["input_ids"].clone(), "labels": labels}
        batch["input_ids"][:, ::3] = 3
    decay = [p for p in m.parameters() if p.dim() >= 2]
    rest = [p for p in m.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay}, {"params": rest, "weight_decay": 0.0}], lr=3e-4)
    return m, lambda: m(**batch), opt


@pytest.mark.parametrize("family", ["gpt2", "llama", "bert"])
def test_clean_transformers_have_no_warnings(family: str) -> None:
    build = {"gpt2": gpt2, "llama": llama, "bert": bert_mlm}[family]
    m, step, opt = _hf_case(build)
    report = audit(m, step, optimizer=opt)
    assert report.ok and not report.warnings, str(report)
    assert {f.catalog_id for f in report.infos} <= {"TIE-001"}


def test_clean_cnn_with_batchnorm_has_no_warnings() -> None:
    m = SmallCNN()
    x = torch.randn(8, 3, 8, 8)
    opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
    report = audit(m, lambda: F.cross_entropy(m(x), torch.arange(8) % 5), optimizer=opt)
    assert report.ok and not report.warnings, str(report)


def test_public_audit_is_callable_whichever_import_came_first() -> None:
    import guardtower.preflight as preflight_package
    import guardtower.preflight.lora  # noqa: F401  (a submodule import must not rebind guardtower.audit)

    m, step = _mlp_step()
    for fn in (guardtower.audit, preflight_package.audit, audit):
        report = fn(m, step, checks="loss")
        assert report.checks_run == ["loss"] and all(f.catalog_id in CATALOG for f in report.findings)


def test_in_place_relu_does_not_distort_what_was_measured(monkeypatch: pytest.MonkeyPatch) -> None:
    """The Linear before an nn.ReLU(inplace=True) is measured before the ReLU overwrites its output."""
    seen: dict[str, Any] = {}

    def spy(ctx: _registry.AuditContext) -> list[Finding]:
        seen["record"] = ctx.probes["activations"]
        return []

    monkeypatch.setitem(_registry.CHECKS, "spy", _registry.CheckSpec("spy", spy, False))
    m = mlp()
    with torch.no_grad():
        m[0].bias.fill_(-50.0)  # every pre-activation strongly negative
    report = audit(m, lambda: F.mse_loss(m(X), Y), checks=["spy", "dead_relu"])
    record = seen["record"]
    assert record.max_abs["0"] > 40.0  # the negative pre-activations, not the zeros the ReLU wrote over them
    assert record.max_abs["1"] == 0.0
    assert record.dead["1"] == (32, 32)
    assert report.by_id("RELU-001")[0].details["modules"] == ["1"]


def test_a_hanging_sink_delays_the_audit_by_the_flush_bound_only(monkeypatch: pytest.MonkeyPatch) -> None:
    import threading
    import time

    from guardtower.preflight import _runner
    from guardtower.bus import BaseSink

    release = threading.Event()

    class Hanging(BaseSink):
        name = "hanging"
        rank_zero_only = False

        def handle(self, event: Any) -> None:
            release.wait(30)

    monkeypatch.setattr(_runner, "FLUSH_TIMEOUT_S", 3.0)
    m, step = _mlp_step()
    start = time.monotonic()
    audit(m, step)
    baseline = time.monotonic() - start
    start = time.monotonic()
    report = audit(m, step, sinks=[Hanging()])
    added = time.monotonic() - start - baseline
    release.set()
    assert report.status == "PASS"
    assert 2.5 < added < 4.5  # one 3 s bound for flush + close together, not 3 s each


# --- the seed's API -----------------------------------------------------------------------------------------
def test_every_module_of_the_package_imports_by_its_dotted_path() -> None:
    import importlib
    import pkgutil

    optional = ("guardtower.integrations.", "guardtower.bridges.")  # need their extras, installed here
    names = [m.name for m in pkgutil.walk_packages(guardtower.__path__, "guardtower.") if m.name != "guardtower.__main__"]
    assert "guardtower.preflight.lora" in names and "guardtower.nonfinite_watch" in names
    for name in names:
        module = importlib.import_module(name)
        assert module.__name__ == name, name
        if not name.startswith(optional):
            assert callable(guardtower.audit) and callable(guardtower.monitor) and callable(guardtower.catalog)
    public = {n for n in guardtower.__all__ if callable(getattr(guardtower, n))}
    clashing = [n for n in names if n.rsplit(".", 1)[-1] in public]
    assert not clashing, f"modules named like a public function: {clashing}"


def test_catalog_is_a_function_after_every_import() -> None:
    import guardtower.failure_modes  # noqa: F401

    entries = guardtower.catalog()
    assert [m.id for m in entries] == sorted(CATALOG) and all(isinstance(m, guardtower.FailureMode) for m in entries)


def test_a_report_iterates_and_counts_its_findings_and_has_no_truth_value() -> None:
    m, _ = _mlp_step()
    report = audit(m, lambda: F.mse_loss(m(X), Y).detach())
    assert len(report) == len(report.findings) >= 1
    assert list(report) == report.findings and [f.catalog_id for f in report if f.severity is Severity.ERROR]
    with pytest.raises(TypeError, match="report.ok"):
        bool(report)
    with pytest.raises(TypeError, match="report.ok"):
        assert report


def test_by_id_rejects_an_id_that_is_not_in_the_catalog() -> None:
    m, step = _mlp_step()
    report = audit(m, step)
    assert report.by_id("GRAD-001") == []  # a real id that did not fire
    with pytest.raises(ConfigError, match="catalog_id") as err:
        report.by_id("GRAD-999")
    assert "GRAD-001" in str(err.value)


def test_frozen_parameters_are_reported_as_info_and_do_not_fail() -> None:
    m = mlp()
    first = next(m.parameters())
    first.requires_grad_(False)
    opt = torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.01)
    report = audit(m, lambda: F.mse_loss(m(X), Y), optimizer=opt)
    (frozen,) = report.by_check("frozen")
    assert frozen.catalog_id == "OPT-006" and frozen.severity is Severity.INFO
    assert frozen.details["count"] == 1 and "frozen" in frozen.message
    assert report.ok and not report.warnings, str(report)


def test_nothing_frozen_means_no_frozen_finding() -> None:
    m, step = _mlp_step()
    assert audit(m, step, optimizer=torch.optim.SGD(m.parameters(), lr=0.01)).by_check("frozen") == []


def test_a_torch_compiled_model_is_audited_without_a_false_step_failure() -> None:
    m = mlp()
    compiled = torch.compile(m, backend="eager")  # dynamo tracing, no code generation: cheap on CPU
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    report = audit(compiled, lambda: F.mse_loss(compiled(X), Y), optimizer=opt)
    assert report.ok and not report.by_id("LOSS-006"), str(report)
    half = torch.optim.SGD(list(m.parameters())[:2], lr=0.01)  # the same model with a real bug is still caught
    assert audit(compiled, lambda: F.mse_loss(compiled(X), Y), optimizer=half).by_id("OPT-001")
    m.eval()  # no dropout: the compiled and the eager model must agree
    assert torch.equal(compiled(X), m(X))  # and it still runs afterwards


def test_step_fn_is_called_once_and_a_second_call_is_explained() -> None:
    m, step = _mlp_step()
    drawn: list[int] = []

    def counted() -> torch.Tensor:
        drawn.append(1)  # a step that draws next(iterator) would consume a batch here
        return step()

    report = audit(m, counted, optimizer=torch.optim.SGD(m.parameters(), lr=0.01))
    assert len(drawn) == report.step_fn_calls == 1 and report.notes == []
    ignored = mlp()
    drawn.clear()
    report = audit(ignored, lambda: drawn.append(1) or F.mse_loss(ignored(torch.zeros_like(X)) * 0 + Y.mean(), Y),
                   inputs=X)
    assert report.step_fn_calls == len(drawn) >= 2 and len(report.notes) == report.step_fn_calls - 1  # one note each
    assert any("inputs=" in note for note in report.notes) and report.by_id("INPUT-001")
    assert report.to_dict()["step_fn_calls"] == report.step_fn_calls and "note:" in str(report)
