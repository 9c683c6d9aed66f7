"""Blind batch 37 (part a): silent language-model training bugs from public GitHub threads, each with its fixed twin.

Collected by someone who does not write the audit's checks. Every case builds the user's setup on a tiny model
(transformers BERT and Llama models from tiny configs in code, plain torch GRU encoder-decoders and prompt encoders;
nothing is downloaded) and proves the bug without the audit on real tensors and real steps.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from tests._blind import BlindCase, Case
from tests._blind_batch5 import _gen, _kw


def _bert_config(**kw):
    from transformers import BertConfig

    base = {"vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
            "intermediate_size": 64, "max_position_embeddings": 32, "pad_token_id": 0, "hidden_dropout_prob": 0.0,
            "attention_probs_dropout_prob": 0.0}
    base.update(kw)
    return BertConfig(**base)


def _llama(vocab: int = 40):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0,
                      bos_token_id=1, eos_token_id=2)
    return LlamaForCausalLM(cfg).train()


# --------------------------------------------------------------------------------------------- case-01
# THUDM/P-tuning issue #13 (same report again in #21): the few-shot P-tuning wrapper trains the masked LM with one
# AdamW (lr 1e-5) and the prompt encoder (prompt embeddings + LSTM head + MLP head) with a second AdamW at the real
# learning rate, each with a linear warmup/decay schedule. But `embedding_scheduler` is built with
# `get_linear_schedule_with_warmup(optimizer, ...)`, the model's optimizer, not `embedding_optimizer`. Stepping it only
# re-sets the model optimizer's lr to the value its own scheduler already set, so nothing complains; the prompt
# encoder, the part P-tuning is about, trains at a constant full learning rate from step 0, with no warmup and no
# decay. Fix (confirmed by the maintainers, "solved in recent update"): build the embedding scheduler on
# `embedding_optimizer`.

_C01_WARMUP, _C01_TOTAL, _C01_LR = 4, 20, 1e-2
_C01_PROMPT_POS = (1, 2, 3)
_C01_MASK_POS = 5
_C01_LABEL_WORDS = (10, 11)
_C01_IDS = torch.randint(12, 60, (4, 10), generator=_gen(3701))
_C01_IDS[:, 0] = 1  # [CLS]
_C01_IDS[:, list(_C01_PROMPT_POS)] = 4  # prompt placeholder token
_C01_IDS[:, _C01_MASK_POS] = 3  # [MASK]
_C01_Y = torch.tensor([0, 1, 1, 0])


class _PTuningMLM(nn.Module):
    """P-tuning's wrapper: a masked LM whose placeholder positions take the prompt encoder's continuous prompts."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import BertForMaskedLM

        self.model = BertForMaskedLM(_bert_config())
        n, h = len(_C01_PROMPT_POS), 32
        self.prompt_embeddings = nn.Embedding(n, h)
        self.lstm_head = nn.LSTM(h, h // 2, num_layers=2, bidirectional=True, batch_first=True)
        self.mlp_head = nn.Sequential(nn.Linear(h, h), nn.ReLU(), nn.Linear(h, h))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        embeds = self.model.get_input_embeddings()(input_ids)
        prompt = self.prompt_embeddings(torch.arange(len(_C01_PROMPT_POS))).unsqueeze(0)
        prompt = self.mlp_head(self.lstm_head(prompt)[0]).squeeze(0)
        embeds = embeds.clone()
        embeds[:, list(_C01_PROMPT_POS)] = prompt
        logits = self.model(inputs_embeds=embeds, attention_mask=torch.ones_like(input_ids)).logits
        return logits[:, _C01_MASK_POS, list(_C01_LABEL_WORDS)]  # verbalizer: scores of the label words


def _c01_setup(bug: bool):
    from transformers import get_linear_schedule_with_warmup

    torch.manual_seed(0)
    wrapper = _PTuningMLM().train()
    optimizer = torch.optim.AdamW(wrapper.model.parameters(), lr=1e-5, eps=1e-8)
    scheduler = get_linear_schedule_with_warmup(optimizer, num_warmup_steps=_C01_WARMUP,
                                                num_training_steps=_C01_TOTAL)
    embedding_parameters = [{"params": list(wrapper.lstm_head.parameters())},
                            {"params": list(wrapper.mlp_head.parameters())},
                            {"params": list(wrapper.prompt_embeddings.parameters())}]
    embedding_optimizer = torch.optim.AdamW(embedding_parameters, lr=_C01_LR, eps=1e-8)
    embedding_scheduler = get_linear_schedule_with_warmup(optimizer if bug else embedding_optimizer,
                                                          num_warmup_steps=_C01_WARMUP,
                                                          num_training_steps=_C01_TOTAL)

    def step() -> torch.Tensor:
        loss = F.cross_entropy(wrapper(_C01_IDS), _C01_Y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(wrapper.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        embedding_optimizer.step()
        embedding_scheduler.step()
        wrapper.zero_grad()
        return loss

    return wrapper, embedding_optimizer, embedding_scheduler, step


def _c01_build(bug: bool) -> Case:
    model, emb_opt, emb_sched, step = _c01_setup(bug)
    return model, step, _kw(optimizer=emb_opt, lr_scheduler=emb_sched, inputs={"input_ids": _C01_IDS},
                            total_steps=_C01_TOTAL)


def _c01_proof(bug: bool) -> bool:
    """After two steps inside the warmup, does the prompt encoder's optimizer still run at the unwarmed full lr?"""
    _, emb_opt, _, step = _c01_setup(bug)
    step()
    step()
    expected = _C01_LR * 2 / _C01_WARMUP
    return any(abs(g["lr"] - expected) > 1e-12 for g in emb_opt.param_groups)


# --------------------------------------------------------------------------------------------- case-02
# instructlab/training issue #243 (fixed by PR #244): data processing looks up the `<|pretrain|>` / `<|/pretrain|>`
# markers with `get_sp_token(tokenizer, ...)`, which returns the token-id *list* from `tokenizer.encode`, and hands
# that list to the label-unmasking pass as `pretrain_token`. Comparing an int token id with a one-element list is never
# true, so no pretraining segment is ever recognised: inside pretraining samples only the text after the assistant
# marker stays in the labels (the question is masked out as if it were a user turn), and the marker tokens themselves
# are not stripped from input_ids. Training runs normally on fewer tokens. Fix in PR #244: take `[0]` of the encoded
# lists so the markers are compared as ints.

_C02_PAD, _C02_EOS, _C02_USER, _C02_ASSIST, _C02_SYSTEM, _C02_PRE, _C02_PRE_END = 0, 2, 3, 4, 5, 6, 7
_C02_VOCAB = {"<|user|>": _C02_USER, "<|assistant|>": _C02_ASSIST, "<|system|>": _C02_SYSTEM,
              "<|pretrain|>": _C02_PRE, "<|/pretrain|>": _C02_PRE_END}
_C02_Q = [11, 12, 13, 14, 15]
_C02_A = [21, 22, 23, 24]
# a pretraining sample (question + answer, both to be learned) and an ordinary instruct sample
_C02_RAW = [
    [_C02_PRE, _C02_USER, *_C02_Q, _C02_ASSIST, *_C02_A, _C02_EOS, _C02_PRE_END],
    [_C02_SYSTEM, 30, 31, _C02_USER, 32, 33, 34, _C02_ASSIST, 35, 36, 37, _C02_EOS],
]


def _c02_get_sp_token(token: str) -> list[int]:
    return [_C02_VOCAB[token]]  # like tokenizer.encode(token, add_special_tokens=False)


def _c02_unmask(ids: list[int], pretrain_token, pretrain_end_token) -> tuple[list[int], list[int]]:
    """The data-process rule: role markers masked; inside a pretrain segment everything else is learned; outside it
    only what follows the assistant marker; the pretrain markers are then dropped."""
    labels, in_pretrain, unmasking = [-100] * len(ids), False, False
    for i, tok in enumerate(ids):
        if tok == pretrain_token:
            in_pretrain = True
            continue
        if tok == pretrain_end_token:
            in_pretrain = False
            continue
        if tok in (_C02_USER, _C02_ASSIST, _C02_SYSTEM):
            unmasking = tok == _C02_ASSIST
            continue
        if in_pretrain or unmasking:
            labels[i] = tok
    keep = [i for i, tok in enumerate(ids) if tok not in [pretrain_token, pretrain_end_token]]
    return [ids[i] for i in keep], [labels[i] for i in keep]


def _c02_batch(bug: bool) -> dict[str, torch.Tensor]:
    pre = _c02_get_sp_token("<|pretrain|>")
    pre_end = _c02_get_sp_token("<|/pretrain|>")
    if not bug:
        pre, pre_end = pre[0], pre_end[0]
    rows = [_c02_unmask(ids, pre, pre_end) for ids in _C02_RAW]
    n = max(len(r[0]) for r in rows)
    input_ids = torch.full((len(rows), n), _C02_PAD)
    labels = torch.full((len(rows), n), -100)
    mask = torch.zeros((len(rows), n), dtype=torch.long)
    for i, (ids, lab) in enumerate(rows):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        labels[i, : len(lab)] = torch.tensor(lab)
        mask[i, : len(ids)] = 1
    return {"input_ids": input_ids, "attention_mask": mask, "labels": labels}


def _c02_build(bug: bool) -> Case:
    model = _llama()
    opt = torch.optim.AdamW(model.parameters(), lr=2e-5)
    batch = _c02_batch(bug)

    def step() -> torch.Tensor:
        opt.zero_grad()
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        return loss

    return model, step, _kw(optimizer=opt, inputs=batch)


def _c02_proof(bug: bool) -> bool:
    """In the pretraining sample, is any question token left out of the labels the model is trained on?"""
    batch = _c02_batch(bug)
    ids, labels = batch["input_ids"][0], batch["labels"][0]
    q = torch.isin(ids, torch.tensor(_C02_Q))
    return bool((labels[q] == -100).any())


# --------------------------------------------------------------------------------------------- case-03
# d2l-ai/d2l-en issue #2582: the PyTorch BERT pretraining chapter computes the masked-LM loss as
# `loss(mlm_Y_hat.reshape(-1, vocab_size), mlm_Y.reshape(-1)) * mlm_weights_X.reshape(-1, 1)` and then
# `.sum() / (mlm_weights_X.sum() + 1e-8)`, with `loss = nn.CrossEntropyLoss()`. The default reduction='mean' already
# turns the cross-entropy into one scalar averaged over *all* prediction slots, so the weights that should zero out the
# padded slots (pred position 0, label <pad>) only multiply and divide that scalar away. Every padded slot trains the
# model to predict <pad> at the <cls> position; the loss still falls. Fix proposed in the thread:
# `F.cross_entropy(..., reduction='none')` for the MLM term so the weights mask per slot, and a mean for NSP.

_C03_VOCAB = 64
_C03_TOKENS = torch.randint(5, _C03_VOCAB, (4, 12), generator=_gen(3721))
_C03_TOKENS[:, 0] = 2  # <cls>
_C03_VALID = torch.tensor([12, 10, 12, 8])
for _i, _n in enumerate(_C03_VALID.tolist()):
    _C03_TOKENS[_i, _n:] = 0
_C03_SEGMENTS = torch.zeros_like(_C03_TOKENS)
_C03_SEGMENTS[:, 6:] = 1
# three prediction slots per sequence, the last one padding in rows 1 and 3 (position 0, label 0, weight 0)
_C03_PRED_POS = torch.tensor([[2, 5, 9], [3, 7, 0], [1, 4, 8], [2, 6, 0]])
_C03_WEIGHTS = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
_C03_ORIG = _C03_TOKENS[torch.arange(4)[:, None], _C03_PRED_POS]
_C03_MLM_Y = torch.where(_C03_WEIGHTS > 0, _C03_ORIG, 0)  # the original tokens; <pad> (0) at padded slots
_C03_TOKENS_MASKED = _C03_TOKENS.clone()
_C03_TOKENS_MASKED[torch.arange(4)[:, None], _C03_PRED_POS] = torch.where(_C03_WEIGHTS > 0, 4, _C03_ORIG)  # <mask>
_C03_NSP_Y = torch.tensor([1, 0, 0, 1])


class _D2LBert(nn.Module):
    """d2l's BERTModel: encoder, MaskLM head gathering the prediction positions, NextSentencePred on <cls>."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import BertModel

        self.encoder = BertModel(_bert_config(type_vocab_size=2), add_pooling_layer=False)
        self.mlm = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.LayerNorm(32), nn.Linear(32, _C03_VOCAB))
        self.hidden = nn.Sequential(nn.Linear(32, 32), nn.Tanh())
        self.nsp = nn.Linear(32, 2)

    def forward(self, tokens, segments, valid_lens, pred_positions):
        mask = (torch.arange(tokens.shape[1])[None, :] < valid_lens[:, None]).long()
        x = self.encoder(input_ids=tokens, token_type_ids=segments, attention_mask=mask).last_hidden_state
        masked_x = x[torch.arange(x.shape[0])[:, None], pred_positions]
        return x, self.mlm(masked_x), self.nsp(self.hidden(x[:, 0, :]))


def _c03_loss(bug: bool, mlm_y_hat: torch.Tensor, nsp_y_hat: torch.Tensor) -> torch.Tensor:
    if bug:
        loss = nn.CrossEntropyLoss()
        mlm_l = loss(mlm_y_hat.reshape(-1, _C03_VOCAB), _C03_MLM_Y.reshape(-1)) * _C03_WEIGHTS.reshape(-1, 1)
        nsp_l = loss(nsp_y_hat, _C03_NSP_Y)
    else:
        mlm_l = F.cross_entropy(mlm_y_hat.reshape(-1, _C03_VOCAB), _C03_MLM_Y.reshape(-1), reduction="none")
        mlm_l = mlm_l * _C03_WEIGHTS.reshape(-1)
        nsp_l = F.cross_entropy(nsp_y_hat, _C03_NSP_Y, reduction="mean")
    mlm_l = mlm_l.sum() / (_C03_WEIGHTS.sum() + 1e-8)
    return mlm_l + nsp_l


def _c03_inputs() -> dict[str, torch.Tensor]:
    return {"tokens": _C03_TOKENS_MASKED, "segments": _C03_SEGMENTS, "valid_lens": _C03_VALID,
            "pred_positions": _C03_PRED_POS}


def _c03_build(bug: bool) -> Case:
    torch.manual_seed(0)
    net = _D2LBert().train()
    trainer = torch.optim.Adam(net.parameters(), lr=0.01)
    inputs = _c03_inputs()

    def step() -> torch.Tensor:
        trainer.zero_grad()
        _, mlm_y_hat, nsp_y_hat = net(**inputs)
        loss = _c03_loss(bug, mlm_y_hat, nsp_y_hat)
        loss.backward()
        trainer.step()
        return loss

    return net, step, _kw(optimizer=trainer, inputs=inputs)


def _c03_proof(bug: bool) -> bool:
    """Does the loss put gradient on the MLM logits of a padded prediction slot (weight 0)?"""
    torch.manual_seed(0)
    net = _D2LBert().train()
    _, mlm_y_hat, nsp_y_hat = net(**_c03_inputs())
    (g,) = torch.autograd.grad(_c03_loss(bug, mlm_y_hat, nsp_y_hat), mlm_y_hat)
    return bool(g[_C03_WEIGHTS == 0].abs().max() > 1e-8)


# --------------------------------------------------------------------------------------------- case-04
# pytorch/translate PR #391: the hybrid dual-decoder knowledge-distillation criterion trains a teacher decoder and a
# student decoder on one shared encoder. The student's loss mixes NLL with a KD term `(teacher_probs * -lprobs)`,
# where `teacher_probs` is the teacher decoder's softmax output, still attached to the graph. The total loss
# `student_loss + teacher_loss` therefore back-propagates the KD term into the teacher decoder too, "effectively
# encouraging the teacher output to look like the student's"; both losses still fall. Fix in the PR:
# `teacher_probs = teacher_probs.detach()` before computing the student loss.

_C04_V, _C04_PAD = 40, 0
_C04_SRC = torch.randint(3, _C04_V, (4, 9), generator=_gen(3731))
_C04_TGT = torch.randint(3, _C04_V, (4, 7), generator=_gen(3732))
_C04_TGT[1, 5:] = _C04_PAD
_C04_TGT[3, 4:] = _C04_PAD
_C04_PREV = torch.cat([torch.full((4, 1), 1), _C04_TGT[:, :-1]], dim=1)  # prev_output_tokens (bos-shifted)


class _GRUDecoder(nn.Module):
    def __init__(self, enc_dim: int, hidden: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(_C04_V, hidden, padding_idx=_C04_PAD)
        self.init = nn.Linear(enc_dim, hidden)
        self.rnn = nn.GRU(hidden, hidden, batch_first=True)
        self.out = nn.Linear(hidden, _C04_V)

    def forward(self, prev: torch.Tensor, enc: torch.Tensor) -> torch.Tensor:
        h0 = torch.tanh(self.init(enc)).unsqueeze(0)
        return self.out(self.rnn(self.embed(prev), h0)[0])


class _DualDecoderModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(_C04_V, 32, padding_idx=_C04_PAD)
        self.encoder = nn.GRU(32, 32, batch_first=True)
        self.teacher_decoder = _GRUDecoder(32, 32)
        self.student_decoder = _GRUDecoder(32, 16)

    def encode(self, src: torch.Tensor) -> torch.Tensor:
        return self.encoder(self.embed(src))[1].squeeze(0)


def _c04_losses(bug: bool, model: _DualDecoderModel, eps: float = 0.1, kd_weight: float = 0.5):
    enc = model.encode(_C04_SRC)
    student_out = model.student_decoder(_C04_PREV, enc)
    teacher_out = model.teacher_decoder(_C04_PREV, enc)
    target = _C04_TGT.reshape(-1, 1)
    non_pad = target.ne(_C04_PAD)
    # teacher: label-smoothed NLL on its own probabilities
    probs = F.softmax(teacher_out, dim=-1).view(-1, _C04_V)
    lprobs_t = probs.log()
    t_nll = -lprobs_t.gather(-1, target)[non_pad].sum()
    t_smooth = -lprobs_t.sum(-1, keepdim=True)[non_pad].sum()
    teacher_loss = (1.0 - eps) * t_nll + eps / _C04_V * t_smooth
    teacher_probs = probs if bug else probs.detach()
    # student: NLL mixed with cross-entropy to the teacher's distribution
    lprobs_s = F.log_softmax(student_out, dim=-1).view(-1, _C04_V)
    s_nll = -lprobs_s.gather(-1, target)[non_pad].sum()
    kd = (teacher_probs * -lprobs_s).sum(-1, keepdim=True)[non_pad].sum()
    student_loss = (1.0 - kd_weight) * s_nll + kd_weight * kd
    return student_loss, teacher_loss


def _c04_build(bug: bool) -> Case:
    torch.manual_seed(0)
    model = _DualDecoderModel().train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    batch = {"src_tokens": _C04_SRC, "prev_output_tokens": _C04_PREV, "target": _C04_TGT}

    def step() -> torch.Tensor:
        opt.zero_grad()
        student_loss, teacher_loss = _c04_losses(bug, model)
        total_loss = student_loss + teacher_loss
        total_loss.backward()
        opt.step()
        return total_loss

    return model, step, _kw(optimizer=opt, inputs=batch)


def _c04_proof(bug: bool) -> bool:
    """Does the teacher decoder get any gradient beyond that of its own loss (i.e. from the student's KD term)?"""
    torch.manual_seed(0)
    model = _DualDecoderModel().train()
    params = list(model.teacher_decoder.parameters())
    student_loss, teacher_loss = _c04_losses(bug, model)
    g_total = torch.autograd.grad(student_loss + teacher_loss, params, retain_graph=True, allow_unused=True)
    g_own = torch.autograd.grad(teacher_loss, params, allow_unused=True)
    diff = max(float(((a if a is not None else 0) - (b if b is not None else 0)).abs().max())
               for a, b in zip(g_total, g_own) if a is not None or b is not None)
    return diff > 1e-7


# --------------------------------------------------------------------------------------------- case-05
# huggingface/trl PR #1265 ("[DPO] average_log_prob when loss is IPO"): DPOTrainer's IPO loss regresses
# h = (log pi(y_w) - log pi(y_l)) - (log ref(y_w) - log ref(y_l)) onto 1 / (2 * beta), but `concatenated_forward` fed it
# sequence log-probabilities *summed* over the completion tokens. The IPO target then depends on the completion
# lengths (beta is effectively rescaled by the number of tokens); training runs and the loss falls. The HF preference
# tuning blog notes that, after consulting the IPO authors, TRL's IPO "was incorrect": the log-likelihoods must be
# averaged. Fix in the PR: `get_batch_logps(..., average_log_prob=self.loss_type == "ipo")`.

_C05_BETA = 0.1
_C05_PROMPT = torch.randint(3, 40, (2, 4), generator=_gen(3741))
_C05_CHOSEN = [torch.randint(3, 40, (n,), generator=_gen(3742 + n)) for n in (6, 3)]
_C05_REJECTED = [torch.randint(3, 40, (n,), generator=_gen(3752 + n)) for n in (2, 5)]


def _c05_batch() -> dict[str, torch.Tensor]:
    """Chosen rows then rejected rows: prompt + completion + eos, right-padded; labels -100 on prompt and padding."""
    rows = [(p, c) for p, c in zip(_C05_PROMPT, _C05_CHOSEN)] + [(p, r) for p, r in zip(_C05_PROMPT, _C05_REJECTED)]
    n = max(len(p) + len(c) + 1 for p, c in rows)
    ids = torch.zeros((len(rows), n), dtype=torch.long)
    labels = torch.full((len(rows), n), -100)
    mask = torch.zeros((len(rows), n), dtype=torch.long)
    for i, (p, c) in enumerate(rows):
        seq = torch.cat([p, c, torch.tensor([2])])
        ids[i, : len(seq)] = seq
        labels[i, len(p): len(seq)] = seq[len(p):]
        mask[i, : len(seq)] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _c05_batch_logps(logits: torch.Tensor, labels: torch.Tensor, average_log_prob: bool) -> torch.Tensor:
    labels = labels[:, 1:].clone()
    logits = logits[:, :-1, :]
    loss_mask = labels != -100
    labels[~loss_mask] = 0
    per_token = torch.gather(logits.log_softmax(-1), 2, labels.unsqueeze(2)).squeeze(2)
    if average_log_prob:
        return (per_token * loss_mask).sum(-1) / loss_mask.sum(-1)
    return (per_token * loss_mask).sum(-1)


def _c05_setup(bug: bool):
    policy = _llama()
    ref = copy.deepcopy(policy).eval().requires_grad_(False)
    opt = torch.optim.AdamW(policy.parameters(), lr=5e-4)
    batch = _c05_batch()
    average = not bug  # loss_type == "ipo"

    def concatenated_forward(model) -> torch.Tensor:
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        return _c05_batch_logps(logits, batch["labels"], average_log_prob=average)

    def step() -> torch.Tensor:
        opt.zero_grad()
        logps = concatenated_forward(policy)
        with torch.no_grad():
            ref_logps = concatenated_forward(ref)
        pi_logratios = logps[:2] - logps[2:]
        ref_logratios = ref_logps[:2] - ref_logps[2:]
        losses = (pi_logratios - ref_logratios - 1 / (2 * _C05_BETA)) ** 2
        loss = losses.mean()
        loss.backward()
        opt.step()
        return loss

    return policy, opt, batch, concatenated_forward, step


def _c05_build(bug: bool) -> Case:
    model, opt, batch, _, step = _c05_setup(bug)
    return model, step, _kw(optimizer=opt, inputs=batch)


def _c05_proof(bug: bool) -> bool:
    """Are the sequence scores IPO regresses onto 1/(2*beta) sums over the completion tokens (length-dependent)
    rather than per-token averages?"""
    model, _, batch, concatenated_forward, _ = _c05_setup(bug)
    with torch.no_grad():
        used = concatenated_forward(model)
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        summed = _c05_batch_logps(logits, batch["labels"], average_log_prob=False)
        averaged = _c05_batch_logps(logits, batch["labels"], average_log_prob=True)
    return bool(torch.allclose(used, summed) and not torch.allclose(used, averaged))


CASES: list[BlindCase] = [
    BlindCase("b37a-01", "https://github.com/THUDM/P-tuning/issues/13", "scheduler bound to wrong optimizer",
              "The prompt encoder's warmup/decay scheduler is built on the masked LM's optimizer, so the prompt "
              "encoder trains at a constant full learning rate with no warmup or decay.", _c01_build, _c01_proof),
    BlindCase("b37a-02", "https://github.com/instructlab/training/issues/243", "pretrain segments masked as chat",
              "The pretraining markers are compared as token-id lists against int ids, so pretraining segments are "
              "never recognised and their question tokens are masked out of the labels.", _c02_build, _c02_proof,
              known_miss="pretraining markers looked up as token lists, so pretraining segments are masked as chat: which tokens a marker stands for is tokenizer semantics"),
    BlindCase("b37a-03", "https://github.com/d2l-ai/d2l-en/issues/2582", "MLM padding slots carry loss",
              "A mean-reduced cross-entropy makes the per-slot MLM weights a no-op, so padded prediction slots train "
              "the model to predict <pad>.", _c03_build, _c03_proof),
    BlindCase("b37a-04", "https://github.com/pytorch/translate/pull/391", "KD gradient flows into teacher",
              "The teacher decoder's probabilities used as KD targets are not detached, so the student's KD term "
              "also trains the teacher toward the student.", _c04_build, _c04_proof,
              known_miss="the distillation term's gradient flows into the teacher decoder: which part a term should train is an intent the setup does not state"),
    BlindCase("b37a-05", "https://github.com/huggingface/trl/pull/1265", "IPO on summed log-probs",
              "IPO regresses sequence log-ratios summed over completion tokens onto 1/(2*beta), making the objective "
              "depend on completion length instead of using per-token averages.", _c05_build, _c05_proof),
]
