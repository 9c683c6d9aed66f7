"""Wrong types and values for every public constructor and function outside the sinks/bus/alerts/bridges
(tests/test_sinks.py, test_bus.py, test_alerts_*.py and test_bridges_*.py cover those): each must raise a
``ConfigError`` that names the argument, before anything starts. The CLI's options must give one line naming
the option and exit status 2.
"""

from __future__ import annotations

import contextlib
import io
import math
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

import guardtower
from guardtower.errors import ConfigError


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))


def _guard(**kwargs: Any) -> Any:
    model = _model()
    return guardtower.GuardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model,
                                       **{"verbose": False, **kwargs})


def _audit(**kwargs: Any) -> Any:
    model = _model()
    x = torch.randn(8, 4)
    args: dict[str, Any] = {"model": model, "step_fn": lambda: model(x).pow(2).mean(),
                            "optimizer": torch.optim.SGD(model.parameters(), lr=0.1)}
    args.update(kwargs)
    return guardtower.audit(args.pop("model"), args.pop("step_fn"), **args)


def _monitor(**kwargs: Any) -> None:
    args: dict[str, Any] = {"model": _model()}
    args.update(kwargs)
    with guardtower.monitor(args.pop("model"), **args):
        pass


def _report() -> Any:
    return guardtower.lora_summary(_model())


def _hf(name: str, **kwargs: Any) -> Any:
    from guardtower.integrations import huggingface

    return getattr(huggingface, name)(**kwargs)


def _load_run_log(path: Any) -> Any:
    from guardtower.incidents import load_run_log

    return load_run_log(path)


def _format_table(incidents: Any) -> Any:
    from guardtower.incidents import format_table

    return format_table(incidents)


@dataclass(frozen=True)
class Probe:
    id: str
    call: Callable[[], Any]
    argument: str


