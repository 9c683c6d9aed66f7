"""Blind batch 32 (part a): silent LLM instruction-tuning, packing and prompt-tuning bugs from public GitHub threads.

Collected by someone who does not write the audit's checks. Every case builds the user's setup on a tiny model
(transformers Llama and T5 models from tiny configs in code; nothing is downloaded) with its fixed twin, and proves
the bug without the audit on real tensors and real steps.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tests._blind import BlindCase, Case
from tests._blind_batch5 import _gen, _kw, _llama_config, _sgd_step

_IGNORE = -100


def _llama(**kw: Any) -> nn.Module:
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(_llama_config(**kw)).train()


# --------------------------------------------------------------------------------------------- case-01
# NVIDIA-NeMo/Speech (NeMo) PR #6409 "Fix the GPT SFT datasets loss mask bug": GPTSFTDataset builds a per-token loss
# mask over the full token list (0 on the prompt, 1 from `answer_start_idx` on), feeds `tokens[:-1]` as input and
# `tokens[1:]` as labels, and aligned the mask with the labels as `mask[:-1]`. That shifts the mask one position
# late: the label at position answer_start-1 (the FIRST answer token) gets weight 0, so the model is never trained
# to start its answer, while the loss and training look completely normal. Fix in the PR: align the mask with the
# labels (`mask[1:]`), so every answer token is a supervised target.

def _c01_batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Six prompt+answer examples of different prompt lengths, right-padded to 16 tokens."""
    g = _gen(3201)
    rows, masks = [], []
    for ctx_len, ans_len in [(5, 6), (7, 4), (4, 8), (6, 5), (8, 3), (3, 7)]:
        toks = torch.randint(3, 40, (ctx_len + ans_len,), generator=g).tolist() + [2]  # eos closes the answer
        mask = [float(i >= ctx_len) for i in range(len(toks))]  # _build_loss_mask: 1 from answer_start_idx on
        pad = 16 - len(toks)
        rows.append(toks + [0] * pad)
        masks.append(mask + [0.0] * pad)
    tokens = torch.tensor(rows)
    starts = torch.tensor([5, 7, 4, 6, 8, 3])
    return tokens, torch.tensor(masks), starts


_C01_TOKENS, _C01_MASK, _C01_STARTS = _c01_batch()


def _c01_collate(bug: bool) -> dict[str, torch.Tensor]:
    """GPTSFTDataset.collate_fn: inputs are tokens[:-1], labels tokens[1:], and the loss mask aligned to labels."""
    mask = _C01_MASK[:, :-1] if bug else _C01_MASK[:, 1:]
    return {"tokens": _C01_TOKENS[:, :-1], "labels": _C01_TOKENS[:, 1:], "loss_mask": mask}


def _c01_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Megatron GPT loss: per-token CE weighted by the loss mask, averaged over the masked tokens."""
    logits = model(input_ids=batch["tokens"]).logits
    ce = F.cross_entropy(logits.flatten(0, 1).float(), batch["labels"].flatten(), reduction="none")
    mask = batch["loss_mask"].flatten()
    return (ce * mask).sum() / mask.sum()


def _c01_build(bug: bool) -> Case:
    """Tiny Llama SFT step with NeMo's answer-only masked loss."""
    model = _llama()
    batch = _c01_collate(bug)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return model, _sgd_step(model, opt, lambda: _c01_loss(model, batch)), _kw(optimizer=opt, inputs=batch)


def _c01_proof(bug: bool) -> bool:
    """The loss has no gradient at the position whose label is the first answer token (for every example)."""
    model, _, _ = _c01_build(bug)
    batch = _c01_collate(bug)
    logits = model(input_ids=batch["tokens"]).logits
    logits.retain_grad()
    ce = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), reduction="none")
    mask = batch["loss_mask"].flatten()
    ((ce * mask).sum() / mask.sum()).backward()
    assert logits.grad is not None
    rows = torch.arange(len(_C01_STARTS))
    first_answer_grad = logits.grad[rows, _C01_STARTS - 1].abs().sum(-1)  # label there = tokens[answer_start]
    assert torch.equal(batch["labels"][rows, _C01_STARTS - 1], _C01_TOKENS[rows, _C01_STARTS])
    return bool((first_answer_grad == 0).all())


