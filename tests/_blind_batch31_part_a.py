"""Blind batch 31 (part a): silent NLP and multimodal fine-tuning bugs from public GitHub threads, each with its twin.

Collected by someone who does not write the audit's checks. Every case builds the user's setup on a tiny model
(transformers SigLIP, Llama, Qwen3-VL and BERT models from tiny configs in code, a real peft ShadowPEFT adapter; nothing is
downloaded) and proves the bug without the audit on real tensors and real steps.
"""

from __future__ import annotations

import types
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tests._blind import BlindCase, Case
from tests._blind_batch5 import _gen, _kw, _llama_config

# --------------------------------------------------------------------------------------------- case-01
# TinyLLaVA/TinyLLaVA_Factory issue #17: a user fine-tunes the vision encoder of a TinyLLaVA model with
# `--tune_vision_tower` (vision tower, connector and LLM all set trainable, the optimizer holds all of them). The
# released vision-tower wrapper still had its `forward` decorated with `@torch.no_grad()` (copied from LLaVA, where
# the tower is always frozen), so the image features come out of a no-grad region: the tower's parameters have
# requires_grad=True and sit in the optimizer, but never get a gradient and never move. Training runs, the loss falls
# (connector and LLM learn), nothing warns. Fix confirmed by the maintainers: the `no_grad` decorator is removed from
# the tower's forward in the released code.

_C01_PIX = torch.randn(2, 3, 16, 16, generator=_gen(3101))
_C01_IDS = torch.randint(3, 40, (2, 8), generator=_gen(3102))


def _c01_siglip() -> nn.Module:
    from transformers import SiglipVisionConfig, SiglipVisionModel

    return SiglipVisionModel(SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                                num_attention_heads=2, image_size=16, patch_size=8, num_channels=3))


class _C01TowerNoGrad(nn.Module):
    """The released SigLIP tower wrapper: forward under @torch.no_grad() (LLaVA's frozen-tower code)."""

    def __init__(self) -> None:
        super().__init__()
        self._vision_tower = _c01_siglip()

    @torch.no_grad()
    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self._vision_tower(pixel_values).last_hidden_state


class _C01Tower(nn.Module):
    """The fixed wrapper: the same forward without the no_grad decorator."""

    def __init__(self) -> None:
        super().__init__()
        self._vision_tower = _c01_siglip()

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self._vision_tower(pixel_values).last_hidden_state


