"""Blind batch 15 (part a): silent training bugs from public GitHub threads, each with its fixed twin."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tests._blind import BlindCase, Case
from tests._blind_batch5 import _gen, _kw, _sgd_step

# --------------------------------------------------------------------------------------------- case-01

_SOT, _EOT, _LANG, _TASK, _NOTS = 50, 49, 51, 52, 53  # <|startoftranscript|>, <|endoftext|>, <|en|>, <|transcribe|>, <|notimestamps|>


def _c01_model() -> nn.Module:
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    cfg = WhisperConfig(vocab_size=56, num_mel_bins=8, d_model=16, encoder_layers=1, decoder_layers=1,
                        encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
                        decoder_ffn_dim=32, max_source_positions=10, max_target_positions=16,
                        bos_token_id=_EOT, eos_token_id=_EOT, pad_token_id=_EOT, decoder_start_token_id=_SOT,
                        begin_suppress_tokens=None, suppress_tokens=None)
    return WhisperForConditionalGeneration(cfg)


def _c01_tokenize(text_ids: list[int]) -> list[int]:
    """What the Whisper tokenizer (language/task set, no timestamps) returns for a transcript."""
    return [_SOT, _LANG, _TASK, _NOTS, *text_ids, _EOT]


_C01_FEATS = torch.randn(3, 8, 20, generator=_gen(1501))
_C01_TEXTS = [[5, 9, 12, 7], [20, 3, 8], [14, 30, 2, 6, 11]]


def _c01_collate(bug: bool) -> torch.Tensor:
    """DataCollatorSpeechSeq2SeqWithPadding: pad labels with -100, cut the leading start token it will re-add."""
    seqs = [_c01_tokenize(t) for t in _C01_TEXTS]
    n = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), n), _EOT)
    mask = torch.zeros(len(seqs), n, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = torch.tensor(s)
        mask[i, :len(s)] = 1
    labels = ids.masked_fill(mask.ne(1), -100)
    start_id = _EOT if bug else _SOT  # bug: tokenizer.bos_token_id (<|endoftext|>); fix: decoder_start_token_id
    if (labels[:, 0] == start_id).all().cpu().item():
        labels = labels[:, 1:]
    return labels


def _c01_build(bug: bool) -> Case:
    """Whisper fine-tune whose collator looks for bos_token_id to strip the start token the model prepends again."""
    torch.manual_seed(0)
    model = _c01_model().train()
    labels = _c01_collate(bug)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = _sgd_step(model, opt, lambda: model(input_features=_C01_FEATS, labels=labels).loss)
    return model, step, _kw(optimizer=opt, inputs=(_C01_FEATS, labels))


def _c01_proof(bug: bool) -> bool:
    """After a short fine-tune, the model's first token after <|startoftranscript|> is a second start token,
    not the language token that generation forces next."""
    model, step, _ = _c01_build(bug)
    for _ in range(5):
        step()
    model.eval()
    with torch.no_grad():
        logits = model(input_features=_C01_FEATS, decoder_input_ids=torch.full((3, 1), _SOT)).logits
    return bool((logits[:, 0].argmax(-1) == _SOT).all())


CASES: list[BlindCase] = [
    BlindCase("b15-case-01", "https://github.com/huggingface/transformers/issues/29973", "label construction",
              "the Whisper collator checks labels for bos_token_id instead of decoder_start_token_id, so the start "
              "token is never stripped and the model is trained on a doubled <|startoftranscript|>",
              _c01_build, _c01_proof),
]
