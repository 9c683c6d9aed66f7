"""Blind batch 29 (part a): silent LLM fine-tuning bugs from public GitHub threads, each with its fixed twin.

Collected by someone who does not write the audit's checks. Every case builds the user's setup on a tiny model
(transformers Llama models from tiny configs in code, real peft LoRA adapters, the real transformers LabelSmoother;
nothing is downloaded) and proves the bug without the audit on real tensors and real steps.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tests._blind import BlindCase, Case
from tests._blind_batch5 import _gen, _kw, _llama_config, _sgd_step

_V = 40  # the tiny Llama vocabulary (tests._blind_batch5._llama_config)


def _lora_llama(**lora_kw: object) -> nn.Module:
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    base = LlamaForCausalLM(_llama_config())
    cfg = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"], **lora_kw)
    return get_peft_model(base, cfg)


# --------------------------------------------------------------------------------------------- case-01
# huggingface/transformers PR #25044 (merged): a LoRA fine-tune of LlamaForCausalLM through the HF Trainer with
# `label_smoothing_factor > 0`. With label smoothing on, Trainer.compute_loss pops the labels, runs the model and
# applies its LabelSmoother itself, shifting the labels only when `unwrap_model(model)._get_name()` is a causal-LM
# class name. For a PeftModel that name is "PeftModelForCausalLM", which is not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
# so the labels are not shifted: every position is trained to predict the token it already sees (a copy task). The
# loss is a perfectly normal smoothed cross-entropy and falls quickly; nothing warns. Fix in the PR: for a PeftModel,
# take the name from `model.base_model.model` (the wrapped LlamaForCausalLM), so the shift is applied.

_C01_IDS = torch.randint(3, _V, (4, 12), generator=_gen(2901))
_C01_LABELS = _C01_IDS.clone()
_C01_LABELS[1, 9:] = -100
_C01_LABELS[3, 7:] = -100
_C01_MASK = (_C01_LABELS != -100).long()
_C01_BATCH = {"input_ids": _C01_IDS, "attention_mask": _C01_MASK, "labels": _C01_LABELS}


def _c01_model_name(model: nn.Module, bug: bool) -> str:
    from peft import PeftModel

    if not bug and isinstance(model, PeftModel):
        return model.base_model.model._get_name()  # the fix: look through the PEFT wrapper
    return model._get_name()


def _c01_loss(model: nn.Module, bug: bool) -> torch.Tensor:
    """Trainer.compute_loss with a label smoother, as the Trainer ran it."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    from transformers.trainer_pt_utils import LabelSmoother

    inputs = dict(_C01_BATCH)
    labels = inputs.pop("labels")
    outputs = model(**inputs)
    smoother = LabelSmoother(epsilon=0.1)
    if _c01_model_name(model, bug) in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values():
        return smoother(outputs, labels, shift_labels=True)
    return smoother(outputs, labels)


def _c01_build(bug: bool) -> Case:
    """LoRA (q/v) on a tiny Llama, Trainer-style label-smoothed loss."""
    model = _lora_llama(task_type="CAUSAL_LM").train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    step = _sgd_step(model, opt, lambda: _c01_loss(model, bug))
    return model, step, _kw(optimizer=opt, inputs=_C01_BATCH)


def _c01_proof(bug: bool) -> bool:
    """The loss the step optimises is the smoothed CE against the *unshifted* labels (position t -> token t)."""
    from transformers.trainer_pt_utils import LabelSmoother

    model, _, _ = _c01_build(bug)
    with torch.no_grad():
        loss = _c01_loss(model, bug)
        out = model(input_ids=_C01_IDS, attention_mask=_C01_MASK)
        smoother = LabelSmoother(epsilon=0.1)
        unshifted = smoother(out, _C01_LABELS)
        shifted = smoother(out, _C01_LABELS, shift_labels=True)
    assert abs(float(unshifted - shifted)) > 1e-3
    return abs(float(loss - unshifted)) < 1e-6


