"""The weight a log-probability is multiplied by in a policy-gradient (score-function) loss.

``-(log_prob * advantage)`` estimates the gradient of the expected return only when the advantage is a constant
for backward: ``returns - values`` left attached also backpropagates the policy objective into the value head (or
the reward model), which the value loss is meant to train alone. The step runs and the loss falls; the critic
learns a mix of two objectives and the baseline stops being one. The probe records the log-probabilities
(``Distribution.log_prob``, ``log_softmax``) the step computes and looks at each product of one with a tensor
that carries gradient.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator

import torch
import torch.distributions as distributions
import torch.nn.functional as F

from guardtower.preflight._registry import AuditContext, check, probe
from guardtower.preflight._util import patched, reached_params
from guardtower.report import Finding
from guardtower.severity import Severity

#: the products looked at
_PRODUCTS = ("__mul__", "__rmul__", "mul")
#: how far back (autograd nodes) a factor may be from the log-probability it is made of (a ratio exp(lp - old),
#: clamped, negated), and how many nodes are looked at on the way
_HOPS = 6
_NODES = 64
#: products judged per step, at most (each walks both factors' graphs)
_MAX_JUDGED = 16


@dataclass
class WeightedLogProb:
    """A log-probability multiplied by a signed tensor that carries gradient to parameters it does not reach."""

    shape: tuple[int, ...]
    """the weight's shape"""
    params: list[str]
    """the trainable tensors only the weight's gradient reaches"""


@dataclass
class LogProbRecord:
    nodes: set[Any] = field(default_factory=set)
    """the autograd nodes of the log-probabilities computed (held only while ``step_fn`` runs)"""
    judged: int = 0
    found: list[WeightedLogProb] = field(default_factory=list)


def _near(t: torch.Tensor, nodes: set[Any]) -> bool:
    """``t`` is a log-probability recorded, or made of one within a few autograd nodes."""
    frontier, seen = [t.grad_fn], 0
    for _ in range(_HOPS):
        following: list[Any] = []
        for node in frontier:
            if node is None:
                continue
            if node in nodes:
                return True
            seen += 1
            following.extend(next_fn for next_fn, _ in node.next_functions)
        if seen > _NODES or not following:
            return False
        frontier = following
    return any(node in nodes for node in frontier)


def _signed(t: torch.Tensor) -> bool:
    """Both signs present: an advantage, a TD error, a reward less a baseline (gates and probabilities are not)."""
    values = t.detach()
    return bool((values < 0).any()) and bool((values > 0).any())


@probe("logprob_weights")
@contextlib.contextmanager
def _logprob_probe(ctx: AuditContext) -> Iterator[LogProbRecord]:
    record = LogProbRecord()
    ctx.probes["logprob_weights"] = record
    trainable = {id(p) for p in ctx.params.values() if p.requires_grad}
    names = {id(p): n for n, p in ctx.params.items()}

    def recording(original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            result = original(*args, **kwargs)
            if isinstance(result, torch.Tensor) and result.grad_fn is not None:
                record.nodes.add(result.grad_fn)
            return result

        return wrapper

    def judge(a: torch.Tensor, b: torch.Tensor) -> None:
        """``a`` the log-probability side, ``b`` its weight."""
        if b.numel() < 2 or not _near(a, record.nodes) or _near(b, record.nodes) or not _signed(b):
            return
        record.judged += 1
        only = reached_params(b, trainable) - reached_params(a, trainable)
        if only:
            record.found.append(WeightedLogProb(tuple(b.shape), sorted(names[i] for i in only if i in names)))

    def product(original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def wrapper(self: Any, other: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                if (record.nodes and record.judged < _MAX_JUDGED and torch.is_grad_enabled()
                        and isinstance(self, torch.Tensor) and isinstance(other, torch.Tensor)
                        and self.requires_grad and other.requires_grad
                        and self.is_floating_point() and other.is_floating_point()):
                    judge(self, other)
                    judge(other, self)
            except Exception:  # observing must never change what the step does
                pass
            return original(self, other, *args, **kwargs)

        return wrapper

    classes = [c for c in vars(distributions).values() if inspect.isclass(c)
               and issubclass(c, distributions.Distribution) and c is not distributions.Distribution
               and "log_prob" in c.__dict__]
    patches: list[tuple[Any, str, Callable[[Any], Any]]] = [(c, "log_prob", recording) for c in classes]
    patches += [(F, "log_softmax", recording), (torch, "log_softmax", recording),
                (torch.Tensor, "log_softmax", recording)]
    patches += [(torch.Tensor, name, product) for name in _PRODUCTS] + [(torch, "mul", product)]
    try:
        with patched(patches):
            yield record
    finally:
        record.nodes.clear()  # the graph is the step's; the audit keeps no part of it


@check("logprob_weights", emits=("LOSS-018",))
def check_logprob_weights(ctx: AuditContext) -> Iterable[Finding]:
    """LOSS-018: a log-probability multiplied by a signed weight whose gradient reaches trainable tensors the
    log-probability does not (an advantage left attached to the value head)."""
    record: LogProbRecord | None = ctx.probes.get("logprob_weights")
    if record is None or not record.found:
        return []
    first = record.found[0]
    shown = ", ".join(first.params[:3]) + (f" and {len(first.params) - 3} more" if len(first.params) > 3 else "")
    return [Finding(
        "logprob_weights", Severity.WARN,
        f"a log-probability is multiplied by a weight of shape {list(first.shape)} that takes both signs and "
        f"carries gradient to {len(first.params)} trainable tensor(s) the log-probability does not reach "
        f"({shown}): the policy-gradient term also trains what computed its weight (an advantage returns - values "
        "left attached backpropagates the policy objective into the value head). Detach the weight: "
        "-(log_prob * advantage.detach()).mean()",
        "LOSS-018", {"shape": list(first.shape), "params": first.params[:8]},
    )]
