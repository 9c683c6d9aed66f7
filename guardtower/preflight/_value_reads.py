"""Whether the loss reads the values of gradient-less trainable parameters.

A parameter that took part in the step with autograd on and got no gradient was either cut from the graph (its
module's output used through ``detach()``, ``torch.tensor(...)``, ``.item()``: the loss depends on it, yet no
gradient can flow back) or simply not read (the critic head of a policy that is distilled on its actions alone,
an unused pooler, the last bias of an energy model trained on forces only, whose derivative drops it). Only the
first is the silent bug; the two look the same in the gradients, so the step runs once more with each
candidate's values changed, and the loss is compared.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from guardtower.preflight._step import extract_loss
from guardtower.preflight._util import is_library_model, is_lora_factor

__all__ = ["gradientless_candidates", "confirm_values_unread", "shifted"]

#: at most this many candidates (a module, or one parameter) get a run of their own
#: frozen parameter elements kept and put back between the runs, at most (a frozen LoRA base is not copied)
_MAX_FROZEN_ELEMENTS = 1 << 24
_MAX_CANDIDATES = 3


def _adapter(name: str) -> bool:
    return is_lora_factor(name) or "lora_" in name  # an adapter that does not train is the bug itself


def gradientless_candidates(model: nn.Module, grads: dict[str, Any], ran_with_grad: set[str],
                            ran: set[str]) -> list[str]:
    """Names of what the user's own code holds that ran with autograd on and got no gradient: the outermost
    submodules none of whose trainable parameters got one, then single gradient-less parameters of modules whose
    other parameters did, then the gradient-less parameters a module holds itself when neither its forward nor its
    parent's ran (the step uses it through its parts, and may read these through a method or an attribute: a VQ
    codebook its own quantize reads). Not the parts
    of a library model (GRAD-001 judges those by the rest of that model) nor an adapter factor."""
    modules = dict(model.named_modules())
    found: list[str] = []
    partial: list[str] = []
    direct: list[str] = []
    for name, module in modules.items():
        path = name.split(".") if name else []
        if any(is_library_model(modules.get(".".join(path[:i]))) for i in range(len(path) + 1)):
            continue
        if name not in ran and name.rpartition(".")[0] not in ran:  # neither it nor its parent: used by parts
            held = [f"{name}.{n}" if name else n for n, p in module.named_parameters(recurse=False) if p.requires_grad]
            direct += [n for n in held if n in grads and grads[n] is None and not _adapter(n)]
        if not name or name not in ran_with_grad or any(name.startswith(f"{f}.") for f in found):
            continue
        # under the names the model knows them by (a tied weight is listed once, under its first owner)
        params = [(n, p) for n, p in module.named_parameters(prefix=name) if p.requires_grad and n in grads]
        missing = [n for n, _ in params if grads[n] is None and not _adapter(n)]
        if params and len(missing) == len(params):
            found.append(name)
        else:
            own = {f"{name}.{n}" for n, _ in module.named_parameters(recurse=False)}
            partial += [n for n in missing if n in own]
    return (found + partial + direct)[:_MAX_CANDIDATES]


def shifted(p: torch.Tensor) -> torch.Tensor:
    """``p / 2 + 1``: moves zeros too (a zero-initialised bias)."""
    return p * 0.5 + 1.0


def confirm_values_unread(model: nn.Module, step_fn: Callable[[], Any], names: list[str], loss: torch.Tensor,
                          rng: Callable[[], None], restore: Callable[[], None]) -> set[str]:
    """Re-run ``step_fn`` once per candidate of ``names`` (a module: all its trainable parameters; else one
    parameter) with the candidate's values changed, same RNG stream, autograd on (a loss may differentiate the
    model's output, as forces from an energy do); the candidates whose change leaves the loss bitwise equal. After
    each run ``restore`` puts back everything a ``step_fn`` that steps itself changed, then the frozen copies it
    moves itself (an EMA target: not in ``restore``), so every run starts from the same weights. With such copies
    the reference is one run without a change (the copies the earlier passes moved are where they are now), else
    the step's own ``loss``. A run that fails tells nothing."""
    modules = dict(model.named_modules())
    params = dict(model.named_parameters())
    frozen = [p for p in model.parameters() if not p.requires_grad and p.is_floating_point()]
    copies = ([(p, p.detach().clone()) for p in frozen] if sum(p.numel() for p in frozen) <= _MAX_FROZEN_ELEMENTS
              else [])

    def run(held: list[torch.Tensor]) -> Any:
        saved = [p.detach().clone() for p in held]
        try:
            with torch.no_grad():
                for p in held:
                    p.copy_(shifted(p))
            rng()
            with torch.enable_grad():
                return extract_loss(step_fn())
        except Exception:
            return None
        finally:
            restore()
            with torch.no_grad():
                for p, value in [*copies, *zip(held, saved)]:
                    p.copy_(value)

    reference = run([]) if copies else loss
    if not isinstance(reference, torch.Tensor):
        return set()
    unread: set[str] = set()
    for name in names:
        other = run([p for p in modules[name].parameters() if p.requires_grad] if name in modules else [params[name]])
        if isinstance(other, torch.Tensor) and other.shape == reference.shape and torch.equal(other.detach(),
                                                                                              reference.detach()):
            unread.add(name)
    return unread
