"""Small helpers shared by the audit runner and its checks."""

from __future__ import annotations

import contextlib
import inspect
import re
from collections.abc import Mapping, Sequence
from typing import Any, Callable, Iterator

import torch
from torch import nn

__all__ = [
    "iter_tensors",
    "unique_params",
    "wrapper_chain",
    "base_optimizer",
    "base_scheduler",
    "companion_modules",
    "optimizer_tensors",
    "is_lora_factor",
    "fmt_names",
    "LABEL_KEYS",
    "NOT_INPUT_KEYS",
    "is_causal_lm",
]

#: mapping keys that hold targets rather than model inputs
LABEL_KEYS = frozenset({"labels", "label", "targets", "target", "y", "start_positions", "end_positions"})
#: mapping keys that are neither inputs nor targets (their gradient says nothing about input dependency)
NOT_INPUT_KEYS = LABEL_KEYS | {"attention_mask", "position_ids", "token_type_ids", "head_mask", "decoder_attention_mask"}

_LORA_FACTOR = re.compile(r"(^|\.)lora_(embedding_)?[AB](\.|$)")


def iter_tensors(obj: Any, *, depth: int = 4, skip_keys: frozenset[str] = frozenset()) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(path, tensor)`` for tensors inside nested tuples, lists, dicts and HF ``ModelOutput``s."""
    yield from _walk(obj, "", depth, skip_keys, set())


def _walk(obj: Any, path: str, depth: int, skip: frozenset[str], seen: set[int]) -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(obj, torch.Tensor):
        if id(obj) not in seen:
            seen.add(id(obj))
            yield path, obj
        return
    if depth <= 0:
        return
    if isinstance(obj, Mapping):
        for key, value in obj.items():
            if str(key) in skip:
                continue
            yield from _walk(value, f"{path}.{key}" if path else str(key), depth - 1, skip, seen)
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            yield from _walk(value, f"{path}[{i}]", depth - 1, skip, seen)


def unique_params(model: nn.Module) -> dict[str, nn.Parameter]:
    """``named_parameters()`` with shared tensors listed once, under their first name."""
    return dict(model.named_parameters())


def wrapper_chain(obj: Any, kind: type | tuple[type, ...]) -> list[Any]:
    """``obj`` and what it wraps, outermost first: the instances of ``kind`` met by following, from each object,
    its first attribute that is one (Accelerate's and the guards' wrappers hold what they wrap that way)."""
    chain: list[Any] = []
    current = obj
    for _ in range(8):
        if isinstance(current, kind) and all(current is not c for c in chain):
            chain.append(current)
        current = next((v for v in (vars(current).values() if hasattr(current, "__dict__") else ())
                        if isinstance(v, kind) and v is not current), None)
        if current is None:
            break
    return chain


def base_optimizer(optimizer: Any) -> torch.optim.Optimizer | None:
    """The innermost ``torch.optim.Optimizer`` behind wrappers (Accelerate, guards) that hold it as an attribute."""
    chain = wrapper_chain(optimizer, torch.optim.Optimizer)
    return chain[-1] if chain else None


_SCHEDULERS = (torch.optim.lr_scheduler.LRScheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)


def base_scheduler(scheduler: Any) -> Any:
    """The innermost torch LR scheduler behind wrappers that hold it as an attribute (Accelerate's
    ``AcceleratedScheduler`` steps it only when the optimizer really steps): walking the wrapper would walk
    nothing, and its own ``step()`` calls are not the schedule's. Anything else is returned as given."""
    chain = wrapper_chain(scheduler, _SCHEDULERS)
    return chain[-1] if chain else scheduler


