"""Blind batch 18 (part a): silent training bugs from public threads (transformers, trl, peft users), each with its fixed twin."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tests._blind import BlindCase, Case
from tests._blind_batch5 import _gen, _kw, _llama_config, _sgd_step

# --------------------------------------------------------------------------------------------- case-01
# DataCollatorForCompletionOnlyLM: the response template begins with the pad (= eos) token; the collator first
# sets pad positions of labels to -100, then looks for the template in labels, never finds it, and masks the
# whole row. Fix from the thread: match the template on input_ids, not on the already-masked labels.

_C01_PAD = 2  # pad_token = eos_token = "<|end_of_turn|>"
_C01_TEMPLATE = [2, 7, 8]  # "<|end_of_turn|>GPT4 Correct Assistant:"


def _c01_sample(g: torch.Generator, n_prompt: int, n_resp: int, total: int) -> list[int]:
    prompt = torch.randint(10, 40, (n_prompt,), generator=g).tolist()
    resp = torch.randint(10, 40, (n_resp,), generator=g).tolist()
    seq = [1, 5, 6] + prompt + _C01_TEMPLATE + resp + [_C01_PAD]
    return seq + [_C01_PAD] * (total - len(seq))


_C01_G = _gen(1801)
_C01_IDS = torch.tensor([_c01_sample(_C01_G, 4, 5, 20), _c01_sample(_C01_G, 6, 3, 20),
                         _c01_sample(_C01_G, 3, 6, 20), _c01_sample(_C01_G, 5, 4, 20)])
_C01_MASK = torch.ones_like(_C01_IDS)


def _c01_collate(bug: bool) -> torch.Tensor:
    """The completion-only collator: labels = ids with pads at -100, then everything up to the response masked."""
    ids = _C01_IDS
    labels = ids.clone()
    labels[labels == _C01_PAD] = -100  # DataCollatorForLanguageModeling(mlm=False)
    t = len(_C01_TEMPLATE)
    for i in range(ids.shape[0]):
        hay = (labels[i] if bug else ids[i]).tolist()
        starts = [j for j in range(len(hay) - t + 1) if hay[j:j + t] == _C01_TEMPLATE]
        if not starts:
            labels[i, :] = -100  # "Could not find response key ... This instance will be ignored in loss"
        else:
            labels[i, :starts[0] + t] = -100
    return labels


def _c01_build(bug: bool) -> Case:
    """SFT of a tiny Llama with completion-only labels whose response template starts with the pad token."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(_llama_config(pad_token_id=_C01_PAD)).train()
    labels = _c01_collate(bug)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = _sgd_step(model, opt, lambda: model(input_ids=_C01_IDS, attention_mask=_C01_MASK, labels=labels).loss)
    return model, step, _kw(optimizer=opt, inputs=_C01_IDS)


def _c01_proof(bug: bool) -> bool:
    """No token of the batch is supervised, so the loss of a step is not a finite number to learn from."""
    labels = _c01_collate(bug)
    _, step, _ = _c01_build(bug)
    loss = step()
    return int((labels != -100).sum()) == 0 and not bool(torch.isfinite(loss))


# --------------------------------------------------------------------------------------------- case-02
# bert2bert EncoderDecoderModel: the target token ids are passed as labels with their padding (id 0) left in
# place, so the loss is dominated by padding and the model learns to generate padding. Fix: pad -> -100.

_C02_G = _gen(1802)
_C02_SRC = torch.randint(5, 30, (6, 10), generator=_C02_G)
_C02_TGT_LEN = torch.tensor([4, 3, 5, 3, 4, 3])
_C02_TGT = torch.zeros(6, 14, dtype=torch.long)
for _i, _n in enumerate(_C02_TGT_LEN.tolist()):
    _C02_TGT[_i, 0] = 1  # [CLS]
    _C02_TGT[_i, 1:_n + 1] = torch.randint(5, 30, (_n,), generator=_C02_G)
    _C02_TGT[_i, _n + 1] = 2  # [SEP]
_C02_TGT_MASK = (_C02_TGT != 0).long()


def _c02_labels(bug: bool) -> torch.Tensor:
    labels = _C02_TGT.clone()
    if not bug:
        labels[labels == 0] = -100
    return labels