class _C01TinyLlava(nn.Module):
    """Vision tower -> 2-layer MLP connector -> Llama LM; image tokens are prepended to the text embeddings."""

    def __init__(self, bug: bool) -> None:
        super().__init__()
        from transformers import LlamaForCausalLM

        self.vision_tower = _C01TowerNoGrad() if bug else _C01Tower()
        self.connector = nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 32))
        self.language_model = LlamaForCausalLM(_llama_config())

    def forward(self, pixel_values: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        img = self.connector(self.vision_tower(pixel_values))
        txt = self.language_model.get_input_embeddings()(input_ids)
        embeds = torch.cat([img, txt], dim=1)
        labels = torch.cat([torch.full(img.shape[:2], -100, dtype=torch.long), input_ids], dim=1)
        return self.language_model(inputs_embeds=embeds, labels=labels).loss


def _c01_build(bug: bool) -> Case:
    """TinyLLaVA with tune_vision_tower: every part trainable, one AdamW over all of them."""
    torch.manual_seed(0)
    model = _C01TinyLlava(bug).train()
    model.requires_grad_(True)  # --tune_vision_tower, full connector and LLM tuning
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    batch = {"pixel_values": _C01_PIX, "input_ids": _C01_IDS}

    def step() -> torch.Tensor:
        opt.zero_grad()
        loss = model(**batch)
        loss.backward()
        opt.step()
        return loss

    return model, step, _kw(optimizer=opt, inputs=batch)


def _c01_proof(bug: bool) -> bool:
    """After three steps the vision tower's weights are exactly where they started."""
    model, step, _ = _c01_build(bug)
    before = {n: p.detach().clone() for n, p in model.vision_tower.named_parameters()}
    for _ in range(3):
        step()
    moved = [n for n, p in model.vision_tower.named_parameters() if not torch.equal(p.detach(), before[n])]
    return not moved


# --------------------------------------------------------------------------------------------- case-02
# hiyouga/LlamaFactory PR #10139: full fine-tuning of Qwen3-VL with the default `freeze_vision_tower=True`.
# LlamaFactory freezes the vision tower by name: every parameter whose name contains one of the model template's
# `vision_model_keys` gets requires_grad=False. Qwen3-VL reused Qwen2-VL's keys ("visual.patch_embed",
# "visual.blocks"), but Qwen3-VL's tower also has a learned position embedding `visual.pos_embed`, which matches no
# key: it stays trainable and is updated on every step (the PR's script found 2408 changed elements in a checkpoint
# trained with the tower "frozen"). Nothing warns; the run looks normal. Fix in the PR: Qwen3-VL gets its own
# vision_model_keys that include "visual.pos_embed".

_C02_IMG, _C02_START, _C02_END = 60, 62, 63


def _c02_config() -> Any:
    from transformers import Qwen3VLConfig

    text = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 128,
            "rope_scaling": {"rope_type": "default", "mrope_section": [2, 3, 3], "mrope_interleaved": True},
            "pad_token_id": 0}
    vision = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "patch_size": 4,
              "temporal_patch_size": 2, "spatial_merge_size": 2, "out_hidden_size": 32, "num_position_embeddings": 16,
              "deepstack_visual_indexes": [0], "in_channels": 3}
    return Qwen3VLConfig(text_config=text, vision_config=vision, image_token_id=_C02_IMG, video_token_id=61,
                         vision_start_token_id=_C02_START, vision_end_token_id=_C02_END)


def _c02_batch() -> dict[str, torch.Tensor]:
    ids = torch.randint(3, 50, (2, 12), generator=_gen(3121))
    ids[:, 1] = _C02_START
    ids[:, 2:6] = _C02_IMG  # a 4x4 patch grid merged 2x2 -> 4 image tokens
    ids[:, 6] = _C02_END
    labels = ids.clone()
    labels[:, :7] = -100
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids),
            "pixel_values": torch.randn(2 * 16, 3 * 2 * 4 * 4, generator=_gen(3122)),
            "image_grid_thw": torch.tensor([[1, 4, 4], [1, 4, 4]]),
            "mm_token_type_ids": (ids == _C02_IMG).long(), "labels": labels}


def _c02_build(bug: bool) -> Case:
    """Full fine-tuning with freeze_vision_tower=True: parameters named by the vision keys are frozen."""
    from transformers import Qwen3VLForConditionalGeneration

    torch.manual_seed(0)
    model = Qwen3VLForConditionalGeneration(_c02_config()).train()
    vision_model_keys = ["visual.patch_embed", "visual.blocks"] if bug else \
        ["visual.patch_embed", "visual.pos_embed", "visual.blocks"]
    forbidden_modules = set(vision_model_keys)  # freeze_vision_tower=True; projector and LLM trained
    for name, param in model.named_parameters():
        if any(key in name for key in forbidden_modules):
            param.requires_grad_(False)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    batch = _c02_batch()

    def step() -> torch.Tensor:
        opt.zero_grad()
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        return loss

    return model, step, _kw(optimizer=opt, inputs=batch)


def _c02_proof(bug: bool) -> bool:
    """After two steps some parameter of the vision tower (not the merger) has moved."""
    model, step, _ = _c02_build(bug)
    tower = {n: p.detach().clone() for n, p in model.model.visual.named_parameters()
             if "merger" not in n}
    for _ in range(2):
        step()
    params = dict(model.model.visual.named_parameters())
    return any(not torch.equal(params[n].detach(), v) for n, v in tower.items())