def companion_modules(step_fn: Callable[..., Any], model: nn.Module) -> dict[str, nn.Module]:
    """The modules ``step_fn`` holds besides ``model`` (its closure variables and the globals it names): an EMA
    copy, a target network or a teacher the user keeps outside the model. None of their modules is one of the
    model's, nor the other way round."""
    fn = inspect.unwrap(step_fn) if callable(step_fn) else None
    code = getattr(fn, "__code__", None)
    if code is None:
        return {}
    held: list[tuple[str, Any]] = []
    for name, cell in zip(code.co_freevars, getattr(fn, "__closure__", None) or ()):
        with contextlib.suppress(ValueError):  # a cell not filled yet
            held.append((name, cell.cell_contents))
    found_globals = getattr(fn, "__globals__", {})
    held += [(name, found_globals[name]) for name in code.co_names if name in found_globals]
    # one level into the objects it holds: an EMA helper that keeps its copy as an attribute
    held += [(f"{name}.{attr}", inner) for name, value in list(held)
             if not isinstance(value, (nn.Module, type)) and hasattr(value, "__dict__")
             for attr, inner in vars(value).items() if isinstance(inner, nn.Module)]
    own = {id(m) for m in model.modules()}
    return {name: value for name, value in held if isinstance(value, nn.Module) and id(value) not in own
            and not any(id(m) in own for m in value.modules())}


def optimizer_tensors(optimizer: Any) -> list[tuple[int, torch.Tensor]]:
    """``(group index, tensor)`` for every tensor in the optimizer's param groups."""
    out: list[tuple[int, torch.Tensor]] = []
    for gi, group in enumerate(getattr(optimizer, "param_groups", ()) or ()):
        for p in group.get("params", ()):
            if isinstance(p, torch.Tensor):
                out.append((gi, p))
    return out


def is_lora_factor(name: str) -> bool:
    """LoRA A/B factors: their gradient pattern at init is judged by the LoRA checks, not the generic ones."""
    return bool(_LORA_FACTOR.search(name))


def is_causal_lm(model: Any) -> bool:
    """A Hugging Face language model that shifts ``labels`` itself (``*ForCausalLM``, ``*LMHeadModel``)."""
    if getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        return False
    name = type(model).__name__
    return "CausalLM" in name or name.endswith("LMHeadModel")


#: marks an attribute the owner did not define itself (it was inherited, or looked up on the class)
_ABSENT: Any = object()


@contextlib.contextmanager
def patched(patches: Sequence[tuple[Any, str, Callable[[Any], Any]]]) -> Iterator[None]:
    """Replace each ``owner.name`` by ``wrap(current)`` while the block runs, then put back exactly what was there:
    an attribute the owner only inherited (a C method of ``torch.Tensor``, a class method seen on an instance) is
    deleted again, so the inherited one shows through."""
    saved = [(owner, name, owner.__dict__.get(name, _ABSENT) if hasattr(owner, "__dict__") else _ABSENT,
              getattr(owner, name)) for owner, name, _ in patches]
    try:
        for (owner, name, wrap), (_, _, _, current) in zip(patches, saved):
            setattr(owner, name, wrap(current))
        yield
    finally:
        for owner, name, own, _ in reversed(saved):
            if own is _ABSENT:
                delattr(owner, name)
            else:
                setattr(owner, name, own)


def stepped_elsewhere(ctx: Any) -> set[int]:
    """Ids of the tensors held by optimizers ``step_fn`` stepped besides the one given (a GAN's discriminator
    optimizer): they train, even though the given optimizer does not hold them."""
    trace = getattr(ctx, "trace", None)
    given = {id(ctx.optimizer), id(base_optimizer(ctx.optimizer))}
    others = [opt for opt in (trace.stepped_optimizers if trace is not None else []) if id(opt) not in given]
    return {id(p) for opt in others for g in opt.param_groups for p in g["params"]}


def master_copies_of(optimizer: Any, params: Mapping[str, torch.Tensor]) -> list[torch.Tensor] | None:
    """The model's 16-bit trainable tensors, when ``optimizer`` steps float32 copies of them (the main weights of
    Megatron's and apex's mixed-precision optimizers: it copies the gradients in and the weights back): it holds
    none of the model's tensors, only float32 ones, of exactly those shapes. Else None."""
    held = [t for _, t in optimizer_tensors(optimizer)]
    model = {id(p) for p in params.values()}
    if not held or any(id(t) in model or t.dtype != torch.float32 for t in held):
        return None
    half = [p for p in params.values() if p.requires_grad and p.dtype in (torch.float16, torch.bfloat16)]
    return half if sorted(tuple(t.shape) for t in held) == sorted(tuple(p.shape) for p in half) else None