NAN = math.nan
_BAD_SEVERITIES: tuple[Any, ...] = ("bogus", "", True, 7, -1, 1.5, None)
PROBES = [
    # GuardedOptimizer
    Probe("guard-base-none", lambda: guardtower.GuardedOptimizer(None), "base_optimizer"),  # type: ignore[arg-type]
    Probe("guard-base-model", lambda: guardtower.GuardedOptimizer(_model()), "base_optimizer"),  # type: ignore[arg-type]
    Probe("guard-model-str", lambda: guardtower.GuardedOptimizer(torch.optim.SGD(_model().parameters(), lr=0.1),
                                                                 "net"), "model"),  # type: ignore[arg-type]
    *[Probe(f"guard-spike_threshold-{v!r}", partial(_guard, spike_threshold=v), "spike_threshold")
      for v in ("10", -1.0, 0.0, NAN, math.inf, True)],
    *[Probe(f"guard-nan_action-{v!r}", partial(_guard, nan_action=v), "nan_action")
      for v in ("bogus", None, 3, "SKIP ")],
    *[Probe(f"guard-log_every-{v!r}", partial(_guard, log_every=v), "log_every")
      for v in (0, -5, 1.5, "50", True)],
    *[Probe(f"guard-log_dir-{v!r}", partial(_guard, log_dir=v), "log_dir") for v in (123, 1.5)],
    *[Probe(f"guard-ema_alpha-{v!r}", partial(_guard, ema_alpha=v), "ema_alpha")
      for v in (0.0, 1.5, -0.1, NAN, "0.01")],
    *[Probe(f"guard-warmup_steps-{v!r}", partial(_guard, warmup_steps=v), "warmup_steps")
      for v in (-1, 1.5, "10")],
    Probe("guard-verbose-str", lambda: _guard(verbose="yes"), "verbose"),
    *[Probe(f"guard-sinks-{v!r}", partial(_guard, sinks=v), "sinks") for v in (1.5, [1], "jsonl")],
    Probe("guard-bus-str", lambda: _guard(bus="bus"), "bus"),
    *[Probe(f"guard-max_consecutive_skips-{v!r}", partial(_guard, max_consecutive_skips=v),
            "max_consecutive_skips") for v in (0, -1, 2.5)],
    Probe("guard-escalate_to-bogus", lambda: _guard(escalate_to="bogus"), "escalate_to"),
    *[Probe(f"guard-rollback_every-{v!r}", partial(_guard, rollback_every=v), "rollback_every")
      for v in (0, -1, 1.5)],
    *[Probe(f"guard-keep-{v!r}", partial(_guard, keep=v), "keep") for v in (0, -1, "2")],
    Probe("guard-on_rollback-int", lambda: _guard(on_rollback=3), "on_rollback"),
    Probe("guard-detector-bogus", lambda: _guard(detector="bogus"), "detector"),
    Probe("guard-run-int", lambda: _guard(run=3), "run"),
    *[Probe(f"guard-process_group-{v!r}", partial(_guard, process_group=v), "process_group") for v in ("gloo", 0, [])],
    # audit()
    Probe("audit-model-str", lambda: _audit(model="model"), "model"),
    Probe("audit-step_fn-int", lambda: _audit(step_fn=3), "step_fn"),
    Probe("audit-optimizer-str", lambda: _audit(optimizer="adam"), "optimizer"),
    *[Probe(f"audit-checks-{v!r}", partial(_audit, checks=v), "checks") for v in ("bogus", 5, ["loss", 3], [])],
    Probe("audit-scaler-str", lambda: _audit(scaler="scaler"), "scaler"),
    Probe("audit-lr_scheduler-int", lambda: _audit(lr_scheduler=3), "lr_scheduler"),
    Probe("audit-sinks-float", lambda: _audit(sinks=1.5), "sinks"),
    Probe("audit-bus-str", lambda: _audit(bus="bus"), "bus"),
    # lora_summary()
    Probe("lora_summary-model-int", lambda: guardtower.lora_summary(3), "model"),  # type: ignore[arg-type]
    Probe("lora_summary-optimizer-str", lambda: guardtower.lora_summary(_model(), optimizer="adam"),  # type: ignore[arg-type]
          "optimizer"),
    # monitor()
    Probe("monitor-model-str", lambda: _monitor(model="model"), "model"),
    *[Probe(f"monitor-on_nonfinite-{v!r}", partial(_monitor, on_nonfinite=v), "on_nonfinite")
      for v in ("bogus", None, 1)],
    Probe("monitor-sinks-float", lambda: _monitor(sinks=1.5), "sinks"),
    Probe("monitor-bus-int", lambda: _monitor(bus=3), "bus"),
    # Report
    Probe("report-by_id-int", lambda: _report().by_id(3), "catalog_id"),
    Probe("report-by_id-unknown", lambda: _report().by_id("NOPE-999"), "catalog_id"),
    Probe("report-by_check-int", lambda: _report().by_check(3), "name"),
    # Hugging Face callbacks
    Probe("hf-audit-raise_on_error-str", lambda: _hf("GuardtowerCallback", raise_on_error="yes"), "raise_on_error"),
    *[Probe(f"hf-audit-checks-{v!r}", partial(_hf, "GuardtowerCallback", checks=v), "checks") for v in (5, "bogus")],
    Probe("hf-audit-verbose-str", lambda: _hf("GuardtowerCallback", verbose="x"), "verbose"),
    Probe("hf-audit-sinks-float", lambda: _hf("GuardtowerCallback", sinks=1.5), "sinks"),
    Probe("hf-audit-bus-int", lambda: _hf("GuardtowerCallback", bus=3), "bus"),
    Probe("hf-guard-spike_threshold", lambda: _hf("StabilityGuardCallback", spike_threshold=-1.0), "spike_threshold"),
    Probe("hf-guard-nan_action", lambda: _hf("StabilityGuardCallback", nan_action="bogus"), "nan_action"),
    Probe("hf-guard-clip_in_guard", lambda: _hf("StabilityGuardCallback", clip_in_guard="x"), "clip_in_guard"),
    Probe("hf-guard-sinks-float", lambda: _hf("StabilityGuardCallback", sinks=1.5), "sinks"),
    Probe("hf-guard-log_every", lambda: _hf("StabilityGuardCallback", log_every=0), "log_every"),
    Probe("hf-guard-unknown-kwarg", lambda: _hf("StabilityGuardCallback", spike_treshold=3.0), "spike_treshold"),
    # severity, report reading
    *[Probe(f"severity-parse-{v!r}", partial(guardtower.Severity.parse, v), "severity")
      for v in _BAD_SEVERITIES],
    Probe("severity-parse-named", lambda: guardtower.Severity.parse("x", "min_severity"), "min_severity"),
    *[Probe(f"load_run_log-{v!r}", partial(_load_run_log, v), "path") for v in (123, None, "/no/such/dir")],
    *[Probe(f"format_table-{v!r}", partial(_format_table, v), "incidents") for v in ([1, 2], 5, "x")],
]