# --------------------------------------------------------------------------------------------- case-02
# NVIDIA-NeMo/Speech (NeMo) PR #12551 "Add packed sequences for HFDatasetDataModule" (review thread on
# hf_auto_model_for_causal_lm.py::training_step): the HF AutoModel training_step always did
# `batch["position_ids"] = torch.arange(seq_len)` before the forward. With packed sequences the batch already carries
# position_ids that restart at 0 for each packed document (and no attention mask), which is what tells the model
# where one document ends; overwriting them makes every document after the first use the wrong RoPE positions and
# attend to the documents packed before it. Loss still falls. Fix agreed in the thread: do not override the
# position_ids when the batch brings its own (packed sequences).

def _c02_pack() -> dict[str, torch.Tensor]:
    """Two rows of 16 tokens, each holding three packed documents; position ids restart at each document."""
    g = _gen(3202)
    lengths = [[6, 5, 5], [4, 7, 5]]
    ids = torch.randint(3, 40, (2, 16), generator=g)
    pos = torch.cat([torch.cat([torch.arange(n) for n in row]).unsqueeze(0) for row in lengths])
    labels = ids.clone()
    starts = torch.cat([torch.cat([torch.arange(n) == 0 for n in row]).unsqueeze(0) for row in lengths])
    labels[starts] = _IGNORE  # no next-token target across a document boundary
    return {"input_ids": ids, "labels": labels, "position_ids": pos}


_C02_BATCH = _c02_pack()


def _c02_training_step(model: nn.Module, batch: dict[str, torch.Tensor], bug: bool) -> torch.Tensor:
    """HFAutoModelForCausalLM.training_step: position ids set (bug: always overwritten), then model(**batch).loss."""
    batch = dict(batch)
    if bug or "position_ids" not in batch:
        batch["position_ids"] = torch.arange(0, batch["input_ids"].shape[1]).unsqueeze(0)
    return model(**batch).loss


