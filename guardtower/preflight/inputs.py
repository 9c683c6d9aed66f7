"""``input_dependency``: does the loss depend on the input, and does each sample depend only on itself?

The step records the gradient reaching the model's input (float inputs, or the embedding output for token
ids) and, separately, the gradient of the first and last samples' predictions with respect to every sample's
input (``_sample_leak``).
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from guardtower.preflight._registry import AuditContext, check
from guardtower.preflight._sample_leak import sequence_first_layers
from guardtower.preflight._util import fmt_names, iter_tensors
from guardtower.report import Finding
from guardtower.severity import Severity

__all__: list[str] = []


def _graph_structure(ctx: AuditContext, batch: int) -> str | None:
    """What makes the batch's samples the nodes of one graph: an (N, N) adjacency the model holds or receives, or
    an integer (2, E) edge index over the N samples; None without one. Message passing mixes nodes by design."""
    trace = ctx.trace
    assert trace is not None
    call = trace.training_call()
    named = [*ctx.model.named_buffers(), *iter_tensors((call.args, call.kwargs), depth=3)]
    for name, t in named:
        if not isinstance(t, torch.Tensor) or t.dim() != 2:
            continue
        if t.shape[0] == t.shape[1] == batch and batch >= 3:
            return name or "an adjacency argument"
        if (t.shape[0] == 2 and t.shape[1] >= 1 and not t.is_floating_point() and t.dtype != torch.bool
                and 0 <= int(t.min()) and int(t.max()) < batch):
            return name or "an edge-index argument"
    return None


@check("input_dependency", emits=("INPUT-001", "INPUT-002"), needs=("leak", "input_independence"))
def check_input_dependency(ctx: AuditContext) -> Iterable[Finding]:
    """INPUT-001 loss independent of the input, INPUT-002 samples mixing across the batch."""
    trace = ctx.trace
    if trace is None or not trace.backward:
        return []
    findings = []
    if trace.given_inputs_ignored:
        findings.append(Finding(
            "input_dependency", Severity.ERROR,
            "the loss does not depend on inputs=: none of its tensors reached the model and perturbing them leaves "
            "the loss bitwise unchanged (the step reads another, stale batch, or builds the loss from parameters "
            "only)",
            "INPUT-001", {"inputs": [path for path, _ in iter_tensors(ctx.inputs, depth=6)][:16], "given": True},
        ))
    input_grads = trace.input_grads
    if input_grads and trace.input_independent and not trace.given_inputs_ignored:
        if all(not g for g in input_grads.values()):
            findings.append(Finding(
                "input_dependency", Severity.ERROR,
                "the loss does not depend on the model's input: its gradient w.r.t. "
                f"{', '.join(input_grads)} is zero or absent and replacing the input leaves the loss bitwise "
                "unchanged (input ignored or overwritten in forward, or a cached tensor used instead)",
                "INPUT-001", {"inputs": list(input_grads)},
            ))
    leaking = [entry for entry in trace.leak if entry.leaking_samples]
    if leaking:
        entry = leaking[0]
        # the audit's own pass (step_fn ran the backward) is in eval mode: BatchNorm used running statistics there
        batchnorm = [] if trace.user_backward else [
            n for n, m in ctx.model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training]
        details = {"input": entry.input, "leaking_samples": entry.leaking_samples[:16],
                   "own_grad_norm": entry.own, "other_grad_norm": entry.other, "batchnorm": batchnorm[:16]}
        call = trace.training_call()
        first = next((t for _, t in iter_tensors((call.args, call.kwargs), depth=3) if t.dim() >= 1), None)
        graph = _graph_structure(ctx, first.shape[0]) if first is not None else None
        if graph is not None:
            findings.append(Finding(
                "input_dependency", Severity.INFO,
                f"a sample's prediction depends on other samples of the batch, and the samples are the nodes of a "
                f"graph ({graph}): message passing mixes neighbouring nodes by design",
                "INPUT-002", {**details, "graph": graph},
            ))
        elif batchnorm:
            findings.append(Finding(
                "input_dependency", Severity.INFO,
                f"a sample's prediction depends on other samples of the batch through {len(batchnorm)} BatchNorm "
                "layer(s) in train mode (expected from batch statistics; use GroupNorm/LayerNorm if samples must "
                "stay independent, e.g. per-sample gradients or contrastive losses)",
                "INPUT-002", details,
            ))
        else:
            seq_first = sequence_first_layers(ctx.model)
            why = (f"the sequence-first layer(s) {fmt_names(seq_first)} (batch_first=False) read (batch, seq, ...) "
                   "input as (seq, batch, ...): pass batch_first=True or transpose the input" if seq_first else
                   "a view/reshape/transpose, or a normalisation or attention over the batch axis, mixes the samples")
            details["sequence_first"] = seq_first[:16]
            findings.append(Finding(
                "input_dependency", Severity.WARN,
                f"the predictions of the first and last samples depend on samples {entry.leaking_samples[:8]} of "
                f"the batch (via {entry.input}): each sample is trained on the others' inputs; {why}",
                "INPUT-002", details,
            ))
    return findings


@check("future_tokens", emits=("INPUT-010",), needs=("future",))
def check_future_tokens(ctx: AuditContext) -> Iterable[Finding]:
    """INPUT-010: the loss asks each position for the next token, and a position's prediction reads later tokens:
    the answer is in the input (no causal mask, a bidirectional layer), so the loss falls by copying."""
    leak = ctx.trace.future_leak if ctx.trace is not None else None
    if leak is None or leak.future <= 1e-6 * max(leak.past, 1e-30):
        return []
    return [Finding(
        "future_tokens", Severity.WARN,
        f"each position is trained to predict the next input token, yet the prediction at position {leak.position} "
        f"depends on the {leak.length - leak.position - 1} later tokens (gradient {leak.future:.3g} from them vs "
        f"{leak.past:.3g} from the tokens up to it): the target is visible, so the model learns to copy it and "
        "the loss falls without learning to predict; add a causal mask (is_causal=True, "
        "nn.Transformer.generate_square_subsequent_mask) or use a unidirectional layer",
        "INPUT-010", {"position": leak.position, "future_grad": leak.future, "past_grad": leak.past},
    )]


@check("sequence_reads", emits=("INPUT-013",))
def check_sequence_reads(ctx: AuditContext) -> Iterable[Finding]:
    """INPUT-013: of a token sequence the model embeds (three or more positions per row), the loss gradient reaches
    one position only, in every row, though other positions hold tokens: a length, mask or index that keeps one
    item (lengths of ones, ``x[:, 0]`` where a pooling was meant), so the rest of the sequence never trains."""
    trace = ctx.trace
    if trace is None or not trace.backward:
        return []
    findings = []
    for name, reads in trace.position_reads.items():
        columns = reads.reached.any(0).nonzero().flatten().tolist()
        if len(columns) != 1:
            continue
        others = torch.cat([reads.ids[:, :columns[0]], reads.ids[:, columns[0] + 1:]], dim=1)
        tokens = others[others != reads.padding_idx] if reads.padding_idx is not None else others
        if tokens.numel() == 0 or bool((tokens == tokens.flatten()[0]).all()):  # the rest is one (padding) id
            continue
        findings.append(Finding(
            "sequence_reads", Severity.WARN,
            f"the loss reads position {columns[0]} only of the {reads.ids.shape[1]}-token sequences embedded by "
            f"{name}: in every row the gradient reaching the other positions' embeddings is zero, though they hold "
            "tokens, so the rest of each sequence never reaches the prediction (a length or mask that keeps one "
            "item, an index where a pooling or a range was meant); pass the real lengths or pool over the sequence",
            "INPUT-013", {"embedding": name, "position": columns[0], "positions": int(reads.ids.shape[1])},
        ))
    return findings[:4]
