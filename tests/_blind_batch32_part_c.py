"""Blind batch 32 (part c): silent training bugs outside LLM fine-tuning, from public GitHub threads, with fixed twins.

Collected by someone who does not write the audit's checks. Themes: speech recognition (a Whisper distillation
collator), text-to-speech (a Tacotron stop-token loss, a codec-LM talker fine-tune), recommendation (a two-tower
retrieval model with sampling-bias correction) and knowledge distillation (an MLM student distilled from a teacher).
Every case builds the user's setup on a tiny model (transformers Whisper, BERT and Llama models from tiny configs in
code, small hand-written towers and decoders; nothing is downloaded) and proves the bug without the audit on real
tensors and real steps.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tests._blind import BlindCase, Case
from tests._blind_batch5 import _gen, _kw, _llama_config, _sgd_step

# --------------------------------------------------------------------------------------------- case-01
# huggingface/distil-whisper PR #79 (fixing PR #77, both by the maintainer): the Whisper distillation collator
# masks "the prompt and the BOS" out of the labels when a sample is conditioned on previous text
# (<|startofprev|> ... <|startoftranscript|> ...). PR #77 did it with
# `bos_index = argmax(labels == decoder_start_token_id) + 1`; for a sample WITHOUT a prompt the shifted labels hold
# no <|startoftranscript|>, argmax returns 0, and the `+ 1` masks the first real target (the language token) of
# every un-prompted sample. Training runs and the loss looks normal; the model is never taught the first token it
# has to predict (language identification silently degrades). Fix in #79: only add 1 where a BOS was found,
# `bos_index = torch.where(bos_index > 0, bos_index + 1, bos_index)`.

_C01_PAD, _C01_SOT, _C01_EOS, _C01_PREV = 0, 1, 2, 3
_C01_ROWS = [
    [_C01_SOT, 5, 6, 11, 12, 13, 14, _C01_EOS],                      # un-prompted
    [_C01_PREV, 20, 21, 22, _C01_SOT, 5, 6, 15, 16, 17, _C01_EOS],   # prompted with previous text
    [_C01_SOT, 7, 6, 18, 19, _C01_EOS],                              # un-prompted, other language
    [_C01_SOT, 5, 6, 23, 24, 25, 26, 27, 28, _C01_EOS],              # un-prompted
]
_C01_FEATS = torch.randn(4, 16, 16, generator=_gen(3201))  # (batch, mel bins, frames)


def _c01_collate(bug: bool) -> dict[str, torch.Tensor]:
    """DataCollatorSpeechSeq2SeqWithPadding from run_distillation.py, on label rows padded by the tokenizer."""
    width = max(len(r) for r in _C01_ROWS)
    ids = torch.full((len(_C01_ROWS), width), _C01_PAD, dtype=torch.long)
    attn = torch.zeros_like(ids)
    for i, row in enumerate(_C01_ROWS):
        ids[i, :len(row)] = torch.tensor(row)
        attn[i, :len(row)] = 1
    decoder_input_ids = ids[:, :-1]
    labels = ids[:, 1:]
    labels_mask = attn[:, 1:]
    labels = labels.masked_fill(labels_mask.ne(1), -100)
    bos_index = torch.argmax((labels == _C01_SOT).long(), dim=1)
    if bug:
        bos_index = bos_index + 1
    else:
        bos_index = torch.where(bos_index > 0, bos_index + 1, bos_index)
    prompt_mask = torch.arange(labels.shape[1]) < bos_index[:, None]
    labels = torch.where(prompt_mask, -100, labels)
    return {"input_features": _C01_FEATS, "labels": labels, "decoder_input_ids": decoder_input_ids}


def _c01_model() -> nn.Module:
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    cfg = WhisperConfig(vocab_size=40, num_mel_bins=16, d_model=32, encoder_layers=1, decoder_layers=1,
                        encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64,
                        max_source_positions=8, max_target_positions=32, pad_token_id=_C01_PAD,
                        bos_token_id=_C01_SOT, eos_token_id=_C01_EOS, decoder_start_token_id=_C01_SOT,
                        dropout=0.0)
    torch.manual_seed(0)
    return WhisperForConditionalGeneration(cfg).train()


def _c01_build(bug: bool) -> Case:
    """Tiny Whisper student trained on the collator's labels and decoder inputs."""
    model = _c01_model()
    batch = _c01_collate(bug)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = _sgd_step(model, opt, lambda: model(**batch).loss)
    return model, step, _kw(optimizer=opt, inputs=batch)