# --------------------------------------------------------------------------------------------- case-03
# huggingface/peft issue #3620 (fixed by PR #3629): ShadowPEFT on a decoder model for sequence classification
# (task_type SEQ_CLS) adds an auxiliary loss, CE(shadow_head(pool(s0)), labels), to the task loss. The pooling helper
# took the "last non-padding token" as `attention_mask.sum(1) - 1`, which is only right for right padding. Llama-style
# tokenizers pad on the left, so for every padded row the auxiliary head is trained on a padding position's shadow
# state (and the standalone shadow model built by unload_shadow() is trained to classify from padding). The task loss
# still falls, nothing warns. Fix in the PR: pool the rightmost non-padding position, `(mask.ne(0) * arange).argmax()`.
# The installed peft has the fix; the bug side runs the pre-fix auxiliary loss on the model instance.

_C03_IDS = torch.randint(3, 40, (4, 10), generator=_gen(3131))
_C03_MASK = torch.ones(4, 10, dtype=torch.long)
_C03_MASK[0, :4] = 0
_C03_MASK[1, :2] = 0
_C03_MASK[2, :5] = 0
_C03_IDS[_C03_MASK == 0] = 0  # left padding with pad_token_id 0
_C03_Y = torch.tensor([0, 1, 2, 1])