# --------------------------------------------------------------------------------------------- case-02
# alex-hh/profam issue #495 (closed; the maintainers' own experiment): sequence packing for a HF Llama model.
# Several documents are concatenated into one row and the document-relative position ids ([0,1,2,0,1,2,...]) are
# passed as `position_ids`, relying on the model to build a per-document causal mask from them. It only does that on
# the flash-attention varlen path; with the default (sdpa/eager) attention the mask stays one full causal triangle,
# so every document attends to all the documents packed before it. Training runs and the loss is plausible (even
# lower: later documents can copy from earlier ones, which the maintainers used to detect it: ~95% accuracy on
# random documents). Fix: make the attention document-aware, i.e. give the model a block-diagonal causal mask over
# the packed documents (what the flash-attention varlen path does from the position ids).

_C02_LENS = (5, 6, 5)
_C02_DOCS = [torch.randint(3, _V, (n,), generator=_gen(2920 + i)) for i, n in enumerate(_C02_LENS)]
_C02_IDS = torch.cat(_C02_DOCS)[None]  # (1, 16)
_C02_POS = torch.cat([torch.arange(n) for n in _C02_LENS])[None]
_C02_LABELS = _C02_IDS.clone()
_C02_LABELS[_C02_POS == 0] = -100  # the collator keeps a document's first token from being predicted by the last one


def _c02_block_mask() -> torch.Tensor:
    doc = torch.cat([torch.full((n,), i) for i, n in enumerate(_C02_LENS)])
    allowed = (doc[:, None] == doc[None, :]) & torch.ones(len(doc), len(doc), dtype=torch.bool).tril()
    return torch.where(allowed, 0.0, torch.finfo(torch.float32).min)[None, None]


def _c02_forward(model: nn.Module, bug: bool) -> object:
    kw = {} if bug else {"attention_mask": _c02_block_mask()}
    return model(input_ids=_C02_IDS, position_ids=_C02_POS, labels=_C02_LABELS, **kw)


def _c02_build(bug: bool) -> Case:
    """Tiny Llama trained on one packed row of three documents with reset position ids."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(_llama_config()).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = _sgd_step(model, opt, lambda: _c02_forward(model, bug).loss)
    inputs = {"input_ids": _C02_IDS, "position_ids": _C02_POS, "labels": _C02_LABELS}
    if not bug:
        inputs["attention_mask"] = _c02_block_mask()
    return model, step, _kw(optimizer=opt, inputs=inputs)


def _c02_proof(bug: bool) -> bool:
    """The packed logits of documents 2 and 3 differ from each document run on its own: they saw document 1."""
    model, _, _ = _c02_build(bug)
    model.eval()
    with torch.no_grad():
        packed = _c02_forward(model, bug).logits[0]
        start, worst = 0, 0.0
        for doc in _C02_DOCS:
            alone = model(input_ids=doc[None]).logits[0]
            worst = max(worst, float((packed[start:start + len(doc)] - alone).abs().max()))
            start += len(doc)
    return worst > 1e-4


# --------------------------------------------------------------------------------------------- case-03
# verl-project/verl PR #3287 (merged): SFT with MultiTurnSFTDataset, whose loss_mask is 1 on the assistant's response
# tokens (aligned with input_ids). fsdp_sft_trainer computes the per-token loss of logits[:, :-1] against
# input_ids[:, 1:] and weights it with `loss_mask[:, :-1]`: the mask of the *input* token rather than of the target.
# The prediction of the first response token (made at the last prompt position) gets weight 0, and the prediction
# made at the last response token (of whatever follows it) gets weight 1. The loss is a normal masked mean and
# decreases; the fine-tuned model simply never learns the first token of its answers. Fix in the PR: weight the
# loss with `loss_mask[:, 1:]`, the mask of the target tokens.

_C03_PROMPT, _C03_RESP, _C03_T = 6, 5, 14
_C03_IDS = torch.randint(3, _V, (3, _C03_T), generator=_gen(2930))
_C03_IDS[:, _C03_PROMPT + _C03_RESP:] = 0  # right padding
_C03_ATTN = (_C03_IDS != 0).long()
_C03_LOSS_MASK = torch.zeros(3, _C03_T, dtype=torch.long)
_C03_LOSS_MASK[:, _C03_PROMPT:_C03_PROMPT + _C03_RESP] = 1  # the response tokens


def _c03_loss(model: nn.Module, bug: bool, logits_out: list | None = None) -> torch.Tensor:
    """fsdp_sft_trainer._compute_loss_and_backward (single rank, no sequence parallel)."""
    labels = _C03_IDS[:, 1:].contiguous()
    logits = model(input_ids=_C03_IDS, attention_mask=_C03_ATTN, use_cache=False).logits
    if logits_out is not None:
        logits.retain_grad()
        logits_out.append(logits)
    shift_logits = logits[..., :-1, :].contiguous()
    loss = F.cross_entropy(shift_logits.view(-1, _V), labels.view(-1), reduction="none")
    loss_mask = (_C03_LOSS_MASK[:, :-1] if bug else _C03_LOSS_MASK[:, 1:]).reshape(-1).float()
    loss = loss * loss_mask
    return torch.sum(loss) / (torch.sum(loss_mask) + 1e-8)


def _c03_build(bug: bool) -> Case:
    """Tiny Llama SFT step with a response-only loss mask."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(_llama_config()).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    step = _sgd_step(model, opt, lambda: _c03_loss(model, bug))
    inputs = {"input_ids": _C03_IDS, "attention_mask": _C03_ATTN, "loss_mask": _C03_LOSS_MASK}
    return model, step, _kw(optimizer=opt, inputs=inputs)


