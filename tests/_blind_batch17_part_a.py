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


# --------------------------------------------------------------------------------------------- case-02
# PPO step under ``accelerator.accumulate``: gradients cleared with ``policy.zero_grad`` (the wrapped model)
# instead of the accelerated optimizer's ``zero_grad``, which is a no-op on non-sync micro-steps.

_C02_ACC = 2
_C02_QUERY = torch.randint(3, 40, (_C02_ACC, 2, 4), generator=_gen(1711))
_C02_RESP = torch.randint(3, 40, (_C02_ACC, 2, 5), generator=_gen(1712))
_C02_ADV = torch.randn(_C02_ACC, 2, 5, generator=_gen(1713))


def _c02_policy() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
                      pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return LlamaForCausalLM(cfg)


def _c02_logprobs(policy: nn.Module, i: int) -> torch.Tensor:
    seq = torch.cat([_C02_QUERY[i], _C02_RESP[i]], 1)
    logits = policy(input_ids=seq).logits[:, _C02_QUERY.shape[2] - 1:-1]
    return torch.log_softmax(logits.float(), -1).gather(-1, _C02_RESP[i][..., None]).squeeze(-1)


def _c02_ppo_loss(policy: nn.Module, old_logprobs: torch.Tensor, i: int) -> torch.Tensor:
    logprob = _c02_logprobs(policy, i)
    ratio = torch.exp(logprob - old_logprobs[i])
    pg1 = -_C02_ADV[i] * ratio
    pg2 = -_C02_ADV[i] * torch.clamp(ratio, 0.8, 1.2)
    return torch.max(pg1, pg2).mean()


def _c02_setup(bug: bool):
    from accelerate import Accelerator

    accelerator = Accelerator(gradient_accumulation_steps=_C02_ACC, cpu=True)
    torch.manual_seed(1714)
    policy = _c02_policy().train()
    with torch.no_grad():
        old = torch.stack([_c02_logprobs(policy, i) for i in range(_C02_ACC)]) + 0.05
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-4)
    policy, acc_opt = accelerator.prepare(policy, optimizer)

    def step_fn() -> torch.Tensor:
        total = torch.zeros(())
        for i in range(_C02_ACC):  # one optimizer update = _C02_ACC micro-batches of rollouts
            with accelerator.accumulate(policy):
                loss = _c02_ppo_loss(policy, old, i)
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(policy.parameters(), 10.0)
                acc_opt.step()
                if bug:
                    policy.zero_grad(set_to_none=True)
                else:
                    acc_opt.zero_grad(set_to_none=True)
            total = total + loss.detach()
        return total / _C02_ACC

    return policy, optimizer, old, step_fn


def _c02_build(bug: bool) -> Case:
    """PPO policy update accumulated over two rollout micro-batches with accelerate's ``accumulate``."""
    policy, optimizer, _, step_fn = _c02_setup(bug)
    return policy, step_fn, _kw(optimizer=optimizer, inputs=(_C02_QUERY, _C02_RESP, _C02_ADV))


def _c02_proof(bug: bool) -> bool:
    """The gradient the optimizer steps on is far from the mean of the micro-batch gradients (first one lost)."""
    policy, optimizer, old, step_fn = _c02_setup(bug)
    ref = _c02_policy()
    ref.load_state_dict(policy.state_dict())
    per_mb = []
    for i in range(_C02_ACC):
        ref.zero_grad()
        _c02_ppo_loss(ref, old, i).backward()
        per_mb.append(torch.cat([p.grad.flatten() for p in ref.parameters()]))
    expected = torch.stack(per_mb).mean(0)
    seen: list[torch.Tensor] = []
    optimizer.register_step_pre_hook(
        lambda opt, a, k: seen.append(torch.cat([p.grad.flatten() for p in policy.parameters()])))
    step_fn()
    got = seen[0]
    return float((got - expected).norm() / expected.norm()) > 0.1


# --------------------------------------------------------------------------------------------- case-03
# VisionEncoderDecoderModel (Donut-style OCR fine-tune): labels are already shifted right into
# decoder_input_ids, but the loss went through the causal-LM loss, which shifts the labels a second time.

_C03_V = 30
_C03_LABELS = torch.randint(3, _C03_V, (3, 7), generator=_gen(1721))
_C03_LABELS[:, -1] = 2  # every target ends in </s>
_C03_PIX = torch.randn(3, 3, 16, 16, generator=_gen(1722))