def _c01_proof(bug: bool) -> bool:
    """The language-token position of the un-prompted samples gets no gradient at all from the loss."""
    model = _c01_model()
    batch = _c01_collate(bug)
    out = model(**batch)
    out.logits.retain_grad()
    out.loss.backward()
    g = out.logits.grad
    unprompted = [0, 2, 3]
    return bool(g[unprompted, 0].abs().sum() == 0) and bool(g[1].abs().sum() > 0)


# --------------------------------------------------------------------------------------------- case-02
# tensorflow/recommenders issue #219 (confirmed by the maintainers, fixed in #220): a two-tower retrieval model is
# trained with in-batch softmax and the sampling-bias ("logQ") correction of Yi et al. 2019, whose corrected logits
# are s(x, y) - log p(y). The library's SamplingProbablityCorrection returned `logits + log(p)`: popular items,
# already over-represented as in-batch negatives, were penalised even more instead of being compensated. The loss
# decreases and nothing complains; retrieval quality is simply worse than with no correction at all (users measured
# it on MovieLens in #257). Fix: `logits - log(p)`. The user's step below is the torch port of the same loss.

_C02_USERS = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7])
_C02_ITEMS = torch.tensor([0, 1, 0, 2, 7, 1, 0, 9])          # item 0 is the popular one
_C02_POP = torch.tensor([0.30, 0.15, 0.10, 0.08, 0.07, 0.06, 0.06, 0.06, 0.06, 0.06])
_C02_PROB = _C02_POP[_C02_ITEMS]                               # candidate sampling probability per in-batch item


class _Tower(nn.Module):
    def __init__(self, n: int, dim: int = 16) -> None:
        super().__init__()
        self.emb = nn.Embedding(n, 32)
        self.mlp = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, dim))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.normalize(self.mlp(self.emb(ids)), dim=-1)


