"""Blind batch 11, part a: silent training bugs from public GitHub threads, each with its fixed twin.

Collected by someone who does not write the audit's checks. Every case builds the user's setup on a tiny real
model (transformers T5 for conditional generation, a Llama causal LM held in bfloat16, a RoBERTa masked LM and a
GPT-2 causal LM, all from tiny configs in code, and a plain torch GCN node classifier; nothing is downloaded) and
proves the bug without the audit on real runs and real tensors.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tests._blind import BlindCase, Case
from tests._blind_batch5 import _gen, _kw, _llama_config, _sgd_step

# --------------------------------------------------------------------------------------------- case-01
# T5 fine-tuning passes decoder_input_ids = labels (not shifted right): the decoder reads the token it must predict

_C01_PAD, _C01_EOS = 0, 1
_C01_SRC = torch.randint(3, 40, (4, 10), generator=_gen(1101))
_C01_SRC_MASK = torch.ones(4, 10, dtype=torch.long)
_C01_SRC_MASK[2, 7:] = 0
_C01_SRC_MASK[3, 5:] = 0
_C01_SRC = _C01_SRC.masked_fill(_C01_SRC_MASK == 0, _C01_PAD)
_C01_TGT = torch.randint(3, 40, (4, 8), generator=_gen(1102))
_C01_TGT_LENS = [8, 6, 7, 5]
for _i, _n in enumerate(_C01_TGT_LENS):
    _C01_TGT[_i, _n - 1] = _C01_EOS
    _C01_TGT[_i, _n:] = _C01_PAD


def _c01_t5() -> nn.Module:
    from transformers import T5Config, T5ForConditionalGeneration

    cfg = T5Config(vocab_size=40, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
                   dropout_rate=0.0, pad_token_id=_C01_PAD, eos_token_id=_C01_EOS, decoder_start_token_id=_C01_PAD)
    return T5ForConditionalGeneration(cfg)


def _c01_batch(bug: bool, tgt: torch.Tensor = _C01_TGT) -> dict[str, torch.Tensor]:
    if bug:  # the report: labels = decoder_input_ids, both passed to the model
        return {"input_ids": _C01_SRC, "attention_mask": _C01_SRC_MASK, "decoder_input_ids": tgt, "labels": tgt}
    labels = tgt.masked_fill(tgt == _C01_PAD, -100)  # the fix: labels only, pads to -100; T5 shifts them right
    return {"input_ids": _C01_SRC, "attention_mask": _C01_SRC_MASK, "labels": labels}


def _c01_build(bug: bool) -> Case:
    torch.manual_seed(0)
    model = _c01_t5().train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = _c01_batch(bug)
    return model, _sgd_step(model, opt, lambda: model(**batch).loss), _kw(optimizer=opt, inputs=batch)


def _c01_proof(bug: bool) -> bool:
    """The prediction at target position t depends on the label at t itself: change only labels[:, t] and the
    logits at t move (with the right shift they can depend only on labels[:, :t])."""
    model, _, _ = _c01_build(bug)
    model.eval()
    t = 3
    other = _C01_TGT.clone()
    other[:, t] = (other[:, t] + 7) % 37 + 3
    with torch.no_grad():
        a = model(**_c01_batch(bug)).logits[:, t]
        b = model(**_c01_batch(bug, other)).logits[:, t]
    return not torch.allclose(a, b, atol=1e-6)


# --------------------------------------------------------------------------------------------- case-02
# Llama SFT with the model held in bfloat16 and torch AdamW over those parameters: no fp32 master weights

_C02_IDS = torch.randint(3, 40, (4, 12), generator=_gen(1111))
_C02_LR = 1e-4


def _c02_build(bug: bool) -> Case:
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(_llama_config())
    if bug:
        model = model.to(torch.bfloat16)  # the report: params (and so AdamW's state and updates) in bf16
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=_C02_LR, weight_decay=0.01)

    def loss_fn() -> torch.Tensor:
        if bug:
            return model(input_ids=_C02_IDS, labels=_C02_IDS).loss
        with torch.autocast("cpu", dtype=torch.bfloat16):  # the fix: fp32 params, bf16 compute
            return model(input_ids=_C02_IDS, labels=_C02_IDS).loss

    return model, _sgd_step(model, opt, loss_fn), _kw(optimizer=opt, inputs={"input_ids": _C02_IDS,
                                                                               "labels": _C02_IDS})


def _c02_proof(bug: bool) -> bool:
    """After one AdamW step the RMSNorm gains (all 1.0, with non-zero gradients) have not moved at all: an update
    of ~lr = 1e-4 is below half a bf16 ulp at 1.0 and is rounded away."""
    model, step, _ = _c02_build(bug)
    norms = [(n, p) for n, p in model.named_parameters() if "norm" in n]
    before = [p.detach().clone() for _, p in norms]
    step()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for _, p in norms)
    unchanged = [bool(torch.equal(p.detach(), b)) for (_, p), b in zip(norms, before)]
    return all(unchanged)


# --------------------------------------------------------------------------------------------- case-03
# RoBERTa MLM trained with labels = the original input_ids: the loss also scores every unmasked (visible) token

_C03_MASK_ID, _C03_PAD = 4, 1
_C03_ORIG = torch.randint(5, 40, (4, 12), generator=_gen(1121))
_C03_SEL = torch.rand(4, 12, generator=_gen(1122)) < 0.15
_C03_SEL[:, 2] = True  # at least one masked position a row
_C03_INPUT = _C03_ORIG.masked_fill(_C03_SEL, _C03_MASK_ID)
_C03_ATTN = torch.ones(4, 12, dtype=torch.long)


def _c03_labels(bug: bool) -> torch.Tensor:
    if bug:
        return _C03_ORIG.clone()
    return torch.where(_C03_INPUT == _C03_MASK_ID, _C03_ORIG, torch.full_like(_C03_ORIG, -100))


def _c03_build(bug: bool) -> Case:
    from transformers import RobertaConfig, RobertaForMaskedLM

    torch.manual_seed(0)
    cfg = RobertaConfig(vocab_size=40, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=40, pad_token_id=_C03_PAD,
                        bos_token_id=0, eos_token_id=2)
    model = RobertaForMaskedLM(cfg).train()
    opt = torch.optim.AdamW(model.parameters(), lr=5e-4)
    batch = {"input_ids": _C03_INPUT, "attention_mask": _C03_ATTN, "labels": _c03_labels(bug)}
    return model, _sgd_step(model, opt, lambda: model(**batch).loss), _kw(optimizer=opt, inputs=batch)


def _c03_proof(bug: bool) -> bool:
    """The loss sends gradient into the logits of unmasked positions (tokens the model can simply copy)."""
    model, _, kwargs = _c03_build(bug)
    out = model(**kwargs["inputs"])
    out.logits.retain_grad()
    out.loss.backward()
    g = out.logits.grad
    assert g is not None
    return bool(g[~_C03_SEL].abs().sum() > 0)


# --------------------------------------------------------------------------------------------- case-04
# GNN node-classification trainer calls clip_grad_norm_ after optimizer.step(): --max-grad-norm never clips

_C04_N, _C04_D, _C04_C, _C04_MAX_NORM = 24, 16, 4, 0.05
_C04_X = torch.randn(_C04_N, _C04_D, generator=_gen(1131))
_C04_A = (torch.rand(_C04_N, _C04_N, generator=_gen(1132)) < 0.2).float()
_C04_A = ((_C04_A + _C04_A.t()).clamp(max=1) + torch.eye(_C04_N)).clamp(max=1)
_C04_A = _C04_A / _C04_A.sum(-1, keepdim=True)
_C04_Y = torch.randint(0, _C04_C, (_C04_N,), generator=_gen(1133))
_C04_TRAIN = torch.arange(_C04_N) % 3 != 0


class _GCN(nn.Module):
    """Two mean-aggregation graph conv layers and a node classifier."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.conv2 = nn.Linear(_C04_D, 32), nn.Linear(32, 32)
        self.decoder = nn.Linear(32, _C04_C)

    def forward(self, x: torch.Tensor, adj: torch.Tensor) -> torch.Tensor:
        h = F.relu(adj @ self.conv1(x))
        h = F.relu(adj @ self.conv2(h))
        return self.decoder(h)