def _c03_pool_count(hidden: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """Pre-fix pooling: the count of real tokens minus one (right padding assumed)."""
    if attention_mask is None:
        return hidden[:, -1, :]
    idx = attention_mask.sum(dim=1) - 1
    return hidden[torch.arange(hidden.shape[0], device=hidden.device), idx]


def _c03_legacy_aux_loss(self: Any, labels: torch.Tensor,
                         attention_mask: torch.Tensor | None = None) -> torch.Tensor | None:
    from peft.tuners.shadow import model as shadow_model

    adapter_name = self.active_adapters[0]
    shadow_state = self._seed_shadow_state
    head = self._resolve_shadow_head(adapter_name)
    if shadow_state is None or head is None:
        return None
    if self._shadow_head_is_lm.get(adapter_name, False):
        return shadow_model._shifted_ce_loss(head(shadow_state), labels)
    pooled = _c03_pool_count(shadow_state, attention_mask)
    return shadow_model._sequence_classification_loss(head(pooled), labels)


def _c03_build(bug: bool) -> Case:
    """LlamaForSequenceClassification under ShadowPEFT (SEQ_CLS), left-padded batch, AdamW on the trainable part."""
    from peft import ShadowConfig, get_peft_model
    from transformers import LlamaForSequenceClassification

    torch.manual_seed(0)
    base = LlamaForSequenceClassification(_llama_config(num_labels=3))
    model = get_peft_model(base, ShadowConfig(task_type="SEQ_CLS", r=4, shadow_dropout=0.0)).train()
    if bug:
        model.base_model.shadow_auxiliary_loss = types.MethodType(_c03_legacy_aux_loss, model.base_model)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    batch = {"input_ids": _C03_IDS, "attention_mask": _C03_MASK, "labels": _C03_Y}

    def step() -> torch.Tensor:
        opt.zero_grad()
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        return loss

    return model, step, _kw(optimizer=opt, inputs=batch)


def _c03_proof(bug: bool) -> bool:
    """The auxiliary loss has a gradient on the shadow state at padding positions."""
    model, _, _ = _c03_build(bug)
    model(input_ids=_C03_IDS, attention_mask=_C03_MASK)
    seed = model.base_model._seed_shadow_state
    aux = model.base_model.shadow_auxiliary_loss(_C03_Y, _C03_MASK)
    (g,) = torch.autograd.grad(aux, seed)
    return bool(g[_C03_MASK == 0].abs().sum() > 0)



# --------------------------------------------------------------------------------------------- case-04
# deepset-ai/FARM issue #558: extractive QA fine-tuning (a BERT encoder with a span head trained by cross-entropy on
# start/end positions). FARM's `generate_labels` only keeps an answer when `answer_in_passage(start, end, passage_len)`
# holds, written as `passage_len > start_idx > 0`: an answer that begins on the passage's first token (start_idx 0)
# is judged "not in the passage" and labelled (0, 0), i.e. the [CLS] no-answer position. Every such sample trains the
# model to say "no answer" for an answerable question; training runs and the loss falls. Fix confirmed in the thread
# and merged into FARM's code: `passage_len > start_idx >= 0`.

_C04_Q, _C04_P = 3, 8  # question and passage token counts: [CLS] q [SEP] p [SEP] -> 14 tokens
_C04_ANSWERS = [(0, 1), (3, 4), (5, 6), (0, 2)]  # (start_t, end_t) relative to the passage
_C04_IDS = torch.randint(5, 50, (4, _C04_Q + _C04_P + 3), generator=_gen(3141))
_C04_IDS[:, 0] = 1
_C04_IDS[:, _C04_Q + 1] = 2
_C04_IDS[:, -1] = 2
_C04_TT = torch.zeros_like(_C04_IDS)
_C04_TT[:, _C04_Q + 2:] = 1


def _c04_answer_in_passage(start_idx: int, end_idx: int, passage_len: int, bug: bool) -> bool:
    if bug:
        return passage_len > start_idx > 0 and passage_len > end_idx > 0
    return passage_len > start_idx >= 0 and passage_len > end_idx > 0


def _c04_labels(bug: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """FARM's label generation: positions in the joined sequence, or (0, 0) ([CLS]) when judged impossible."""
    offset = 1 + _C04_Q + 1  # [CLS] question [SEP]
    starts, ends = [], []
    for s, e in _C04_ANSWERS:
        if _c04_answer_in_passage(s, e, _C04_P, bug):
            starts.append(offset + s)
            ends.append(offset + e)
        else:
            starts.append(0)
            ends.append(0)
    return torch.tensor(starts), torch.tensor(ends)


def _c04_build(bug: bool) -> Case:
    """BERT QA head fine-tuned on the labels FARM's preprocessing produced."""
    from transformers import BertConfig, BertForQuestionAnswering

    torch.manual_seed(0)
    model = BertForQuestionAnswering(BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2,
                                                num_attention_heads=2, intermediate_size=64,
                                                max_position_embeddings=32)).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    start, end = _c04_labels(bug)
    batch = {"input_ids": _C04_IDS, "token_type_ids": _C04_TT, "attention_mask": torch.ones_like(_C04_IDS),
             "start_positions": start, "end_positions": end}

    def step() -> torch.Tensor:
        opt.zero_grad()
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        return loss

    return model, step, _kw(optimizer=opt, inputs=batch)


def _c04_proof(bug: bool) -> bool:
    """For the answerable sample whose answer opens the passage, the loss pushes the [CLS] start logit up."""
    model, _, kw = _c04_build(bug)
    out = model(**kw["inputs"])
    out.start_logits.retain_grad()
    out.loss.backward()
    return bool(out.start_logits.grad[0, 0] < 0)


# --------------------------------------------------------------------------------------------- case-05
# huggingface/transformers PR #251: BERT fine-tuned for NER (token classification) on padded batches. The token
# classification head computed `CrossEntropyLoss()(logits.view(-1, num_labels), labels.view(-1))` over every position,
# and the padded positions carry label 0 (the first tag, "O") in the usual preprocessing, so every padding token is
# trained as an "O" token: the loss is diluted by easy padding targets and the head is pulled towards "O". Nothing
# warns and the loss falls. Fix merged in the PR: when an attention mask is given, only the active positions
# (`attention_mask.view(-1) == 1`) enter the loss. The user's step below computes the loss as the head did.

_C05_LENS = [12, 9, 7, 5]
_C05_IDS = torch.randint(3, 50, (4, 12), generator=_gen(3151))
_C05_MASK = torch.zeros(4, 12, dtype=torch.long)
for _row, _n in enumerate(_C05_LENS):
    _C05_MASK[_row, :_n] = 1
_C05_IDS[_C05_MASK == 0] = 0
_C05_TAGS = torch.randint(0, 5, (4, 12), generator=_gen(3152))
_C05_TAGS[_C05_MASK == 0] = 0  # padding labelled with tag id 0


def _c05_loss(logits: torch.Tensor, labels: torch.Tensor, attention_mask: torch.Tensor, bug: bool) -> torch.Tensor:
    num_labels = logits.shape[-1]
    if bug:
        return F.cross_entropy(logits.view(-1, num_labels), labels.view(-1))
    active = attention_mask.view(-1) == 1
    return F.cross_entropy(logits.view(-1, num_labels)[active], labels.view(-1)[active])


def _c05_build(bug: bool) -> Case:
    """BertForTokenClassification (5 tags) on a right-padded batch, the head's loss over the flattened positions."""
    from transformers import BertConfig, BertForTokenClassification

    torch.manual_seed(0)
    model = BertForTokenClassification(BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2,
                                                  num_attention_heads=2, intermediate_size=64,
                                                  max_position_embeddings=32, num_labels=5)).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = {"input_ids": _C05_IDS, "attention_mask": _C05_MASK, "labels": _C05_TAGS}

    def step() -> torch.Tensor:
        opt.zero_grad()
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        loss = _c05_loss(logits, batch["labels"], batch["attention_mask"], bug)
        loss.backward()
        opt.step()
        return loss

    return model, step, _kw(optimizer=opt, inputs=batch)


