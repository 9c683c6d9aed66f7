"""Blind batch 13, part a: silent training bugs from public GitHub threads, each with its fixed twin.

Collected by someone who does not write the audit's checks. Every case builds the user's setup on a tiny real
model from a config in code (transformers T5, GPT-NeoX, OPT, BERT for pre-training and Qwen2; nothing is
downloaded) and proves the bug without the audit on real runs and real tensors.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tests._blind import BlindCase, Case
from tests._blind_batch5 import _gen, _kw, _llama_config, _sgd_step  # noqa: F401


# --------------------------------------------------------------------------------------------- case-01
# T5 fine-tuning passes the target ids as decoder_input_ids as well as labels: nothing is shifted right

_C01_PAD, _C01_EOS = 0, 1
_C01_SRC = torch.randint(3, 40, (4, 10), generator=_gen(1301))
_C01_SRC_MASK = torch.ones_like(_C01_SRC)
_C01_TGT = torch.randint(3, 40, (4, 7), generator=_gen(1302))
_C01_TGT[:, -1] = _C01_EOS
_C01_TGT[2, 5:] = _C01_PAD
_C01_TGT[3, 4:] = _C01_PAD


def _c01_t5() -> nn.Module:
    from transformers import T5Config, T5ForConditionalGeneration

    cfg = T5Config(vocab_size=40, d_model=32, d_kv=16, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=2,
                   dropout_rate=0.0, pad_token_id=_C01_PAD, eos_token_id=_C01_EOS, decoder_start_token_id=_C01_PAD)
    return T5ForConditionalGeneration(cfg)


def _c01_batch(tgt: torch.Tensor, bug: bool) -> dict[str, torch.Tensor]:
    if bug:  # the report: decoder_input_ids = labels = the target ids
        return {"input_ids": _C01_SRC, "attention_mask": _C01_SRC_MASK, "decoder_input_ids": tgt, "labels": tgt}
    labels = tgt.masked_fill(tgt == _C01_PAD, -100)  # the fix: labels only (pads -> -100); the model shifts them
    return {"input_ids": _C01_SRC, "attention_mask": _C01_SRC_MASK, "labels": labels}


def _c01_build(bug: bool) -> Case:
    torch.manual_seed(0)
    model = _c01_t5().train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = _c01_batch(_C01_TGT, bug)

    def step() -> torch.Tensor:
        opt.zero_grad()
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        return loss

    return model, step, _kw(optimizer=opt, inputs=batch)


def _c01_proof(bug: bool) -> bool:
    """The prediction at target position t changes when only the target token at t is changed: the answer leaks."""
    model, step, _ = _c01_build(bug)
    for _ in range(3):
        step()
    model.eval()
    t = 2
    other = _C01_TGT.clone()
    other[:, t] = (other[:, t] + 5) % 37 + 3
    with torch.no_grad():
        a = model(**_c01_batch(_C01_TGT, bug)).logits[:, t]
        b = model(**_c01_batch(other, bug)).logits[:, t]
    return not torch.allclose(a, b, atol=1e-5)


# --------------------------------------------------------------------------------------------- case-02
# GPT trained with its weights cast to bfloat16 and no fp32 master copy: AdamW's small updates round away

_C02_IDS = torch.randint(3, 40, (4, 12), generator=_gen(1311))
_C02_LR = 2e-5


def _c02_build(bug: bool) -> Case:
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    torch.manual_seed(0)
    cfg = GPTNeoXConfig(vocab_size=40, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=64, bos_token_id=1, eos_token_id=2)
    model = GPTNeoXForCausalLM(cfg).train()
    if bug:  # the report: weights (and so the optimizer's writes) live in bf16
        model = model.to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=_C02_LR, weight_decay=0.01)

    def loss_fn() -> torch.Tensor:
        # the fix: fp32 master weights, bf16 only for the forward compute
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=not bug):
            return model(input_ids=_C02_IDS, labels=_C02_IDS).loss

    return model, _sgd_step(model, opt, loss_fn), _kw(optimizer=opt, inputs={"input_ids": _C02_IDS,
                                                                             "labels": _C02_IDS})


def _c02_proof(bug: bool) -> bool:
    """After a real AdamW step most weight entries are bit-for-bit unchanged, the LayerNorm gains all of them."""
    model, step, _ = _c02_build(bug)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    step()
    moved = sum(int((p.detach() != before[n]).sum()) for n, p in model.named_parameters())
    total = sum(b.numel() for b in before.values())
    ln_moved = any(bool((p.detach() != before[n]).any()) for n, p in model.named_parameters()
                   if "layernorm" in n and n.endswith("weight"))
    return moved / total < 0.5 and not ln_moved


# --------------------------------------------------------------------------------------------- case-03
# SFT of a causal LM with tokenizer.pad_token = tokenizer.eos_token: the collator masks every EOS label

_C03_WORDS = ["<pad>", "<s>", "</s>", "<unk>"] + [f"w{i}" for i in range(36)]
_C03_TEXTS = ["<s> w1 w5 w9 w2 w7 </s>", "<s> w3 w3 w8 </s>", "<s> w10 w11 w12 w13 w14 w15 w16 </s>",
              "<s> w20 w4 </s>"]


def _c03_tokenizer(bug: bool) -> Any:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(_C03_WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    if bug:
        hf.pad_token = hf.eos_token  # the report's notebook line
    else:
        hf.pad_token = "<pad>"  # the fix: a pad token that is not the EOS
    hf.padding_side = "right"
    return hf


def _c03_batch(bug: bool) -> dict[str, torch.Tensor]:
    from transformers import DataCollatorForLanguageModeling

    tok = _c03_tokenizer(bug)
    feats = [tok(t) for t in _C03_TEXTS]
    batch = DataCollatorForLanguageModeling(tok, mlm=False)(feats)
    return {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"], "labels": batch["labels"]}


def _c03_build(bug: bool) -> Case:
    from transformers import OPTConfig, OPTForCausalLM

    torch.manual_seed(0)
    cfg = OPTConfig(vocab_size=len(_C03_WORDS), hidden_size=32, num_hidden_layers=2, ffn_dim=64,
                    num_attention_heads=2, max_position_embeddings=64, word_embed_proj_dim=32, dropout=0.0,
                    attention_dropout=0.0, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    model = OPTForCausalLM(cfg).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = _c03_batch(bug)
    return model, _sgd_step(model, opt, lambda: model(**batch).loss), _kw(optimizer=opt, inputs=batch)


def _c03_proof(bug: bool) -> bool:
    """Every text ends in EOS, yet no position of the batch the collator builds has EOS as a supervised label."""
    _, _, kwargs = _c03_build(bug)
    ends_in_eos = all(t.split()[-1] == "</s>" for t in _C03_TEXTS)
    return ends_in_eos and int((kwargs["inputs"]["labels"] == 2).sum()) == 0


# --------------------------------------------------------------------------------------------- case-04
# BERT post-training (MLM + NSP) calls clip_grad_norm_ after optimizer.step(): the update is never clipped

_C04_MAX_NORM = 1.0
_C04_IDS = torch.randint(5, 40, (4, 12), generator=_gen(1321))
_C04_IDS[:, 0] = 2
_C04_IDS[:, 6] = 3
_C04_IDS[:, -1] = 3
_C04_TYPES = torch.zeros_like(_C04_IDS)
_C04_TYPES[:, 7:] = 1
_C04_MLM = torch.full_like(_C04_IDS, -100)
_C04_MLM[:, [2, 4, 9]] = _C04_IDS[:, [2, 4, 9]]
_C04_MASKED = _C04_IDS.clone()
_C04_MASKED[:, [2, 4, 9]] = 4  # [MASK]
_C04_NSP = torch.tensor([0, 1, 0, 1])


def _c04_build(bug: bool) -> Case:
    from transformers import BertConfig, BertForPreTraining

    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=40, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=64, max_position_embeddings=32, pad_token_id=0)
    model = BertForPreTraining(cfg).train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-5)
    batch = {"input_ids": _C04_MASKED, "token_type_ids": _C04_TYPES, "attention_mask": torch.ones_like(_C04_IDS),
             "labels": _C04_MLM, "next_sentence_label": _C04_NSP}

    def step() -> torch.Tensor:
        loss = model(**batch).loss
        loss.backward()
        if not bug:
            nn.utils.clip_grad_norm_(model.parameters(), _C04_MAX_NORM)
        opt.step()
        if bug:  # the report: clipping after the step has already used the gradients
            nn.utils.clip_grad_norm_(model.parameters(), _C04_MAX_NORM)
        opt.zero_grad()
        return loss

    return model, step, _kw(optimizer=opt, inputs=batch)


def _c04_proof(bug: bool) -> bool:
    """The gradient the optimizer reads inside step() has a norm well above max_norm (captured by a step hook)."""
    model, step, kwargs = _c04_build(bug)
    opt = kwargs["optimizer"]
    seen: list[float] = []

    def hook(optimizer: torch.optim.Optimizer, args: Any, kw: Any) -> None:
        grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        seen.append(float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))))

    handle = opt.register_step_pre_hook(hook)
    step()
    handle.remove()
    return seen[0] > 1.5 * _C04_MAX_NORM


# --------------------------------------------------------------------------------------------- case-05
# SFT packager finds no trailing pads in a left-padded batch: the attention mask comes out all ones

_C05_PAD = 2
_C05_LENS = [12, 7, 9, 5]
_C05_IDS = torch.randint(3, 40, (4, 12), generator=_gen(1331))
for _row, _n in enumerate(_C05_LENS):
    _C05_IDS[_row, : 12 - _n] = _C05_PAD  # left padding
    _C05_IDS[_row, 12 - _n] = 1  # BOS
_C05_LABELS = _C05_IDS.masked_fill((_C05_IDS == _C05_PAD) | (_C05_IDS == 1), -100)


def _c05_mask(ids: torch.Tensor, bug: bool) -> torch.Tensor:
    if bug:  # the report: content_length stays the full length, so every position is marked real
        return torch.ones_like(ids)
    mask = torch.zeros_like(ids)  # the fix: the real tokens are the last n of each left-padded row
    for row, n in enumerate(_C05_LENS):
        mask[row, ids.shape[1] - n:] = 1
    return mask


def _c05_build(bug: bool) -> Case:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                      pad_token_id=_C05_PAD, bos_token_id=1, eos_token_id=_C05_PAD)
    model = Qwen2ForCausalLM(cfg).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = {"input_ids": _C05_IDS, "attention_mask": _c05_mask(_C05_IDS, bug), "labels": _C05_LABELS}
    return model, _sgd_step(model, opt, lambda: model(**batch).loss), _kw(optimizer=opt, inputs=batch)


def _c05_proof(bug: bool) -> bool:
    """The loss on the real tokens changes when only the ids under the left padding are changed."""
    model, _, kwargs = _c05_build(bug)
    model.eval()
    batch = kwargs["inputs"]
    other = batch["input_ids"].clone()
    other[other == _C05_PAD] = 7
    with torch.no_grad():
        a = model(**batch).loss
        b = model(input_ids=other, attention_mask=batch["attention_mask"], labels=batch["labels"]).loss
    return not torch.allclose(a, b, atol=1e-5)


CASES: list[BlindCase] = [
    BlindCase("b13-case-01", "https://github.com/huggingface/transformers/issues/11977", "seq2seq decoder inputs",
              "T5 is fed its target ids unshifted as decoder_input_ids, so each position sees the token it must "
              "predict and the loss falls while the model learns to copy", _c01_build, _c01_proof),
    BlindCase("b13-case-02", "https://github.com/workofart/ml-by-hand/pull/85", "low-precision master weights",
              "the GPT's weights are stored in bf16 with no fp32 master copy, so most of AdamW's per-step updates "
              "round back to the old value and those weights never move", _c02_build, _c02_proof),
    BlindCase("b13-case-03", "https://github.com/mlabonne/llm-course/issues/33", "labels / special tokens",
              "with pad_token set to eos_token the LM collator turns every EOS label into -100, so the model is "
              "never taught to stop while its loss falls normally", _c03_build, _c03_proof),
    BlindCase("b13-case-04", "https://github.com/taesunwhang/UMS-ResSel/issues/3", "gradient clipping order",
              "BERT post-training clips the gradients only after optimizer.step() has applied them, so the "
              "configured max gradient norm never limits any update", _c04_build, _c04_proof),
    BlindCase("b13-case-05", "https://github.com/NVIDIA-NeMo/Automodel/pull/3704", "attention mask / padding",
              "the left-padded SFT batch gets an all-ones attention mask, so every real token attends the pad run "
              "while the -100 labels keep the loss curve looking normal", _c05_build, _c05_proof,
              # true of the reproduction: its examples end without EOS, so nothing teaches the model to stop
              known_alarm=("DATA-010",)),
]