def _c03_model() -> nn.Module:
    from transformers import BertConfig, VisionEncoderDecoderConfig, VisionEncoderDecoderModel, ViTConfig

    enc = ViTConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
                    image_size=16, patch_size=8)
    dec = BertConfig(vocab_size=_C03_V, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                     intermediate_size=32, max_position_embeddings=32, is_decoder=True, add_cross_attention=True,
                     pad_token_id=0)
    cfg = VisionEncoderDecoderConfig.from_encoder_decoder_configs(enc, dec)
    cfg.decoder_start_token_id = 1
    cfg.pad_token_id = 0
    return VisionEncoderDecoderModel(config=cfg)


def _c03_loss(model: nn.Module, bug: bool, keep: list | None = None) -> torch.Tensor:
    out = model(pixel_values=_C03_PIX, labels=_C03_LABELS)
    if keep is not None:
        out.logits.retain_grad()
        keep.append(out.logits)
    if bug:  # the model's loss_function (ForCausalLMLoss) on logits that are already aligned with labels
        from transformers.loss.loss_utils import ForCausalLMLoss

        return ForCausalLMLoss(out.logits, _C03_LABELS, vocab_size=_C03_V)
    return out.loss  # plain cross-entropy of logits[t] against labels[t]


def _c03_build(bug: bool) -> Case:
    """Tiny ViT encoder + BERT decoder trained on image->text with labels shifted into decoder inputs."""
    torch.manual_seed(1723)
    model = _c03_model().train()
    opt = torch.optim.AdamW(model.parameters(), lr=5e-4)
    step = _sgd_step(model, opt, lambda: _c03_loss(model, bug))
    return model, step, _kw(optimizer=opt, inputs=(_C03_PIX, _C03_LABELS))


def _c03_proof(bug: bool) -> bool:
    """The logits at the last decoder position (which must predict </s>) get exactly zero gradient."""
    model, _, _ = _c03_build(bug)
    keep: list = []
    _c03_loss(model, bug, keep).backward()
    return float(keep[0].grad[:, -1].abs().max()) == 0.0


# --------------------------------------------------------------------------------------------- case-04
# BioGptForSequenceClassification pooled at ``(input_ids != pad).sum(-1) - 1``: correct for right padding
# only; with a left-padding tokenizer the head reads a padding (or early) position instead of the last token.

_C04_PAD = 1
_C04_IDS = torch.tensor([  # padding_side="left"
    [_C04_PAD, _C04_PAD, _C04_PAD, _C04_PAD, 5, 9, 14, 7, 2],
    [_C04_PAD, _C04_PAD, 11, 6, 8, 13, 10, 4, 2],
    [17, 3, 12, 9, 5, 15, 18, 6, 2],
    [_C04_PAD, _C04_PAD, _C04_PAD, _C04_PAD, _C04_PAD, 16, 4, 19, 2],
])
_C04_MASK = (_C04_IDS != _C04_PAD).long()
_C04_Y = torch.tensor([0, 1, 2, 1])


def _c04_model() -> nn.Module:
    from transformers import BioGptConfig, BioGptForSequenceClassification

    cfg = BioGptConfig(vocab_size=24, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                       intermediate_size=64, max_position_embeddings=64, pad_token_id=_C04_PAD, num_labels=3)
    return BioGptForSequenceClassification(cfg)


def _c04_pooled(model: nn.Module, bug: bool, keep: list | None = None) -> torch.Tensor:
    hidden = model.biogpt(input_ids=_C04_IDS, attention_mask=_C04_MASK).last_hidden_state
    if keep is not None:
        hidden.retain_grad()
        keep.append(hidden)
    logits = model.score(hidden)
    if bug:  # the head's legacy index: number of non-pad tokens minus one
        last = torch.ne(_C04_IDS, model.config.pad_token_id).sum(-1) - 1
    else:  # rightmost non-pad token, whichever side was padded
        non_pad = (_C04_IDS != model.config.pad_token_id).int()
        last = (torch.arange(_C04_IDS.shape[-1], dtype=torch.int32) * non_pad).argmax(-1)
    return logits[torch.arange(_C04_IDS.shape[0]), last]


def _c04_build(bug: bool) -> Case:
    """Decoder-only sequence classifier fine-tuned on a left-padded batch."""
    torch.manual_seed(1731)
    model = _c04_model().train()
    opt = torch.optim.AdamW(model.parameters(), lr=2e-4)
    step = _sgd_step(model, opt, lambda: F.cross_entropy(_c04_pooled(model, bug), _C04_Y))
    return model, step, _kw(optimizer=opt, inputs=(_C04_IDS, _C04_MASK))


def _c04_proof(bug: bool) -> bool:
    """Some row's last real token gets no gradient from the classification loss (another position is pooled)."""
    model, _, _ = _c04_build(bug)
    model.eval()
    keep: list = []
    F.cross_entropy(_c04_pooled(model, bug, keep), _C04_Y).backward()
    g = keep[0].grad[:, -1]  # the last real token sits at the end of every left-padded row
    return bool((g.abs().amax(-1) == 0).any())