def _c02_build(bug: bool) -> Case:
    """Tiny Llama trained on a packed batch through NeMo's HF training_step (training config: use_cache=False)."""
    model = _llama(use_cache=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = _sgd_step(model, opt, lambda: _c02_training_step(model, _C02_BATCH, bug))
    return model, step, _kw(optimizer=opt, inputs=_C02_BATCH)


def _c02_proof(bug: bool) -> bool:
    """Changing the first packed document changes the model's predictions on the second and third documents."""
    model, _, _ = _c02_build(bug)
    model.eval()
    other = dict(_C02_BATCH)
    ids = other["input_ids"].clone()
    ids[0, :6] = torch.randint(3, 40, (6,), generator=_gen(3212))  # row 0, document 0 replaced
    other["input_ids"] = ids

    def logits(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        b = dict(batch)
        if bug or "position_ids" not in b:
            b["position_ids"] = torch.arange(0, b["input_ids"].shape[1]).unsqueeze(0)
        b.pop("labels")
        with torch.no_grad():
            return model(**b).logits

    later_docs = (logits(_C02_BATCH)[0, 6:] - logits(other)[0, 6:]).abs().max()
    return bool(later_docs > 1e-5)


# --------------------------------------------------------------------------------------------- case-03
# thunlp/Prompt-Transferability issue #2 (maintainer: "these bugs are already fixed"): cross-model prompt transfer
# trains a projector (`model_AE`, the only thing in the optimizer) that maps a source soft prompt to the target
# model's prompt. crossPromptT5.forward wrote the projection into the prompt tables with
# `self.encoder.prompt_embeddings.weight.data = target_prompt`; assigning `.data` cuts the autograd graph, so the
# loss never reaches the projector: its gradients stay None, Adam silently skips it, and training "runs" with a
# projector that never changes. Fix: feed the projected prompt itself into the forward (keep it in the graph).

class _PromptT5(nn.Module):
    """T5 with soft prompt tokens prepended to the encoder input (the repo's PromptT5 modelling)."""

    def __init__(self, n_prompt: int = 4) -> None:
        super().__init__()
        from transformers import T5Config, T5ForConditionalGeneration

        cfg = T5Config(vocab_size=40, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2,
                       num_heads=4, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)
        self.t5 = T5ForConditionalGeneration(cfg)
        self.prompt_embeddings = nn.Embedding(n_prompt, 32)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor,
                prompt: torch.Tensor | None = None) -> torch.Tensor:
        prompt = self.prompt_embeddings.weight if prompt is None else prompt
        tok = self.t5.get_input_embeddings()(input_ids)
        embeds = torch.cat([prompt.unsqueeze(0).expand(len(input_ids), -1, -1), tok], 1)
        return self.t5(inputs_embeds=embeds, labels=labels).loss


class _CrossPrompt(nn.Module):
    """Projector from a source model's prompt (4 x 48) to the frozen target model's prompt (4 x 32)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.plm = _PromptT5()
        for p in self.plm.t5.parameters():
            p.requires_grad_(False)  # the target PLM is frozen; only its prompt table stays a plain parameter
        self.ae = nn.Sequential(nn.Linear(4 * 48, 64), nn.Tanh(), nn.Linear(64, 4 * 32))
        self.register_buffer("source_prompt", torch.randn(4, 48, generator=_gen(3203)))

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor, bug: bool) -> torch.Tensor:
        target_prompt = self.ae(self.source_prompt.reshape(1, -1)).reshape(4, 32)
        if bug:
            self.plm.prompt_embeddings.weight.data = target_prompt
            return self.plm(input_ids, labels)
        return self.plm(input_ids, labels, prompt=target_prompt)


_C03_X = torch.randint(3, 40, (4, 10), generator=_gen(3213))
_C03_Y = torch.randint(3, 40, (4, 3), generator=_gen(3223))


def _c03_build(bug: bool) -> Case:
    """One training step of the projector with Adam over model_AE.parameters(), as in the repo's train tool."""
    model = _CrossPrompt().train()
    opt = torch.optim.Adam(model.ae.parameters(), lr=1e-3)
    step = _sgd_step(model, opt, lambda: model(_C03_X, _C03_Y, bug))
    return model, step, _kw(optimizer=opt, inputs=_C03_X)


def _c03_proof(bug: bool) -> bool:
    """After three optimizer steps the projector's weights have not moved (and never received a gradient)."""
    model, step, _ = _c03_build(bug)
    before = [p.detach().clone() for p in model.ae.parameters()]
    for _ in range(3):
        step()
    no_grad = all(p.grad is None for p in model.ae.parameters())
    unchanged = all(torch.equal(b, p) for b, p in zip(before, model.ae.parameters()))
    return no_grad and unchanged


# --------------------------------------------------------------------------------------------- case-04
# meta-pytorch/torchtune PR #2613 "[Fix] Incorrect Labels Shift for Packed Data": the SFT recipes shifted labels
# for next-token prediction on the whole (packed) row, `labels = hstack(labels[..., 1:], ignore)`. With packing,
# the last token of each packed document is then trained to predict the FIRST token of the next, unrelated
# document (one cross-document target per boundary); nothing errors and the loss looks normal. Fix in the PR:
# shift the labels per sample inside the dataset, before packing (each document ends in an ignore label), and drop
# the shift from the recipe.

_C04_LENGTHS = [[6, 5, 5], [7, 4, 5], [5, 6, 5], [4, 4, 8]]


def _c04_pack(bug: bool) -> dict[str, torch.Tensor]:
    """PackedDataset over text-completion samples (labels = tokens); the per-sample shift only in the fix."""
    g = _gen(3204)
    toks, labs, pos = [], [], []
    for row in _C04_LENGTHS:
        t_row, l_row, p_row = [], [], []
        for n in row:
            t = torch.randint(3, 40, (n,), generator=g).tolist()
            lab = t if bug else t[1:] + [_IGNORE]  # the fix: SFTDataset/TextCompletionDataset shift per sample
            t_row += t
            l_row += lab
            p_row += list(range(n))
        toks.append(t_row)
        labs.append(l_row)
        pos.append(p_row)
    return {"tokens": torch.tensor(toks), "labels": torch.tensor(labs), "input_pos": torch.tensor(pos)}


def _c04_targets(batch: dict[str, torch.Tensor], bug: bool) -> torch.Tensor:
    labels = batch["labels"]
    if bug:  # recipe: labels = torch.hstack((labels[..., 1:], ignore_labels_cache[: labels.shape[0]]))
        ignore = torch.full((labels.shape[0], 1), _IGNORE)
        labels = torch.hstack((labels[..., 1:], ignore))
    return labels


def _c04_loss(model: nn.Module, batch: dict[str, torch.Tensor], bug: bool,
              keep: list[torch.Tensor] | None = None) -> torch.Tensor:
    logits = model(input_ids=batch["tokens"], position_ids=batch["input_pos"]).logits
    if keep is not None:
        logits.retain_grad()
        keep.append(logits)
    labels = _c04_targets(batch, bug)
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=_IGNORE)


def _c04_build(bug: bool) -> Case:
    """Tiny Llama packed SFT step (documents isolated through restarting position ids), torchtune-style loss."""
    model = _llama(use_cache=False)
    batch = _c04_pack(bug)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return model, _sgd_step(model, opt, lambda: _c04_loss(model, batch, bug)), _kw(optimizer=opt, inputs=batch)