@pytest.mark.parametrize("probe", PROBES, ids=[p.id for p in PROBES])
def test_bad_argument_is_a_config_error_naming_it(probe: Probe) -> None:
    with pytest.raises(ConfigError) as caught:
        probe.call()
    assert caught.value.argument == probe.argument or probe.argument in str(caught.value).split(":")[0], (
        f"{probe.id}: the error names {caught.value.argument!r}, not {probe.argument!r}: {caught.value}")
    assert "Fix:" in str(caught.value)


def test_a_rejected_guard_leaves_no_trace(tmp_path: Path) -> None:
    model = _model()
    base = torch.optim.SGD(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ConfigError):
        guardtower.GuardedOptimizer(base, model, spike_threshold=-1.0, log_dir=tmp_path / "logs")
    assert not (tmp_path / "logs").exists()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert base.state == {} and len(base.param_groups) == 1


# ------------------------------------------------------------------------------------------------ CLI
def _cli(*argv: str) -> tuple[int, str]:
    from guardtower.cli import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = main(list(argv))
        except SystemExit as exit_:
            code = int(exit_.code or 0)
    return code, err.getvalue()


@pytest.mark.parametrize(("argv", "named"), [
    (["events", "{log}", "--min-severity", "bogus"], "--min-severity"),
    (["events", "{log}", "--kind", "bogus"], "--kind"),
    (["events"], "path"),
    (["report"], "path"),
    (["report", "{log}", "--bogus"], "--bogus"),
    (["replay"], "SPOOL"),
    (["demo", "--steps", "abc"], "--steps"),
    (["demo", "--steps", "5"], "--steps"),
    (["bogus-command"], "bogus-command"),
    (["catalog", "--yaml"], "--yaml"),
], ids=lambda value: "-".join(value) if isinstance(value, list) else None)
def test_bad_cli_arguments_are_one_line_naming_the_option(tmp_path: Path, argv: list[str], named: str) -> None:
    log = tmp_path / "events.jsonl"
    log.write_text('{"kind": "summary", "step": 1, "grad_norm": 1.0}\n')
    code, err = _cli(*[a.replace("{log}", str(log)) for a in argv])
    assert code == 2
    assert len(err.strip().splitlines()) == 1 and named in err, err