# --------------------------------------------------------------------------------------------- case-05
# Instruction-tuning target built as target_ids + [pad]: fine for models whose pad == eos, but with a
# tokenizer that has a separate eos (Gemma) the model is trained to end answers with <pad>, never with </s>.

_C05_PAD, _C05_BOS, _C05_EOS = 0, 1, 2
_C05_PAIRS = [  # (prompt ids, target ids), tokenized without special tokens
    ([5, 9, 14, 7], [20, 21, 22]),
    ([11, 6, 8], [23, 24, 25, 26]),
    ([17, 3, 12, 9, 5], [27, 28]),
]


def _c05_batch(bug: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    end = _C05_PAD if bug else _C05_EOS
    rows, labs = [], []
    for prompt, target in _C05_PAIRS:
        tgt = target + [end]
        rows.append([_C05_BOS] + prompt + tgt)
        labs.append([-100] * (1 + len(prompt)) + tgt)
    t = max(len(r) for r in rows)
    ids = torch.tensor([r + [_C05_PAD] * (t - len(r)) for r in rows])
    labels = torch.tensor([lb + [-100] * (t - len(lb)) for lb in labs])
    mask = torch.tensor([[1] * len(r) + [0] * (t - len(r)) for r in rows])
    return ids, mask, labels


def _c05_model() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
                      pad_token_id=_C05_PAD, bos_token_id=_C05_BOS, eos_token_id=_C05_EOS)
    return LlamaForCausalLM(cfg)


def _c05_build(bug: bool) -> Case:
    """Causal-LM instruction tune (prompt masked) whose targets end in <pad> (bug) or in </s> (fix)."""
    torch.manual_seed(1741)
    model = _c05_model().train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids, mask, labels = _c05_batch(bug)
    step = _sgd_step(model, opt, lambda: model(input_ids=ids, attention_mask=mask, labels=labels).loss)
    return model, step, _kw(optimizer=opt, inputs=(ids, mask, labels))


def _c05_proof(bug: bool) -> bool:
    """Nowhere does the loss pull the eos logit up: its gradient is >= 0 at every trained position."""
    model, _, _ = _c05_build(bug)
    ids, mask, labels = _c05_batch(bug)
    out = model(input_ids=ids, attention_mask=mask)
    logits = out.logits
    logits.retain_grad()
    shift = labels[:, 1:]
    F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), shift.reshape(-1), ignore_index=-100).backward()
    g_eos = logits.grad[:, :-1, _C05_EOS][shift != -100]
    return bool((g_eos >= 0).all())


CASES: list[BlindCase] = [
    BlindCase("b17-case-01", "https://github.com/NielsRogge/Transformers-Tutorials/issues/511",
              "image placeholder tokens left in LM labels",
              "the VLM collator copies input_ids into labels and masks only padding, so the expanded image-token "
              "positions are trained as next-token targets alongside the answer text", _c01_build, _c01_proof),
    BlindCase("b17-case-02", "https://github.com/tatsu-lab/alpaca_farm/issues/57",
              "gradient accumulation cleared on every micro-step",
              "under accelerate's accumulate context the PPO step clears gradients through the model's own "
              "zero_grad, which is not skipped on non-sync micro-steps, so each update uses only the last "
              "micro-batch's gradient", _c02_build, _c02_proof),
    BlindCase("b17-case-03", "https://github.com/huggingface/transformers/pull/40863",
              "labels shifted twice in encoder-decoder loss",
              "the decoder inputs are already the right-shifted labels, yet the loss shifts labels once more, so "
              "each position is trained to predict the token after its target and the final </s> is never "
              "learned", _c03_build, _c03_proof,
              known_miss="a causal-LM loss on encoder-decoder logits shifts the labels a second time; DATA-004 "
                         "reads the shift for causal LMs only, and the decoder inputs are built inside the "
                         "model from the labels"),
    BlindCase("b17-case-04", "https://github.com/huggingface/transformers/pull/46782",
              "sequence-classification head pools wrong token under left padding",
              "the classifier pools the hidden state at (non-pad count - 1), which with left padding is a padding "
              "or early position, so the head is trained on the wrong token for padded rows",
              _c04_build, _c04_proof,
              known_miss="not examined yet: batch 17 was measured at the end of round 7"),
    BlindCase("b17-case-05", "https://github.com/ludwig-ai/ludwig/pull/3945",
              "answer terminated with pad instead of eos",
              "each fine-tuning target is closed with the pad token, which differs from eos for this tokenizer, so "
              "the model is only ever taught to emit <pad> after an answer and never learns to produce </s>",
              _c05_build, _c05_proof),
]