def _c02_model() -> nn.Module:
    from transformers import BertConfig, EncoderDecoderConfig, EncoderDecoderModel

    kw = dict(vocab_size=30, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
              max_position_embeddings=32, pad_token_id=0, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    enc, dec = BertConfig(**kw), BertConfig(**kw, is_decoder=True, add_cross_attention=True)
    cfg = EncoderDecoderConfig.from_encoder_decoder_configs(enc, dec)
    cfg.decoder_start_token_id, cfg.pad_token_id = 1, 0
    return EncoderDecoderModel(config=cfg)


def _c02_build(bug: bool) -> Case:
    """bert2bert seq2seq fine-tune: labels are the padded target ids (pad not replaced by -100 in the bug)."""
    torch.manual_seed(0)
    model = _c02_model().train()
    labels = _c02_labels(bug)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    step = _sgd_step(model, opt, lambda: model(input_ids=_C02_SRC, attention_mask=torch.ones_like(_C02_SRC),
                                               decoder_attention_mask=_C02_TGT_MASK, labels=labels).loss)
    return model, step, _kw(optimizer=opt, inputs=(_C02_SRC, labels))


def _c02_proof(bug: bool) -> bool:
    """Most supervised targets are padding, and after short training the decoder puts most of its mass on padding."""
    model, step, _ = _c02_build(bug)
    labels = _c02_labels(bug)
    for _ in range(30):
        step()
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=_C02_SRC, attention_mask=torch.ones_like(_C02_SRC),
                       decoder_attention_mask=_C02_TGT_MASK, labels=_C02_TGT).logits
    pad_share = float((labels[labels != -100] == 0).float().mean())
    pad_prob = float(logits.softmax(-1)[..., 0].mean())
    return pad_share > 0.5 and pad_prob > 0.3


# --------------------------------------------------------------------------------------------- case-03
# LightningModule.configure_optimizers returns the warmup LambdaLR without "interval": "step", so Lightning steps
# it once per epoch: the lr stays at lr_lambda(0) = 0 for the whole first epoch and the LoRA weights never move.
# Fix from the PR: {"scheduler": lr_scheduler, "interval": "step"} (the scheduler is stepped after every step).

_C03_X = torch.randn(16, 12, generator=_gen(1803))
_C03_NOISE = torch.randn(16, 12, generator=_gen(1804))
_C03_SIGMA = torch.rand(16, 1, generator=_gen(1805))


class _C03Denoiser(nn.Module):
    def __init__(self, d: int = 12, r: int = 4) -> None:
        super().__init__()
        self.base = nn.Linear(d, d)
        self.base.requires_grad_(False)
        self.lora_A = nn.Parameter(torch.randn(r, d) * 0.1)
        self.lora_B = nn.Parameter(torch.randn(d, r) * 0.01)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + x @ self.lora_A.t() @ self.lora_B.t()