# ------------------------------------------------------------------- the fuzz: every public constructor
def _constructors(tmp: Path) -> dict[str, tuple[Callable[..., Any], dict[str, Any]]]:
    """Every public constructor with the arguments it needs to succeed (the fuzz varies one at a time)."""
    from guardtower.alerts import DiscordAlert, GroupPolicy, PagerDutyAlert, RetryPolicy, SlackAlert, TeamsAlert, \
        WebhookAlert
    from guardtower.bridges import MLflowBridge, TensorBoardBridge, WandBBridge
    from guardtower.integrations import huggingface, lightning

    model = _model()
    url = "http://127.0.0.1:9/hook/T0"
    alert = {"spool_path": tmp / "spool.jsonl"}
    return {
        "GuardedOptimizer": (guardtower.GuardedOptimizer,
                             {"base_optimizer": torch.optim.SGD(model.parameters(), lr=0.1), "model": model,
                              "log_dir": tmp / "logs", "verbose": False}),
        "EventBus": (guardtower.EventBus, {}),
        "JsonlSink": (guardtower.JsonlSink, {"path": tmp / "events.jsonl"}),
        "ConsoleSink": (guardtower.ConsoleSink, {}),
        "WebhookAlert": (WebhookAlert, {"url": url, **alert}),
        "SlackAlert": (SlackAlert, {"url": url, **alert}),
        "DiscordAlert": (DiscordAlert, {"url": url, **alert}),
        "TeamsAlert": (TeamsAlert, {"url": url, **alert}),
        "PagerDutyAlert": (PagerDutyAlert, {"routing_key": "R0123456789", "url": url, **alert}),
        "GroupPolicy": (GroupPolicy, {}),
        "RetryPolicy": (RetryPolicy, {}),
        "MLflowBridge": (MLflowBridge, {"run_id": "0123456789abcdef", "tracking_uri": "http://127.0.0.1:9",
                                        "spool_path": tmp / "mlflow.jsonl"}),
        "TensorBoardBridge": (TensorBoardBridge, {"log_dir": tmp / "tb"}),
        "WandBBridge": (WandBBridge, {}),
        "hf.GuardtowerCallback": (huggingface.GuardtowerCallback, {}),
        "hf.StabilityGuardCallback": (huggingface.StabilityGuardCallback, {"log_dir": tmp / "hf"}),
        "lightning.GuardtowerPreflight": (lightning.GuardtowerPreflight, {}),
        "lightning.GuardtowerGuard": (lightning.GuardtowerGuard, {"log_dir": tmp / "pl"}),
    }


_PATHS = ("path", "log_dir", "spool_path")


def _bad_values(name: str, default: Any) -> list[Any]:
    """Values no constructor may accept for a parameter of this name and default."""
    if name in _PATHS:
        return ["", "   ", "bad\x00path", 123]
    if name in ("run", "run_id", "name", "prefix", "source", "tracking_uri"):
        return ["", 123]
    if isinstance(default, bool):
        return ["yes", 1]
    if isinstance(default, (int, float)):
        return ["abc", math.nan]
    return []


def _fuzz_cases() -> list[tuple[str, str, Any]]:
    import inspect

    cases = []
    for cls_name, (cls, _) in _constructors(Path("/nonexistent-probe")).items():
        for p in inspect.signature(cls).parameters.values():
            if p.kind in (p.VAR_KEYWORD, p.VAR_POSITIONAL):
                continue
            default = p.default if p.default is not p.empty else None
            for value in _bad_values(p.name, default):
                cases.append((cls_name, p.name, value))
    return cases


@pytest.mark.parametrize("cls_name,argument,value", _fuzz_cases(), ids=lambda v: repr(v)[:40])
def test_every_public_constructor_refuses_nonsense_naming_the_argument(tmp_path: Path, cls_name: str, argument: str,
                                                                       value: Any) -> None:
    cls, good = _constructors(tmp_path)[cls_name]
    with pytest.raises(ConfigError) as caught:
        cls(**{**good, argument: value})
    assert caught.value.argument == argument, f"{cls_name}({argument}={value!r}): {caught.value}"
    assert not any(tmp_path.iterdir()), "a rejected constructor left files behind"


def test_the_fuzz_walks_every_public_sink_and_option() -> None:
    names = set(_constructors(Path("/nonexistent-probe")))
    assert {"GuardedOptimizer", "JsonlSink", "MLflowBridge", "TensorBoardBridge", "PagerDutyAlert",
            "hf.StabilityGuardCallback", "lightning.GuardtowerGuard"} <= names
    assert len(_fuzz_cases()) > 100