def _c04_build(bug: bool) -> Case:
    torch.manual_seed(0)
    model = _GCN().train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)

    def step() -> torch.Tensor:
        opt.zero_grad()
        logits = model(_C04_X, _C04_A)
        loss = F.cross_entropy(logits[_C04_TRAIN], _C04_Y[_C04_TRAIN])
        loss.backward()
        if not bug:
            torch.nn.utils.clip_grad_norm_(model.parameters(), _C04_MAX_NORM)
        opt.step()
        if bug:  # the report: clipping runs after the step has already used the raw gradients
            torch.nn.utils.clip_grad_norm_(model.parameters(), _C04_MAX_NORM)
        return loss

    return model, step, _kw(optimizer=opt, inputs=(_C04_X, _C04_A))


def _c04_proof(bug: bool) -> bool:
    """The gradient the optimizer consumes (read in a step pre-hook) has a norm above max_grad_norm."""
    _, step, kwargs = _c04_build(bug)
    opt: torch.optim.Optimizer = kwargs["optimizer"]
    seen: list[float] = []

    def hook(o: torch.optim.Optimizer, args: Any, kw: Any) -> None:
        grads = [p.grad for g in o.param_groups for p in g["params"] if p.grad is not None]
        seen.append(float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))))

    handle = opt.register_step_pre_hook(hook)
    step()
    handle.remove()
    return seen[0] > _C04_MAX_NORM * 1.01


