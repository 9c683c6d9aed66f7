"""What ``GuardedOptimizer`` checks before it changes anything: its parameters and a state dict to load."""

from __future__ import annotations

from typing import Any, Mapping

import torch
from torch import Tensor

from guardtower.errors import ConfigError
from guardtower.guard.detector import Detector

__all__ = ["check_params", "decision_device", "check_base_state", "check_guard_state"]

_COUNTERS = ("step_count", "total_spikes", "total_skips", "total_rollbacks")
_OPTIONAL_COUNTERS = ("total_overflows", "total_clips", "consecutive_rejections", "total_level_shifts")
_FIX = "load a state dict saved by GuardedOptimizer.state_dict() for the same model, optimizer and detector"


def check_params(params: list[Tensor], names: list[str]) -> None:
    """Parameters the guard can measure: real storage (not the meta device)."""
    for p, name in zip(params, names):
        if p.device.type == "meta":
            raise ConfigError("base_optimizer", f"parameter {name!r} is on the meta device (it has no data)",
                              "materialize the model first (e.g. model.to_empty(device=...) then load its weights)")


def decision_device(params: list[Tensor]) -> torch.device:
    """Where the guard decides: the first accelerator holding a parameter, else the CPU."""
    for p in params:
        if p.device.type != "cpu":
            return p.device
    return torch.device("cpu")


def check_base_state(state: Mapping[str, Any], base: torch.optim.Optimizer) -> None:
    """The layout torch's ``Optimizer.load_state_dict`` needs, matching ``base``'s parameter groups."""
    groups = state.get("param_groups")
    if not isinstance(state.get("state"), Mapping) or not isinstance(groups, list):
        raise ConfigError("state_dict", "is not an optimizer state dict (needs 'state' and 'param_groups')",
                          "pass the dict returned by optimizer.state_dict()")
    if len(groups) != len(base.param_groups):
        raise ConfigError("state_dict", f"has {len(groups)} parameter groups, the optimizer has "
                          f"{len(base.param_groups)}", _FIX)
    for i, (saved, own) in enumerate(zip(groups, base.param_groups)):
        if not isinstance(saved, Mapping) or not isinstance(saved.get("params"), list):
            raise ConfigError("state_dict", f"parameter group {i} has no 'params' list", _FIX)
        if len(saved["params"]) != len(own["params"]):
            raise ConfigError("state_dict", f"parameter group {i} has {len(saved['params'])} parameters, "
                              f"the optimizer's has {len(own['params'])}", _FIX)
    # per-parameter state (momentum, Adam moments) must have the shape of its parameter, or the next step
    # fails with a raw RuntimeError, long after the load
    param_of = {saved_id: own_p for saved, own in zip(groups, base.param_groups)
                for saved_id, own_p in zip(saved["params"], own["params"])}
    for saved_id, entry in state["state"].items():
        param = param_of.get(saved_id)
        if param is None or not isinstance(entry, Mapping):
            continue
        for key, value in entry.items():
            if isinstance(value, Tensor) and value.dim() > 0 and value.shape != param.shape:
                raise ConfigError("state_dict", f"state {key!r} of parameter {saved_id} has shape "
                                  f"{tuple(value.shape)}, the parameter has {tuple(param.shape)}", _FIX)


def check_guard_state(guard: Any, detector: Detector) -> dict[str, int]:
    """Validate the ``"guardtower"`` section; returns its counters. Raises before anything is applied."""
    if not isinstance(guard, Mapping):
        raise ConfigError("state_dict", f"its 'guardtower' entry is a {type(guard).__name__}, not a dict", _FIX)
    if guard.get("version") != 1:
        raise ConfigError("state_dict", f"guard state version {guard.get('version')!r} is not supported", _FIX)
    counters: dict[str, int] = {}
    for key in _COUNTERS + _OPTIONAL_COUNTERS:
        value = guard.get(key, 0 if key in _OPTIONAL_COUNTERS else None)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ConfigError("state_dict", f"guard state {key!r} must be a non-negative int, got {value!r}", _FIX)
        counters[key] = value
    saved = guard.get("detector")
    current = detector.state_dict()
    if not isinstance(saved, Mapping):
        raise ConfigError("state_dict", "guard state has no 'detector' section", _FIX)
    if saved.get("name") != current["name"] or saved.get("n") != current["n"]:
        raise ConfigError(
            "state_dict",
            f"guard state is for detector {saved.get('name')!r} over {saved.get('n')} tensors; this guard uses "
            f"{current['name']!r} over {current['n']}", _FIX)
    _same_layout(saved, current, "detector")
    detector.check_state_dict(dict(saved))  # the detector's own rules (finite baselines), before anything changes
    return counters


def _same_layout(saved: Any, current: Any, where: str) -> None:
    """``saved`` has every entry ``current`` has, with the same kinds of values and tensor shapes."""
    if isinstance(current, Tensor):
        if not isinstance(saved, Tensor) or saved.shape != current.shape:
            got = tuple(saved.shape) if isinstance(saved, Tensor) else type(saved).__name__
            raise ConfigError("state_dict", f"guard state {where} should be a tensor of shape "
                              f"{tuple(current.shape)}, got {got}", _FIX)
    elif isinstance(current, Mapping):
        if not isinstance(saved, Mapping):
            raise ConfigError("state_dict", f"guard state {where} should be a dict, got {type(saved).__name__}", _FIX)
        for key, value in current.items():
            if key not in saved:
                raise ConfigError("state_dict", f"guard state {where} lacks {key!r} (truncated?)", _FIX)
            _same_layout(saved[key], value, f"{where}.{key}")
    elif isinstance(current, (int, float)) and not isinstance(current, bool):
        if not isinstance(saved, (int, float)) or isinstance(saved, bool):
            raise ConfigError("state_dict", f"guard state {where} should be a number, got {saved!r}", _FIX)


def check_process_group(group: Any) -> None:
    """``process_group`` is None or a ``torch.distributed`` group: caught now, not at the first step's all-reduce."""
    if group is None:
        return
    import torch.distributed as dist

    cls = getattr(dist, "ProcessGroup", None)
    if cls is not None and isinstance(group, cls):
        return
    raise ConfigError("process_group", f"expected a torch.distributed ProcessGroup or None, got {type(group).__name__}",
                      "pass dist.new_group(...) or None for the default group")
