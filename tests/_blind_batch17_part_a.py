"""Blind batch 17 (part a): silent training bugs from public GitHub threads, each with its fixed twin."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from tests._blind import BlindCase, Case
from tests._blind_batch5 import _gen, _kw, _sgd_step

# --------------------------------------------------------------------------------------------- case-01
# LLaVA fine-tuning collator: labels copied from input_ids, only padding masked, so the expanded <image>
# placeholder positions stay in the causal-LM loss.

_C01_IMG = 39
_C01_PAD = 0


def _c01_model() -> nn.Module:
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    vc = CLIPVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                          image_size=16, patch_size=8, projection_dim=16)
    tc = LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
                     pad_token_id=_C01_PAD, bos_token_id=1, eos_token_id=2)
    cfg = LlavaConfig(vision_config=vc, text_config=tc, image_token_index=_C01_IMG, vision_feature_layer=-1,
                      vision_feature_select_strategy="default", pad_token_id=_C01_PAD)
    return LlavaForConditionalGeneration(cfg)


# "<s> <image>x4 prompt answer </s> <pad>..." -- the processor has expanded <image> into 4 patch positions
_C01_IDS = torch.tensor([
    [1, _C01_IMG, _C01_IMG, _C01_IMG, _C01_IMG, 12, 13, 20, 21, 22, 2, _C01_PAD],
    [1, _C01_IMG, _C01_IMG, _C01_IMG, _C01_IMG, 14, 15, 23, 24, 2, _C01_PAD, _C01_PAD],
    [1, _C01_IMG, _C01_IMG, _C01_IMG, _C01_IMG, 16, 17, 18, 25, 26, 27, 2],
])
_C01_MASK = (_C01_IDS != _C01_PAD).long()
_C01_PIX = torch.randn(3, 3, 16, 16, generator=_gen(1701))


def _c01_labels(bug: bool) -> torch.Tensor:
    labels = _C01_IDS.clone()
    labels[labels == _C01_PAD] = -100
    if not bug:
        labels[labels == _C01_IMG] = -100
    return labels


def _c01_build(bug: bool) -> Case:
    """LLaVA fine-tune whose collator masks only padding (bug) or padding and image tokens (fix) in labels."""
    torch.manual_seed(1702)
    model = _c01_model().train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    labels = _c01_labels(bug)

    def loss_fn() -> torch.Tensor:
        return model(input_ids=_C01_IDS, attention_mask=_C01_MASK, pixel_values=_C01_PIX, labels=labels).loss

    step = _sgd_step(model, opt, loss_fn)
    return model, step, _kw(optimizer=opt, inputs=(_C01_IDS, _C01_MASK, _C01_PIX, labels))


def _c01_proof(bug: bool) -> bool:
    """The model's loss differs from a hand cross-entropy over the text targets only (image positions count)."""
    model, _, _ = _c01_build(bug)
    labels = _c01_labels(bug)
    with torch.no_grad():
        out = model(input_ids=_C01_IDS, attention_mask=_C01_MASK, pixel_values=_C01_PIX, labels=labels)
    logits = out.logits[:, :-1].float()
    tgt = _C01_IDS[:, 1:].clone()
    tgt[(tgt == _C01_PAD) | (tgt == _C01_IMG)] = -100
    text_only = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1), ignore_index=-100)
    return abs(float(out.loss) - float(text_only)) > 1e-4


CASES: list[BlindCase] = [
    BlindCase("b17-case-01", "https://github.com/NielsRogge/Transformers-Tutorials/issues/511",
              "image placeholder tokens left in LM labels",
              "the VLM collator copies input_ids into labels and masks only padding, so the expanded image-token "
              "positions are trained as next-token targets alongside the answer text", _c01_build, _c01_proof),
]