# --------------------------------------------------------------------------------------------- case-05
# GPT-2 SFT with tokenizer.pad_token = eos_token: the collator's labels[labels == pad_id] = -100 also drops the EOS

_C05_EOS = 39
_C05_LENS = [12, 9, 7, 10]
_C05_IDS = torch.randint(3, 39, (4, 12), generator=_gen(1141))
_C05_ATTN = torch.zeros(4, 12, dtype=torch.long)
for _i, _n in enumerate(_C05_LENS):
    _C05_IDS[_i, _n - 1] = _C05_EOS  # each example ends with its real EOS
    _C05_IDS[_i, _n:] = _C05_EOS  # right padding with pad_token == eos_token
    _C05_ATTN[_i, :_n] = 1


def _c05_labels(bug: bool) -> torch.Tensor:
    labels = _C05_IDS.clone()
    if bug:  # DataCollatorForLanguageModeling(mlm=False): every pad id is masked, the real EOS included
        labels[labels == _C05_EOS] = -100
    else:  # the fix: mask padding by position (attention mask), keep the EOS that ends each example
        labels[_C05_ATTN == 0] = -100
    return labels


def _c05_build(bug: bool) -> Case:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=40, n_positions=32, n_embd=32, n_layer=2, n_head=2, bos_token_id=_C05_EOS,
                     eos_token_id=_C05_EOS, pad_token_id=_C05_EOS)
    model = GPT2LMHeadModel(cfg).train()
    opt = torch.optim.AdamW(model.parameters(), lr=5e-4)
    batch = {"input_ids": _C05_IDS, "attention_mask": _C05_ATTN, "labels": _c05_labels(bug)}
    return model, _sgd_step(model, opt, lambda: model(**batch).loss), _kw(optimizer=opt, inputs=batch)


def _c05_proof(bug: bool) -> bool:
    """The logits at the position that should predict each example's EOS get no gradient from the loss."""
    model, _, _ = _c05_build(bug)
    model.eval()
    out = model(input_ids=_C05_IDS, attention_mask=_C05_ATTN, labels=_c05_labels(bug))
    out.logits.retain_grad()
    out.loss.backward()
    g = out.logits.grad
    assert g is not None
    before_eos = torch.tensor([n - 2 for n in _C05_LENS])
    return bool((g[torch.arange(4), before_eos].abs().sum(-1) == 0).all())


CASES: list[BlindCase] = [
    BlindCase("b11-case-01", "https://github.com/huggingface/transformers/issues/11977",
              "labels / decoder input shift",
              "T5 is trained with decoder_input_ids equal to the labels instead of the labels shifted right: each "
              "decoder position sees the very token it is asked to predict, the loss falls fast and the model "
              "learns to copy, then generates gibberish", _c01_build, _c01_proof),
    BlindCase("b11-case-02", "https://github.com/areal-project/AReaL/issues/1292",
              "mixed precision / bf16 master weights",
              "the model is held in bfloat16 and torch AdamW runs on those parameters, so its state and updates "
              "are bf16: small updates round away (the norm gains never move) and the loss plateaus higher",
              _c02_build, _c02_proof),
    BlindCase("b11-case-03", "https://github.com/huggingface/transformers/issues/13020",
              "MLM labels / loss on unmasked tokens",
              "RobertaForMaskedLM gets labels equal to the original input_ids, not -100 outside the [MASK] "
              "positions: most of the loss is copying visible tokens, so it looks low while the masked-token "
              "objective is diluted", _c03_build, _c03_proof),
    BlindCase("b11-case-04", "https://github.com/awslabs/graphstorm/issues/1366", "gradient clipping order",
              "clip_grad_norm_ runs after optimizer.step(): the step uses the raw gradients and the clipped ones "
              "are zeroed before they are ever used, so max_grad_norm silently does nothing", _c04_build,
              _c04_proof),
    BlindCase("b11-case-05", "https://github.com/mlabonne/llm-course/issues/33",
              "tokenizer special tokens / pad = eos",
              "with pad_token set to eos_token, masking labels equal to the pad id also masks every real EOS: the "
              "model is never trained to emit EOS and fine-tunes into never stopping", _c05_build, _c05_proof),
]
