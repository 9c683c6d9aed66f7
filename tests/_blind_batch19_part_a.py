"""Blind batch 19 (part a): silent Hugging Face fine-tuning bugs from public threads, each with its fixed twin.

Collected by someone who does not write the audit's checks. Every case builds the user's setup on a tiny real
model from a config in code (transformers T5, CLIP and Llama; a real fast tokenizer over a vocabulary built
in code, real transformers collators and schedulers; nothing is downloaded) and proves the bug without the audit.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tests._blind import BlindCase, Case
from tests._blind_batch5 import _gen, _kw, _llama_config, _sgd_step

# --------------------------------------------------------------------------------------------- case-01
# The seq2seq fine-tuning example prepares T5 targets the BART way: decoder_input_ids = target_ids[:, :-1] and
# lm_labels = target_ids[:, 1:]. T5's targets carry no BOS, so the first target token is never a label and the
# decoder never starts from its decoder_start_token_id. Fix in the thread (PR #6654): pass the full targets as
# labels and let T5 build decoder_input_ids with _shift_right(labels) (decoder start token prepended).

_C01_SRC = torch.randint(2, 40, (4, 10), generator=_gen(1901))
_C01_TGT = torch.cat([torch.randint(2, 40, (4, 6), generator=_gen(1902)), torch.ones(4, 1, dtype=torch.long)], 1)


def _c01_model() -> nn.Module:
    from transformers import T5Config, T5ForConditionalGeneration

    cfg = T5Config(vocab_size=40, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
                   dropout_rate=0.0, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)
    return T5ForConditionalGeneration(cfg)


def _c01_loss(model: nn.Module, bug: bool) -> torch.Tensor:
    mask = torch.ones_like(_C01_SRC)
    if bug:
        y_ids = _C01_TGT[:, :-1].contiguous()
        lm_labels = _C01_TGT[:, 1:].clone()
        return model(input_ids=_C01_SRC, attention_mask=mask, decoder_input_ids=y_ids, labels=lm_labels).loss
    return model(input_ids=_C01_SRC, attention_mask=mask, labels=_C01_TGT.clone()).loss


def _c01_build(bug: bool) -> Case:
    """T5 fine-tune whose decoder inputs / labels are made by slicing the targets instead of shifting them."""
    torch.manual_seed(0)
    model = _c01_model().train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    step = _sgd_step(model, opt, lambda: _c01_loss(model, bug))
    return model, step, _kw(optimizer=opt, inputs=_C01_SRC)


def _c01_proof(bug: bool) -> bool:
    """Capture what the step feeds T5: the first target token is never a label and the decoder's first input
    is not the decoder start token."""
    model, step, _ = _c01_build(bug)
    seen: dict[str, Any] = {}

    def grab(_mod: nn.Module, _args: Any, kwargs: dict[str, Any]) -> None:
        seen.update(kwargs)

    handle = model.register_forward_pre_hook(grab, with_kwargs=True)
    step()
    handle.remove()
    labels = seen["labels"]
    dec_in = seen.get("decoder_input_ids")
    if dec_in is None:
        dec_in = model._shift_right(labels)
    start_ok = bool((dec_in[:, 0] == model.config.decoder_start_token_id).all())
    first_supervised = bool((labels[:, 0] == _C01_TGT[:, 0]).all())
    return not (start_ok and first_supervised)


# --------------------------------------------------------------------------------------------- case-02
# Fine-tuning CLIP with its weights in float16 (the checkpoint's dtype) and a plain torch.optim.Adam: after a
# single optimizer step the parameters hold NaN/inf and every output is NaN (Adam's eps=1e-8 and its squared-
# gradient state underflow to zero in fp16). Fix in the thread: train with float32 weights (model.float()),
# keeping fp16 only for mixed-precision compute.

_C02_IDS = torch.randint(3, 50, (4, 8), generator=_gen(1911))
_C02_PIX = torch.randn(4, 3, 16, 16, generator=_gen(1912))


def _c02_model() -> nn.Module:
    from transformers import CLIPConfig, CLIPModel

    cfg = CLIPConfig(
        text_config=dict(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, max_position_embeddings=16, bos_token_id=1, eos_token_id=2,
                         pad_token_id=0),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                           image_size=16, patch_size=8, num_channels=3),
        projection_dim=16)
    return CLIPModel(cfg)


def _c02_loss(model: nn.Module) -> torch.Tensor:
    dtype = next(model.parameters()).dtype
    out = model(input_ids=_C02_IDS, pixel_values=_C02_PIX.to(dtype))
    img = out.image_embeds / out.image_embeds.norm(dim=-1, keepdim=True)
    txt = out.text_embeds / out.text_embeds.norm(dim=-1, keepdim=True)
    sim = img @ txt.T
    labels = torch.arange(sim.shape[0])
    return (F.cross_entropy(sim, labels) + F.cross_entropy(sim.T, labels)) / 2


def _c02_build(bug: bool) -> Case:
    """CLIP contrastive fine-tune with the whole model cast to float16 and a default torch Adam."""
    torch.manual_seed(0)
    model = _c02_model().train()
    model = model.half() if bug else model.float()
    opt = torch.optim.Adam(model.parameters())
    step = _sgd_step(model, opt, lambda: _c02_loss(model))
    return model, step, _kw(optimizer=opt, inputs=(_C02_IDS, _C02_PIX))


def _c02_proof(bug: bool) -> bool:
    """One optimizer step leaves non-finite parameters and a NaN loss on the next forward."""
    model, step, _ = _c02_build(bug)
    step()
    bad = [n for n, p in model.named_parameters() if not bool(torch.isfinite(p).all())]
    with torch.no_grad():
        nxt = _c02_loss(model)
    return bool(bad) and not bool(torch.isfinite(nxt))


# --------------------------------------------------------------------------------------------- case-03
# "Train only after" instruction tuning: the dataset sets labels to -100 on the prompt so that only the response
# is trained, but batches go through DataCollatorForLanguageModeling(mlm=False), which rebuilds labels from
# input_ids and throws the -100 prompt mask away: the model is trained on the prompts too. Fix in the thread:
# collate without overwriting the dataset's labels (the twin uses DataCollatorForSeq2Seq, which only pads the
# given labels with -100). Examples are tokenized to a fixed cutoff length as the thread's script does.

_C03_WORDS = ["<pad>", "<s>", "</s>", "<unk>"] + [f"w{i}" for i in range(36)]


def _c03_tokenizer() -> Any:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(_C03_WORDS)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", bos_token="<s>",
                                   eos_token="</s>", unk_token="<unk>")


_C03_CUTOFF = 12
_C03_PAIRS = [("w1 w2 w3 w4 w5", "w20 w21"), ("w6 w7 w8", "w22 w23 w24 w25"),
              ("w9 w10 w11 w12", "w26 w27 w28"), ("w13 w14", "w29 w30 w31 w32")]


def _c03_features(tok: Any) -> tuple[list[dict[str, list[int]]], list[int]]:
    feats, prompt_lens = [], []
    for prompt, response in _C03_PAIRS:
        p = [tok.bos_token_id] + tok(prompt, add_special_tokens=False)["input_ids"]
        r = tok(response, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        n_pad = _C03_CUTOFF - len(p) - len(r)  # tokenized to a fixed cutoff length, padded on the right
        feats.append({"input_ids": p + r + [tok.pad_token_id] * n_pad,
                      "attention_mask": [1] * (len(p) + len(r)) + [0] * n_pad,
                      "labels": [-100] * len(p) + r + [-100] * n_pad})
        prompt_lens.append(len(p))
    return feats, prompt_lens


def _c03_batch(bug: bool) -> dict[str, torch.Tensor]:
    from transformers import DataCollatorForLanguageModeling, DataCollatorForSeq2Seq

    tok = _c03_tokenizer()
    tok.padding_side = "right"
    feats, _ = _c03_features(tok)
    if bug:
        collator: Any = DataCollatorForLanguageModeling(tokenizer=tok, mlm=False)
    else:
        collator = DataCollatorForSeq2Seq(tokenizer=tok, label_pad_token_id=-100, return_tensors="pt")
    return dict(collator([dict(f) for f in feats]))


def _c03_build(bug: bool) -> Case:
    """Response-only SFT of a Llama whose masked labels are collated by DataCollatorForLanguageModeling."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(_llama_config()).train()
    batch = _c03_batch(bug)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-4)
    step = _sgd_step(model, opt, lambda: model(**batch).loss)
    return model, step, _kw(optimizer=opt, inputs=batch)