def trained_ids(ctx: Any) -> set[int] | None:
    """Ids of the tensors some optimizer updates: the given one's (the model's 16-bit tensors when it steps float32
    copies of them) and those of any other optimizer ``step_fn`` steps. None when no optimizer was given (nothing to
    say what trains)."""
    if ctx.optimizer is None:
        return None
    masters = master_copies_of(ctx.optimizer, ctx.params)
    own = masters if masters is not None else [t for _, t in optimizer_tensors(ctx.optimizer)]
    return {id(t) for t in own} | stepped_elsewhere(ctx)


def is_library_model(model: Any) -> bool:
    """A model class from transformers or peft, used as it ships: its forward keeps the samples of a batch apart."""
    return type(model).__module__.split(".")[0] in ("transformers", "peft")


def fmt_names(names: list[str], limit: int = 5) -> str:
    """``a, b, c and 4 more``."""
    shown = ", ".join(names[:limit])
    return shown if len(names) <= limit else f"{shown} and {len(names) - limit} more"


def graph_nodes(root: Any, stop: Callable[[Any], bool] | None = None) -> Iterator[Any]:
    """Each autograd node of the graph below ``root`` once (depth first); the walk does not go below a node for
    which ``stop`` is true."""
    seen: set[int] = set()
    stack: list[Any] = [root]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        yield node
        if stop is None or not stop(node):
            stack.extend(next_fn for next_fn, _ in node.next_functions)


#: autograd nodes looked at, at most, when the graph of a backward is searched for a pattern
MAX_GRAPH_NODES = 20000


def masked_reduction(root: Any, reduced: dict[int, Any]) -> tuple[Any, int, int] | None:
    """(value of ``reduced`` for the node, zeros, elements): in the graph below ``root`` (before its backward frees
    the saved tensors), a product of a node of ``reduced`` (a loss already reduced to one number) and a weight
    tensor that holds zeros among its entries: a mask applied after the reduction."""
    for seen, node in enumerate(graph_nodes(root)):
        if seen > MAX_GRAPH_NODES:
            return None
        if type(node).__name__ != "MulBackward0":
            continue
        hits = [i for i, (child, _) in enumerate(node.next_functions) if id(child) in reduced]
        if len(hits) != 1:
            continue
        try:
            weight = node._saved_other if hits[0] == 0 else node._saved_self
        except Exception:  # an operand that was not saved (a Python number), or already freed
            continue
        if isinstance(weight, torch.Tensor) and weight.numel() >= 2:
            zeros = int((weight.detach() == 0).sum())
            if 0 < zeros < weight.numel():
                return reduced[id(node.next_functions[hits[0]][0])], zeros, int(weight.numel())
    return None


def graph_holds(root: Any, wanted: dict[int, Any]) -> list[Any]:
    """The values of ``wanted`` (id of an autograd node -> value) whose nodes the graph below ``root`` holds, not
    looking below a node found."""
    found: list[Any] = []
    for node in graph_nodes(root, stop=lambda n: id(n) in wanted):
        if id(node) in wanted:
            found.append(wanted[id(node)])
            if len(found) == len(wanted):
                break
    return found


def reached_params(t: torch.Tensor, trainable: set[int], first: bool = False) -> frozenset[int]:
    """The trainable parameters (ids) the autograd graph behind ``t`` reaches; with ``first``, stop at the first
    (an input the audit made require grad, or a frozen teacher's output, is not one)."""
    if not t.requires_grad:
        return frozenset()
    if t.grad_fn is None:
        return frozenset({id(t)} & trainable)
    found: set[int] = set()
    for node in graph_nodes(t.grad_fn):
        variable = getattr(node, "variable", None)
        if variable is not None and id(variable) in trainable:
            found.add(id(variable))
            if first:
                break
    return frozenset(found)