def _c03_proof(bug: bool) -> bool:
    """The logits that predict the first response token get no gradient from the step's loss."""
    model, _, _ = _c03_build(bug)
    kept: list = []
    _c03_loss(model, bug, kept).backward()
    grad = kept[0].grad
    first_resp = grad[:, _C03_PROMPT - 1].abs().sum()  # position p-1 predicts input_ids[p], the first response token
    return bool(first_resp == 0)


# --------------------------------------------------------------------------------------------- case-04
# karpathy/nanochat PR #582 (merged): the SFT script was rewritten for best-fit packing and the conversation
# rendering's mask was discarded (`ids, _ = tokenizer.render_conversation(conversation)`), so the targets are simply
# ids[1:]: user prompts, BOS and special tokens all enter the cross-entropy with the assistant's answers. Training
# loss looks the same (~0.78 both ways in the PR); the model spends its capacity learning to write user turns and
# evaluations get worse. Fix in the PR: carry the mask through packing and set the targets of non-assistant tokens to
# the ignore index (-1).

_C04_IDS = torch.randint(3, _V, (4, 16), generator=_gen(2940))
_C04_MASK = torch.zeros(4, 16, dtype=torch.long)  # render_conversation's mask: 1 on assistant tokens
_C04_MASK[:, 7:12] = 1
_C04_MASK[:, 14:] = 1


def _c04_targets(bug: bool) -> torch.Tensor:
    targets = _C04_IDS[:, 1:].clone()
    if not bug:
        targets[_C04_MASK[:, 1:] == 0] = -1
    return targets


def _c04_loss(model: nn.Module, bug: bool) -> torch.Tensor:
    logits = model(input_ids=_C04_IDS[:, :-1]).logits
    return F.cross_entropy(logits.reshape(-1, _V), _c04_targets(bug).reshape(-1), ignore_index=-1)