def _c03_proof(bug: bool) -> bool:
    """The collated labels supervise prompt positions that the dataset had masked with -100."""
    tok = _c03_tokenizer()
    _, prompt_lens = _c03_features(tok)
    labels = _c03_batch(bug)["labels"]
    return any(bool((labels[i, :n] != -100).any()) for i, n in enumerate(prompt_lens))


# --------------------------------------------------------------------------------------------- case-04
# Reward model on a causal LM with pad_token = eos_token and a chat template that puts EOS after the prompt.
# The sequence-classification head pools at "first pad token - 1"
# (torch.eq(input_ids, pad_token_id).int().argmax(-1) - 1), i.e. just before the first EOS: the end of the
# shared prompt. Chosen and rejected then get the same reward, the pairwise loss sits at log 2 and nothing
# trains. Fix (PR #35911, closing the thread): pool at the rightmost non-padding token.

_C04_PAD = 2  # pad_token_id = eos_token_id


def _c04_pairs() -> tuple[torch.Tensor, torch.Tensor]:
    g = _gen(1931)
    chosen, rejected = [], []
    for _ in range(4):
        prompt = torch.randint(3, 40, (5,), generator=g).tolist()
        c = torch.randint(3, 40, (4,), generator=g).tolist()
        r = torch.randint(3, 40, (3,), generator=g).tolist()
        chosen.append([1] + prompt + [_C04_PAD] + c + [_C04_PAD])
        rejected.append([1] + prompt + [_C04_PAD] + r + [_C04_PAD])
    width = max(len(s) for s in chosen + rejected) + 2

    def pad(rows: list[list[int]]) -> torch.Tensor:
        return torch.tensor([s + [_C04_PAD] * (width - len(s)) for s in rows])

    return pad(chosen), pad(rejected)