def _c05_proof(bug: bool) -> bool:
    """The loss has a gradient on the logits of padding positions."""
    model, _, kw = _c05_build(bug)
    b = kw["inputs"]
    logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
    (g,) = torch.autograd.grad(_c05_loss(logits, b["labels"], b["attention_mask"], bug), logits)
    return bool(g[b["attention_mask"] == 0].abs().sum() > 0)


CASES: list[BlindCase] = [
    BlindCase("b31a-01", "https://github.com/TinyLLaVA/TinyLLaVA_Factory/issues/17", "trainable tower under no_grad",
              "With tune_vision_tower the SigLIP tower is trainable and in the optimizer, but its forward runs under "
              "@torch.no_grad(), so it never gets a gradient and never moves.", _c01_build, _c01_proof),
    BlindCase("b31a-02", "https://github.com/hiyouga/LlamaFactory/pull/10139", "freeze by name misses parameter",
              "freeze_vision_tower freezes Qwen3-VL's tower by name keys that miss visual.pos_embed, so the tower's "
              "position embedding keeps training while the tower is meant to be frozen.", _c02_build, _c02_proof,
              known_miss="a freeze by name pattern that misses a parameter: which names were meant to be frozen is in the pattern, not in the setup"),
    BlindCase("b31a-03", "https://github.com/huggingface/peft/issues/3620", "last-token pooling on padding",
              "ShadowPEFT's auxiliary sequence-classification loss pools position mask.sum()-1, which for left-padded "
              "rows is a padding position, so the shadow head is trained on padding states.", _c03_build, _c03_proof,
              known_miss="an auxiliary head pooled at a padding position inside a library (peft) model: the padding-read probe runs on hand-written models only"),
    BlindCase("b31a-04", "https://github.com/deepset-ai/FARM/issues/558", "QA span label off by one",
              "Answers starting on the passage's first token fail `start_idx > 0` and are labelled (0, 0), so the QA "
              "head is trained to predict no-answer for answerable questions.", _c04_build, _c04_proof,
              known_miss="a QA span label off by one: which token a span label should name is data semantics"),
    BlindCase("b31a-05", "https://github.com/huggingface/transformers/pull/251", "padding in token-classification loss",
              "The NER loss runs over every position, padding included, with padding labelled as tag 0, so padding "
              "tokens are trained as 'O' tokens.", _c05_build, _c05_proof),
]