def _c04_build(bug: bool) -> Case:
    """Tiny Llama chat SFT step on rendered conversations."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(_llama_config()).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    step = _sgd_step(model, opt, lambda: _c04_loss(model, bug))
    inputs = {"input_ids": _C04_IDS[:, :-1], "targets": _c04_targets(bug)}
    return model, step, _kw(optimizer=opt, inputs=inputs)


def _c04_proof(bug: bool) -> bool:
    """Changing only the user-turn target tokens changes the loss the step optimises."""
    model, _, _ = _c04_build(bug)
    with torch.no_grad():
        logits = model(input_ids=_C04_IDS[:, :-1]).logits.reshape(-1, _V)
        targets = _c04_targets(bug)
        other = targets.clone()
        user = (_C04_MASK[:, 1:] == 0) & (targets != -1)
        other[user] = (other[user] + 1 - 3) % (_V - 3) + 3  # a different user token at every user position
        a = F.cross_entropy(logits, targets.reshape(-1), ignore_index=-1)
        b = F.cross_entropy(logits, other.reshape(-1), ignore_index=-1)
    return abs(float(a - b)) > 1e-6


# --------------------------------------------------------------------------------------------- case-05
# huggingface/peft issue #3447 (fix PR #3453): a LoRA adapter loaded frozen (`inference_mode=True`, e.g. a fine-tuned
# SFT policy used as a fixed backbone) while a value head is trained on top of it; each step also runs a base-model
# reference pass inside `with model.disable_adapter():`. Leaving the context calls enable_adapters(True), which calls
# set_adapter(active_adapters) with the default inference_mode=False and so sets requires_grad=True on the frozen
# adapter. From the first step on, the "frozen" LoRA weights get gradients and, since the optimizer was built over all
# the model's parameters (frozen ones have no grad and are skipped), AdamW silently trains them. Fix in the PR: the
# re-enable restores the adapter with its own inference_mode, i.e. `set_adapter(name, inference_mode=True)` for an
# adapter that was loaded frozen (applied here right after the context exits, where the fixed enable_adapters does it).

_C05_IDS = torch.randint(3, _V, (4, 12), generator=_gen(2950))
_C05_RET = torch.randn(4, 12, generator=_gen(2951))


class _ValueModel(nn.Module):
    """A frozen LoRA policy with a trainable value head."""

    def __init__(self) -> None:
        super().__init__()
        self.policy = _lora_llama(task_type="CAUSAL_LM", inference_mode=True, init_lora_weights=False)
        self.head = nn.Linear(32, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.policy(input_ids=ids, output_hidden_states=True).hidden_states[-1]).squeeze(-1)


def _c05_loss(model: _ValueModel, bug: bool) -> torch.Tensor:
    with model.policy.disable_adapter(), torch.no_grad():
        ref = model.head(model.policy(input_ids=_C05_IDS, output_hidden_states=True).hidden_states[-1]).squeeze(-1)
    if not bug:
        model.policy.set_adapter("default", inference_mode=True)
    value = model(_C05_IDS)
    return F.mse_loss(value, _C05_RET) + 0.1 * F.mse_loss(value, ref)


def _c05_build(bug: bool) -> Case:
    torch.manual_seed(0)
    model = _ValueModel().train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = _sgd_step(model, opt, lambda: _c05_loss(model, bug))
    return model, step, _kw(optimizer=opt, inputs={"input_ids": _C05_IDS, "returns": _C05_RET})


def _c05_proof(bug: bool) -> bool:
    """After three steps the LoRA weights of the adapter loaded frozen have moved."""
    model, step, _ = _c05_build(bug)
    lora = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}
    assert lora and not any(p.requires_grad for n, p in model.named_parameters() if "lora_" in n)
    for _ in range(3):
        step()
    moved = max(float((p.detach() - lora[n]).abs().max()) for n, p in model.named_parameters() if n in lora)
    return moved > 0


CASES: list[BlindCase] = [
    BlindCase("b29a-01", "https://github.com/huggingface/transformers/pull/25044", "label shift under PEFT",
              "With label smoothing on, the Trainer's own loss shifts causal-LM labels only for known causal-LM class "
              "names, so a PeftModelForCausalLM is trained to predict the token it already sees.",
              _c01_build, _c01_proof),
    BlindCase("b29a-02", "https://github.com/alex-hh/profam/issues/495", "packing cross-document attention",
              "Packed documents get reset position ids but no document-aware mask under sdpa attention, so every "
              "document attends to the documents packed before it.", _c02_build, _c02_proof),
    BlindCase("b29a-03", "https://github.com/verl-project/verl/pull/3287", "loss mask off by one",
              "The SFT loss is weighted with the input tokens' loss mask instead of the targets', so the first "
              "response token is never trained and the token after the response is.", _c03_build, _c03_proof),
    BlindCase("b29a-04", "https://github.com/karpathy/nanochat/pull/582", "loss mask dropped",
              "The SFT packing loader discards the conversation mask, so user prompts and special tokens are trained "
              "as targets alongside the assistant's answers.", _c04_build, _c04_proof,
              known_miss="the conversation mask never reaches the step: which targets are user turns is label semantics the batch does not carry"),
    BlindCase("b29a-05", "https://github.com/huggingface/peft/issues/3447", "frozen adapter unfrozen",
              "Leaving `disable_adapter()` re-enables gradients on a LoRA adapter loaded with inference_mode=True, "
              "so the optimizer silently trains the adapter that was meant to stay frozen.", _c05_build, _c05_proof),
]