_C04_CHOSEN, _C04_REJECTED = _c04_pairs()


class _RewardModel(nn.Module):
    """Llama backbone plus a scalar score head pooled at one token per sequence."""

    def __init__(self, first_pad_pooling: bool) -> None:
        super().__init__()
        from transformers import LlamaModel

        self.first_pad_pooling = first_pad_pooling
        self.model = LlamaModel(_llama_config(pad_token_id=_C04_PAD, eos_token_id=_C04_PAD))
        self.score = nn.Linear(32, 1, bias=False)

    def pool_index(self, ids: torch.Tensor) -> torch.Tensor:
        if self.first_pad_pooling:
            return torch.eq(ids, _C04_PAD).int().argmax(-1) - 1
        non_pad = (ids != _C04_PAD).int()
        return (torch.arange(ids.shape[-1]) * non_pad).argmax(-1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        mask = torch.ones_like(ids)
        h = self.model(input_ids=ids, attention_mask=mask).last_hidden_state
        logits = self.score(h).squeeze(-1)
        return logits[torch.arange(ids.shape[0]), self.pool_index(ids)]


def _c04_loss(model: _RewardModel) -> torch.Tensor:
    return -F.logsigmoid(model(_C04_CHOSEN) - model(_C04_REJECTED)).mean()


def _c04_build(bug: bool) -> Case:
    """Pairwise reward-model training whose head pools before the first EOS (= pad) token."""
    torch.manual_seed(0)
    model = _RewardModel(first_pad_pooling=bug).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = _sgd_step(model, opt, lambda: _c04_loss(model))
    return model, step, _kw(optimizer=opt, inputs=(_C04_CHOSEN, _C04_REJECTED))


def _c04_proof(bug: bool) -> bool:
    """Chosen and rejected get identical rewards, and one backward leaves every gradient exactly zero."""
    model, step, _ = _c04_build(bug)
    with torch.no_grad():
        same = torch.equal(model(_C04_CHOSEN), model(_C04_REJECTED))
    step()
    zero = all(p.grad is None or float(p.grad.abs().sum()) == 0.0 for p in model.parameters())
    return same and zero


# --------------------------------------------------------------------------------------------- case-05
# The Accelerate NLP example with gradient accumulation builds get_linear_schedule_with_warmup with
# num_training_steps = len(train_dataloader) * num_epochs, but steps the scheduler only once per optimizer update
# (every gradient_accumulation_steps micro-batches). The schedule's horizon is gradient_accumulation_steps times
# too long, so the linear decay barely starts and the run ends at most of the peak learning rate. Fix in the
# thread: num_training_steps = len(train_dataloader) * num_epochs // gradient_accumulation_steps.

_C05_ACCUM, _C05_EPOCHS, _C05_MICRO = 4, 2, 4
_C05_IDS = torch.randint(3, 40, (_C05_MICRO, 2, 9), generator=_gen(1941))
_C05_Y = torch.randint(0, 2, (_C05_MICRO, 2), generator=_gen(1942))
_C05_OPT_STEPS = _C05_MICRO * _C05_EPOCHS // _C05_ACCUM


def _c05_model() -> nn.Module:
    from transformers import LlamaForSequenceClassification

    return LlamaForSequenceClassification(_llama_config(num_labels=2))


def _c05_setup(bug: bool) -> tuple[nn.Module, Any, torch.optim.Optimizer, Any]:
    from transformers import get_linear_schedule_with_warmup

    torch.manual_seed(0)
    model = _c05_model().train()
    opt = torch.optim.AdamW(model.parameters(), lr=2e-5)
    n_train = _C05_MICRO * _C05_EPOCHS if bug else _C05_MICRO * _C05_EPOCHS // _C05_ACCUM
    sched = get_linear_schedule_with_warmup(opt, num_warmup_steps=0, num_training_steps=n_train)
    cursor = {"i": 0}

    def step() -> torch.Tensor:
        loss = torch.zeros(())
        for _ in range(_C05_ACCUM):
            i = cursor["i"] % _C05_MICRO
            cursor["i"] += 1
            loss = model(input_ids=_C05_IDS[i], labels=_C05_Y[i]).loss / _C05_ACCUM
            loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad()
        return loss

    return model, step, opt, sched


def _c05_build(bug: bool) -> Case:
    """Sequence classifier trained with gradient accumulation and a linear schedule sized in micro-batches."""
    model, step, opt, sched = _c05_setup(bug)
    return model, step, _kw(optimizer=opt, inputs=_C05_IDS[0], lr_scheduler=sched, total_steps=_C05_OPT_STEPS)


def _c05_proof(bug: bool) -> bool:
    """After the whole run (every optimizer update) the learning rate is still above half its peak instead of
    having decayed to zero."""
    _, step, _, sched = _c05_setup(bug)
    peak = sched.base_lrs[0]
    for _ in range(_C05_OPT_STEPS):
        step()
    return sched.get_last_lr()[0] > 0.5 * peak


CASES: list[BlindCase] = [
    BlindCase("b19-case-01", "https://github.com/huggingface/transformers/issues/5987", "seq2seq label shift",
              "T5 targets are sliced into decoder_input_ids = y[:, :-1] and labels = y[:, 1:], so the first target "
              "token is never trained and the decoder never starts from its start token.", _c01_build, _c01_proof),
    BlindCase("b19-case-02", "https://github.com/openai/CLIP/issues/40", "fp16 weights with Adam",
              "CLIP is fine-tuned with float16 weights and a default Adam; one update turns the parameters into "
              "NaN/inf and every later output is NaN.", _c02_build, _c02_proof),
    BlindCase("b19-case-03", "https://github.com/oobabooga/textgen/issues/4031", "collator overwrites label mask",
              "DataCollatorForLanguageModeling rebuilds labels from input_ids, discarding the -100 prompt mask, so "
              "response-only tuning trains on the prompts too.", _c03_build, _c03_proof,
              known_miss="the collator rebuilds labels from input_ids before the step: the supervised prompt positions look like ordinary next-token targets, and which part of a row is the prompt is not in the batch"),
    BlindCase("b19-case-04", "https://github.com/huggingface/transformers/issues/35352", "reward pooling index",
              "With pad = eos and EOS after the prompt, the reward head pools before the first EOS, so chosen and "
              "rejected score the same and the pairwise loss gives zero gradient.", _c04_build, _c04_proof),
    BlindCase("b19-case-05", "https://github.com/huggingface/accelerate/issues/225", "scheduler horizon",
              "The linear schedule is sized in micro-batches while it steps once per accumulated update, so the "
              "learning rate barely decays over the run.", _c05_build, _c05_proof),
]