def _c03_build(bug: bool) -> Case:
    """Flow-matching LoRA fine-tune with a linear-warmup LambdaLR (warmup 4000) stepped per epoch in the bug."""
    torch.manual_seed(0)
    model = _C03Denoiser().train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, weight_decay=1e-2,
                            betas=(0.8, 0.9))
    warmup, max_steps = 4000, 200000

    def lr_lambda(current_step: int) -> float:
        if current_step < warmup:
            return float(current_step) / float(max(1, warmup))
        return max(0.0, 1.0 - float(current_step - warmup) / float(max(1, max_steps - warmup)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda, last_epoch=-1)

    def loss_fn() -> torch.Tensor:
        noisy = _C03_SIGMA * _C03_NOISE + (1 - _C03_SIGMA) * _C03_X
        pred = model(noisy) * (-_C03_SIGMA) + noisy
        return F.mse_loss(pred, _C03_X)

    def step() -> torch.Tensor:
        opt.zero_grad()
        loss = loss_fn()
        loss.backward()
        opt.step()
        if not bug:  # "interval": "step"; with the default "epoch" Lightning steps it only at the epoch's end
            sched.step()
        return loss

    return model, step, _kw(optimizer=opt, inputs=(_C03_X, _C03_NOISE), lr_scheduler=sched, total_steps=50)


def _c03_proof(bug: bool) -> bool:
    """Within the first epoch (50 steps) the learning rate stays 0 and the LoRA weights do not change at all."""
    model, step, kw = _c03_build(bug)
    before = [p.detach().clone() for p in model.parameters() if p.requires_grad]
    for _ in range(50):
        step()
    after = [p.detach() for p in model.parameters() if p.requires_grad]
    return all(torch.equal(a, b) for a, b in zip(before, after))


# --------------------------------------------------------------------------------------------- case-04
# Trainer with label_smoothing_factor > 0 pops the labels and computes the loss with LabelSmoother on the raw
# logits, without the causal shift the model's own loss does: a causal LM is trained to output the token it is
# given (labels = input_ids), not the next one. Fix from the thread: LabelSmoother(..., shift_labels=True) for
# causal LMs.

_C04_IDS = torch.randint(3, 40, (8, 12), generator=_gen(1806))


def _c04_build(bug: bool) -> Case:
    """Causal-LM fine-tune with label smoothing 0.1 computed on unshifted labels (labels = input_ids) in the bug."""
    from transformers import LlamaForCausalLM
    from transformers.trainer_pt_utils import LabelSmoother

    torch.manual_seed(0)
    model = LlamaForCausalLM(_llama_config()).train()
    smoother = LabelSmoother(epsilon=0.1)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    labels = _C04_IDS.clone()

    def loss_fn() -> torch.Tensor:
        outputs = model(input_ids=_C04_IDS)  # Trainer popped "labels" from the inputs
        return smoother(outputs, labels, shift_labels=not bug)

    step = _sgd_step(model, opt, loss_fn)
    return model, step, _kw(optimizer=opt, inputs=_C04_IDS)


def _c04_proof(bug: bool) -> bool:
    """After short training the LM predicts its own input token at most positions (a copy task), not the next."""
    model, step, _ = _c04_build(bug)
    for _ in range(15):
        step()
    model.eval()
    with torch.no_grad():
        pred = model(input_ids=_C04_IDS).logits.argmax(-1)
    return float((pred == _C04_IDS).float().mean()) > 0.5


# --------------------------------------------------------------------------------------------- case-05
# LoRA/alpaca fine-tune data preparation tokenizes "prompt + response" without appending the EOS token, so the
# model is never trained to emit EOS after a response and generates on until max tokens. Fix from the thread:
# append tokenizer.eos_token_id to every training example (labels follow input_ids, padding -100).

_C05_BOS, _C05_EOS, _C05_PAD = 1, 2, 0
_C05_G = _gen(1807)
_C05_TEXTS = [torch.randint(3, 40, (n,), generator=_C05_G).tolist() for n in (9, 7, 10, 8)]
_C05_LEN = 14


def _c05_batch(bug: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    rows, masks = [], []
    for toks in _C05_TEXTS:
        seq = [_C05_BOS] + toks + ([] if bug else [_C05_EOS])
        masks.append([1] * len(seq) + [0] * (_C05_LEN - len(seq)))
        rows.append(seq + [_C05_PAD] * (_C05_LEN - len(seq)))
    ids, mask = torch.tensor(rows), torch.tensor(masks)
    labels = ids.masked_fill(mask == 0, -100)
    return ids, mask, labels


def _c05_build(bug: bool) -> Case:
    """Causal-LM SFT of a tiny Llama on examples tokenized without the EOS token in the bug."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(_llama_config(pad_token_id=_C05_PAD)).train()
    ids, mask, labels = _c05_batch(bug)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    step = _sgd_step(model, opt, lambda: model(input_ids=ids, attention_mask=mask, labels=labels).loss)
    return model, step, _kw(optimizer=opt, inputs=ids)


def _c05_proof(bug: bool) -> bool:
    """After training, at the end of each training response the model gives EOS almost no probability."""
    model, step, _ = _c05_build(bug)
    for _ in range(25):
        step()
    model.eval()
    probs = []
    with torch.no_grad():
        for toks in _C05_TEXTS:
            logits = model(input_ids=torch.tensor([[_C05_BOS] + toks])).logits[0, -1]
            probs.append(float(logits.softmax(-1)[_C05_EOS]))
    return sum(probs) / len(probs) < 0.05


# --------------------------------------------------------------------------------------------- cases

CASES: list[BlindCase] = [
    BlindCase("b18-case-01", "https://github.com/huggingface/trl/issues/1191",
              "completion-only label masking removes every target",
              "The response template starts with the pad/eos token, which the collator already masked in labels, so "
              "the template is never found and every label of the batch is -100: nothing is trained.",
              _c01_build, _c01_proof,
              known_alarm=('DATA-003',)),
    BlindCase("b18-case-02", "https://github.com/huggingface/transformers/issues/7896",
              "padding tokens left in seq2seq labels",
              "Target padding (id 0) is not replaced by -100 in the labels, so the loss is mostly padding and the "
              "encoder-decoder learns to emit padding.",
              _c02_build, _c02_proof),
    BlindCase("b18-case-03", "https://github.com/ace-step/ACE-Step/pull/198",
              "per-step warmup scheduler stepped per epoch",
              "The warmup LambdaLR is returned without interval='step', so Lightning steps it once per epoch and the "
              "learning rate stays at its step-0 value of 0 for the whole epoch: the adapter never trains.",
              _c03_build, _c03_proof,
              known_miss="the reproduction plans 50 steps inside a 4,000-step warmup, so both sides get SCHED-002 (the "
                         "bug's adds that, unstepped, the lr stays at its first value 0 per epoch); with the thread's "
                         "200,000 planned steps SCHED-003 tells them apart",
              known_alarm=('SCHED-002',)),
    BlindCase("b18-case-04", "https://github.com/huggingface/transformers/issues/17960",
              "label smoothing loss skips the causal-LM label shift",
              "With label_smoothing_factor > 0 the loss is computed on unshifted labels, so the causal LM learns to "
              "copy the current input token instead of predicting the next one.",
              _c04_build, _c04_proof),
    BlindCase("b18-case-05", "https://github.com/johnsmith0031/alpaca_lora_4bit/issues/35",
              "EOS token missing from training examples",
              "Training examples are tokenized without the EOS token, so the fine-tuned model never learns to end a "
              "response and keeps generating.",
              _c05_build, _c05_proof),
]