def _c04_proof(bug: bool) -> bool:
    """The last token of a packed document gets a gradient towards the next document's first token."""
    model, _, _ = _c04_build(bug)
    batch = _c04_pack(bug)
    keep: list[torch.Tensor] = []
    _c04_loss(model, batch, bug, keep).backward()
    grad = keep[0].grad
    assert grad is not None
    boundary_grad = 0.0
    for r, row in enumerate(_C04_LENGTHS):
        end = 0
        for n in row[:-1]:
            end += n
            boundary_grad += float(grad[r, end - 1].abs().sum())  # last token of a document that is followed
    return boundary_grad > 0


# --------------------------------------------------------------------------------------------- case-05
# delphi-suite/delphi PR #134 "Fix training data shifting bug": the (pre-)training loop built
# `X, Y = data[:, :-1], data[:, 1:]` and called `model(X, labels=Y)`. A *ForCausalLM model shifts the labels again
# internally, so position t was trained to predict token t+2 instead of t+1. Loss still decreases (skip-one
# prediction is learnable), so nothing looks wrong. Fix in the PR: pass the same tensor as inputs and labels
# (`return data, data`) and let the model do the shift.

_C05_DATA = torch.randint(3, 40, (8, 16), generator=_gen(3205))


def _c05_xy(bug: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """get_xy_batch."""
    return (_C05_DATA[:, :-1], _C05_DATA[:, 1:]) if bug else (_C05_DATA, _C05_DATA)


def _c05_build(bug: bool) -> Case:
    """Tiny Llama pre-training step: loss = model(X, labels=Y).loss."""
    model = _llama()
    x, y = _c05_xy(bug)
    opt = torch.optim.AdamW(model.parameters(), lr=5e-4, betas=(0.9, 0.95), weight_decay=0.1)
    step = _sgd_step(model, opt, lambda: model(x, labels=y, return_dict=True).loss)
    return model, step, _kw(optimizer=opt, inputs=x)


def _c05_proof(bug: bool) -> bool:
    """The model's loss is the cross-entropy of logits at position t against token t+2, not t+1."""
    model, _, _ = _c05_build(bug)
    x, y = _c05_xy(bug)
    with torch.no_grad():
        out = model(x, labels=y, return_dict=True)
        logits = out.logits.float()[:, :-1]  # the positions the model's loss uses
        k = logits.shape[1]
        next_tok = F.cross_entropy(logits.flatten(0, 1), _C05_DATA[:, 1 : k + 1].flatten())
        if k + 2 > _C05_DATA.shape[1]:  # no token two ahead of the last position: it cannot be the target
            return False
        skip_one = F.cross_entropy(logits.flatten(0, 1), _C05_DATA[:, 2 : k + 2].flatten())
    return bool(torch.allclose(out.loss, skip_one, atol=1e-5) and not torch.allclose(out.loss, next_tok, atol=1e-5))


CASES: list[BlindCase] = [
    BlindCase("b32a-01", "https://github.com/NVIDIA-NeMo/Speech/pull/6409", "SFT loss mask off by one",
              "The answer-only loss mask is aligned to the labels one position late, so the first answer token is "
              "never a training target.", _c01_build, _c01_proof),
    BlindCase("b32a-02", "https://github.com/NVIDIA-NeMo/Speech/pull/12551", "packed position_ids overwritten",
              "The training step overwrites the packed batch's restarting position ids with a plain arange, so "
              "packed documents attend to each other and get the wrong RoPE positions.", _c02_build, _c02_proof,
              known_miss="packed position_ids overwritten by a collator: position ids that restart per example are gone before the step"),
    BlindCase("b32a-03", "https://github.com/thunlp/Prompt-Transferability/issues/2",
              "prompt projector cut from graph",
              "The projected soft prompt is written into the prompt table through .data, so the projector that is "
              "the only thing being optimized never receives a gradient.", _c03_build, _c03_proof),
    BlindCase("b32a-04", "https://github.com/meta-pytorch/torchtune/pull/2613", "packed labels shifted across documents",
              "Labels are shifted on the whole packed row, so each document's last token is trained to predict the "
              "next document's first token.", _c04_build, _c04_proof),
    BlindCase("b32a-05", "https://github.com/delphi-suite/delphi/pull/134", "labels shifted twice",
              "Labels are pre-shifted and then shifted again inside the causal LM, so the model learns to predict "
              "the token two positions ahead.", _c05_build, _c05_proof),
]