class _TwoTower(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.query = _Tower(8)
        self.candidate = _Tower(10)

    def forward(self, users: torch.Tensor, items: torch.Tensor) -> torch.Tensor:
        return self.query(users) @ self.candidate(items).T / 0.1   # (B, B) in-batch scores


def _c02_corrected(scores: torch.Tensor, prob: torch.Tensor, bug: bool) -> torch.Tensor:
    """SamplingProbablityCorrection: before #220 it added log(p), after it subtracts it."""
    return scores + torch.log(prob)[None, :] if bug else scores - torch.log(prob)[None, :]


def _c02_loss(model: _TwoTower, bug: bool) -> torch.Tensor:
    scores = model(_C02_USERS, _C02_ITEMS)
    logits = _c02_corrected(scores, _C02_PROB, bug)
    return F.cross_entropy(logits, torch.arange(len(_C02_USERS)))


def _c02_build(bug: bool) -> Case:
    """Two-tower retrieval with in-batch negatives and the sampling-probability correction."""
    torch.manual_seed(0)
    model = _TwoTower().train()
    opt = torch.optim.Adagrad(model.parameters(), lr=0.1)
    step = _sgd_step(model, opt, lambda: _c02_loss(model, bug))
    batch = {"users": _C02_USERS, "items": _C02_ITEMS, "candidate_sampling_probability": _C02_PROB}
    return model, step, _kw(optimizer=opt, inputs=batch)


def _c02_proof(bug: bool) -> bool:
    """Against the paper's correction, the popular item's logit is raised instead of lowered relative to a rare one."""
    torch.manual_seed(0)
    model = _TwoTower()
    with torch.no_grad():
        scores = model(_C02_USERS, _C02_ITEMS)
        shift = _c02_corrected(scores, _C02_PROB, bug) - scores      # what the correction did to each column
    popular, rare = 0, 7                                              # columns: item 0 (p=.30) and item 9 (p=.06)
    return bool(shift[0, popular] > shift[0, rare])


# --------------------------------------------------------------------------------------------- case-03
# neuralmagic/sparseml issue #674 (fixed in PR #675, merged by the maintainer): the distillation modifier's KD term
# was `kl_div(log_softmax(s/T), softmax(t/T), reduction="batchmean") * T**2`. For masked-language-model logits of
# shape (batch, seq_len, vocab), "batchmean" divides the summed KL by the batch size only, so the KD term is
# seq_len times the per-token KL and swamps the task loss it is mixed with ("extremely huge KD loss values in MLM
# experiments"). Training runs; the hardness weighting between the two losses is silently not the configured one.
# Fix: `reduction="sum"` divided by `student_val.numel() / student_val.shape[-1]` (the number of distributions).

_C03_IDS = torch.randint(4, 40, (4, 16), generator=_gen(3203))
_C03_MASK = torch.rand(4, 16, generator=_gen(3213)) < 0.3
_C03_MASK[:, 0] = True
_C03_INPUT = _C03_IDS.masked_fill(_C03_MASK, 3)                 # [MASK] = 3
_C03_LABELS = _C03_IDS.masked_fill(~_C03_MASK, -100)
_C03_T, _C03_HARDNESS = 2.0, 0.5


def _c03_bert(seed: int, layers: int) -> nn.Module:
    from transformers import BertConfig, BertForMaskedLM

    cfg = BertConfig(vocab_size=40, hidden_size=32, num_hidden_layers=layers, num_attention_heads=2,
                     intermediate_size=64, max_position_embeddings=32, pad_token_id=0)
    torch.manual_seed(seed)
    return BertForMaskedLM(cfg)


def _c03_kd(student_val: torch.Tensor, teacher_val: torch.Tensor, bug: bool) -> torch.Tensor:
    if bug:
        return F.kl_div(F.log_softmax(student_val / _C03_T, dim=-1), F.softmax(teacher_val / _C03_T, dim=-1),
                        reduction="batchmean") * _C03_T ** 2
    return (F.kl_div(F.log_softmax(student_val / _C03_T, dim=-1), F.softmax(teacher_val / _C03_T, dim=-1),
                     reduction="sum") * _C03_T ** 2 / (student_val.numel() / student_val.shape[-1]))


def _c03_setup(bug: bool) -> tuple[nn.Module, nn.Module, torch.optim.Optimizer]:
    teacher = _c03_bert(1, 2).eval()
    for p in teacher.parameters():
        p.requires_grad_(False)
    student = _c03_bert(0, 1).train()
    opt = torch.optim.AdamW(student.parameters(), lr=1e-3)
    return student, teacher, opt


def _c03_loss(student: nn.Module, teacher: nn.Module, bug: bool) -> torch.Tensor:
    out = student(input_ids=_C03_INPUT, labels=_C03_LABELS)
    with torch.no_grad():
        t_logits = teacher(input_ids=_C03_INPUT).logits
    kd = _c03_kd(out.logits, t_logits, bug)
    return _C03_HARDNESS * kd + (1 - _C03_HARDNESS) * out.loss


def _c03_build(bug: bool) -> Case:
    """BERT MLM student distilled from a frozen BERT teacher, KD and MLM losses mixed by hardness 0.5."""
    student, teacher, opt = _c03_setup(bug)
    step = _sgd_step(student, opt, lambda: _c03_loss(student, teacher, bug))
    return student, step, _kw(optimizer=opt, inputs={"input_ids": _C03_INPUT, "labels": _C03_LABELS})


def _c03_proof(bug: bool) -> bool:
    """The KD term is seq_len times the mean per-token KL(teacher || student) at temperature T."""
    student, teacher, _ = _c03_setup(bug)
    with torch.no_grad():
        s = student(input_ids=_C03_INPUT).logits
        t = teacher(input_ids=_C03_INPUT).logits
        kd = _c03_kd(s, t, bug)
        p_t = F.softmax(t / _C03_T, dim=-1)
        per_token = (p_t * (torch.log(p_t) - F.log_softmax(s / _C03_T, dim=-1))).sum(-1).mean() * _C03_T ** 2
    return bool(kd / per_token > 1.5)


# --------------------------------------------------------------------------------------------- case-04
# mozilla/TTS issue #606 (fixed by the same maintainer in coqui-ai/TTS PR #673 "Fix stopnet training"): Tacotron
# predicts one stop token per decoder step, and a decoder step emits r mel frames (reduction factor r). The stop loss
# BCELossMasked was masked with `output_lens`, the mel lengths in FRAMES, against stop targets of length T / r
# STEPS, so the mask covered (almost) every step: the padded steps after the end of each utterance stayed in the
# stop loss, and they were padded with target 0 ("do not stop"). Training runs and the stop loss goes down; the model
# is taught to keep decoding past the end of short utterances. Fix in #673: mask with
# `stop_target_lengths = ceil(mel_lengths / r)` and pad stop targets with 1.

_C04_R, _C04_MELS, _C04_T = 2, 8, 16
_C04_TEXT = torch.randint(1, 30, (3, 6), generator=_gen(3204))
_C04_MEL_LENS = torch.tensor([16, 11, 7])
_C04_MEL = torch.randn(3, _C04_T, _C04_MELS, generator=_gen(3214))
for _i, _n in enumerate(_C04_MEL_LENS.tolist()):
    _C04_MEL[_i, _n:] = 0.0


def _sequence_mask(lengths: torch.Tensor, max_len: int) -> torch.Tensor:
    return torch.arange(max_len)[None, :] < lengths[:, None]


def _c04_stop_targets(bug: bool) -> torch.Tensor:
    """prepare_stop_target + the per-step view in format_batch: a frame-level [0 .. 0 1] padded, then grouped by r."""
    pad_val = 0.0 if bug else 1.0
    rows = []
    for n in _C04_MEL_LENS.tolist():
        t = torch.zeros(n)
        t[-1] = 1.0
        rows.append(torch.cat([t, torch.full((_C04_T - n,), pad_val)]))
    frames = torch.stack(rows)
    return (frames.view(3, _C04_T // _C04_R, _C04_R).sum(2) > 0.0).float()


class _TinyTacotron(nn.Module):
    """Text encoder + autoregressive GRU decoder (teacher forced) emitting r frames and one stop logit per step."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(30, 32)
        self.prenet = nn.Linear(_C04_MELS * _C04_R, 32)
        self.rnn = nn.GRU(64, 32, batch_first=True)
        self.frames = nn.Linear(32, _C04_MELS * _C04_R)
        self.stopnet = nn.Linear(32 + _C04_MELS * _C04_R, 1)

    def forward(self, text: torch.Tensor, mel: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b = mel.shape[0]
        steps = mel.view(b, _C04_T // _C04_R, _C04_MELS * _C04_R)
        prev = torch.cat([torch.zeros_like(steps[:, :1]), steps[:, :-1]], dim=1)
        ctx = self.embed(text).mean(1, keepdim=True).expand(-1, steps.shape[1], -1)
        h, _ = self.rnn(torch.cat([torch.relu(self.prenet(prev)), ctx], dim=-1))
        out = self.frames(h)
        stop = self.stopnet(torch.cat([h, out], dim=-1)).squeeze(-1)
        return out.view(b, _C04_T, _C04_MELS), stop


def _bce_masked(x: torch.Tensor, target: torch.Tensor, length: torch.Tensor) -> torch.Tensor:
    """BCELossMasked as it was in the thread's version."""
    mask = _sequence_mask(length, target.size(1)).float()
    x = x * mask
    target = target * mask
    loss = F.binary_cross_entropy_with_logits(x, target, pos_weight=torch.tensor(10.0), reduction="sum")
    return loss / mask.sum()


def _c04_loss(model: _TinyTacotron, bug: bool) -> tuple[torch.Tensor, torch.Tensor]:
    mel_out, stop = model(_C04_TEXT, _C04_MEL)
    fmask = _sequence_mask(_C04_MEL_LENS, _C04_T).unsqueeze(-1).float()
    decoder_loss = ((mel_out - _C04_MEL).abs() * fmask).sum() / (fmask.sum() * _C04_MELS)
    stop_lens = _C04_MEL_LENS if bug else torch.ceil(_C04_MEL_LENS / _C04_R).long()
    stop_loss = _bce_masked(stop, _c04_stop_targets(bug), stop_lens)
    return decoder_loss + stop_loss, stop


def _c04_build(bug: bool) -> Case:
    """Tacotron-style decoder with reduction factor 2: masked L1 mel loss plus the masked stop-token BCE."""
    torch.manual_seed(0)
    model = _TinyTacotron().train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    step = _sgd_step(model, opt, lambda: _c04_loss(model, bug)[0])
    batch = {"text": _C04_TEXT, "mel": _C04_MEL, "mel_lengths": _C04_MEL_LENS}
    return model, step, _kw(optimizer=opt, inputs=batch)


def _c04_proof(bug: bool) -> bool:
    """The stop logits of decoder steps after an utterance's end get gradient (towards 'do not stop')."""
    torch.manual_seed(0)
    model = _TinyTacotron()
    loss, stop = _c04_loss(model, bug)
    stop.retain_grad()
    loss.backward()
    true_steps = torch.ceil(_C04_MEL_LENS / _C04_R).long()
    pad = ~_sequence_mask(true_steps, _C04_T // _C04_R)
    return bool(stop.grad[pad].abs().sum() > 0)


# --------------------------------------------------------------------------------------------- case-05
# QwenLM/Qwen3-TTS PR #278 (the bug measured in issues #179 and #371): the fine-tuning script sft_12hz.py feeds the
# talker (a causal LM over codec tokens) `inputs_embeds[:, :-1]` and `labels=codec_0_labels[:, 1:]`, shifting by hand
# as for a plain CrossEntropyLoss, but the talker's loss is transformers' ForCausalLMLoss, which shifts the labels
# once more. Position j is trained to predict the codec frame j + 2, not j + 1. The loss curve looks healthy; the
# fine-tuned voice speaks faster every epoch (a frame is skipped each step). Fix in #278: pass the full, unshifted
# inputs_embeds, attention_mask and labels and let the loss do its single shift.

_C05_B, _C05_T, _C05_PROMPT = 4, 14, 3
_C05_CODEC = torch.randint(3, 40, (_C05_B, _C05_T), generator=_gen(3205))
_C05_TEXT = torch.randn(_C05_B, _C05_T, 32, generator=_gen(3215))
_C05_ATTN = torch.ones(_C05_B, _C05_T, dtype=torch.long)
_C05_ATTN[2, 11:] = 0
_C05_ATTN[3, 9:] = 0
_C05_LABELS = _C05_CODEC.clone()
_C05_LABELS[:, :_C05_PROMPT] = -100                  # text / speaker prefix positions carry no codec target
_C05_LABELS[_C05_ATTN == 0] = -100


class _Talker(nn.Module):
    """A causal LM over codec tokens whose inputs are codec embeddings plus projected text embeddings."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import LlamaForCausalLM

        torch.manual_seed(0)
        self.lm = LlamaForCausalLM(_llama_config())
        self.text_projection = nn.Linear(32, 32)

    def embed(self) -> torch.Tensor:
        return self.lm.get_input_embeddings()(_C05_CODEC) + self.text_projection(_C05_TEXT)


def _c05_forward(talker: _Talker, bug: bool) -> Any:  # a transformers ModelOutput
    emb = talker.embed()
    if bug:
        return talker.lm(inputs_embeds=emb[:, :-1], attention_mask=_C05_ATTN[:, :-1], labels=_C05_LABELS[:, 1:])
    return talker.lm(inputs_embeds=emb, attention_mask=_C05_ATTN, labels=_C05_LABELS)


def _c05_build(bug: bool) -> Case:
    """The talker fine-tune step of sft_12hz.py on a tiny Llama talker."""
    talker = _Talker().train()
    opt = torch.optim.AdamW(talker.parameters(), lr=2e-4, weight_decay=0.01)
    step = _sgd_step(talker, opt, lambda: _c05_forward(talker, bug).loss)
    batch = {"codec_ids": _C05_CODEC, "text_embedding": _C05_TEXT, "attention_mask": _C05_ATTN,
             "codec_0_labels": _C05_LABELS}
    return talker, step, _kw(optimizer=opt, inputs=batch)


def _c05_proof(bug: bool) -> bool:
    """The loss the talker returns is the cross-entropy of position j's logits against frame j + 2."""
    talker = _Talker()
    with torch.no_grad():
        out = _c05_forward(talker, bug)
        logits = out.logits                               # positions 0 .. n-1 of the original sequence
        n = logits.shape[1]

        def ce(offset: int) -> float:
            k = min(n, _C05_T - offset)                   # logits j paired with label j + offset, inside the sequence
            return F.cross_entropy(logits[:, :k].reshape(-1, 40), _C05_LABELS[:, offset:offset + k].reshape(-1),
                                   ignore_index=-100).item()

        loss = out.loss.item()
    return math.isclose(loss, ce(2), rel_tol=1e-5) and not math.isclose(loss, ce(1), rel_tol=1e-3)


CASES: list[BlindCase] = [
    BlindCase("b32c-01", "https://github.com/huggingface/distil-whisper/pull/79", "first target label masked",
              "The distillation collator's prompt mask adds one to a BOS index of 0 on un-prompted samples, so the "
              "first real target (the language token) of every un-prompted sample is dropped from the loss.",
              _c01_build, _c01_proof,
              known_miss="the first target label of a seq2seq decoder masked: which label a decoder start stands for is data semantics"),
    BlindCase("b32c-02", "https://github.com/tensorflow/recommenders/issues/219", "sampling correction sign flipped",
              "The in-batch softmax's sampling-bias correction adds log(p) instead of subtracting it, so popular "
              "items are penalised further as negatives instead of being compensated.", _c02_build, _c02_proof,
              known_miss="a sampling-probability correction with its sign flipped: the correction's arithmetic is outside the model",
              # both true of the twin: item 0 is three users' positive and so a negative of the others (no accidental-hit
              # removal), and Adagrad at lr 0.1 moves the small init by ~its norm
              known_alarm=("DATA-014", "GRAD-005")),
    BlindCase("b32c-03", "https://github.com/neuralmagic/sparseml/issues/674", "KD loss reduction scale",
              "KL distillation with reduction='batchmean' on (batch, seq, vocab) logits sums over the sequence, so the "
              "KD term is seq_len times the per-token KL and outweighs the MLM loss it is mixed with.",
              _c03_build, _c03_proof,
              known_miss="a KD term averaged with batchmean over tokens: a term's weight against the others is not measured"),
    BlindCase("b32c-04", "https://github.com/mozilla/TTS/issues/606", "stop-token loss mask units",
              "The stop-token BCE is masked with mel lengths in frames against per-step targets (reduction factor 2), "
              "so padded decoder steps with target 'do not stop' stay in the loss.", _c04_build, _c04_proof,
              known_miss="a stop-token loss mask in frames where tokens are meant: mask units are data semantics"),
    BlindCase("b32c-05", "https://github.com/QwenLM/Qwen3-TTS/pull/278", "labels shifted twice",
              "The talker fine-tune shifts inputs and labels by hand and the causal-LM loss shifts again, so each "
              "position is trained to predict the codec frame two steps ahead.", _c05_build, _c05_proof,
              known_miss="labels shifted twice for a talker fed inputs_embeds: the shift is measured against the token ids a model receives, and this one receives none"),
]
