"""Blind batch 8: silent training bugs from public GitHub threads, each with its fixed twin.

Collected by someone who does not write the audit's checks. Every case builds the user's setup on a tiny real
model (plain torch CNNs, an LSTM, MLPs, a GAN and a TuckER knowledge-graph model; transformers Llama, T5, GPT-2
with PEFT LoRA, BERT, DistilBERT, SegFormer and MBart from tiny configs in code; nothing is downloaded) and proves
the bug without the audit on real runs and real tensors.
"""

from __future__ import annotations

import atexit
import functools
import shutil
import tempfile
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tests._blind import BlindCase, Case
from tests._blind_batch5 import _gen, _kw, _llama_config, _sgd_step


def _flat_grad(model: nn.Module) -> torch.Tensor:
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten()
                      for p in model.parameters() if p.requires_grad])


# --------------------------------------------------------------------------------------------- case-01
# a per-epoch CosineAnnealingLR(T_max=num_epochs) stepped inside the batch loop

_C01_EPOCHS, _C01_BPE, _C01_LR = 10, 8, 1e-3
_C01_X = torch.randn(8, 1, 16, 16, generator=_gen(801))
_C01_Y = (F.avg_pool2d(_C01_X, 3, 1, 1) > 0).float()


class _SegCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                                 nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                                 nn.Conv2d(8, 1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def _dice_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    p = torch.sigmoid(logits)
    inter = (p * target).sum()
    return 1 - (2 * inter + 1) / (p.sum() + target.sum() + 1)


def _c01_build(bug: bool) -> Case:
    torch.manual_seed(0)
    model = _SegCNN().train()
    opt = torch.optim.Adam(model.parameters(), lr=_C01_LR)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=_C01_EPOCHS)
    seen = [0]

    def step() -> torch.Tensor:
        opt.zero_grad()
        loss = _dice_loss(model(_C01_X), _C01_Y)
        loss.backward()
        opt.step()
        seen[0] += 1
        if bug or seen[0] % _C01_BPE == 0:  # the fix steps it once per epoch, after the epoch's batches
            sched.step()
        return loss

    return model, step, _kw(optimizer=opt, inputs=(_C01_X, _C01_Y), lr_scheduler=sched,
                            total_steps=_C01_EPOCHS * _C01_BPE)


def _c01_proof(bug: bool) -> bool:
    """Within the first epoch the lr already falls below half its base: the cosine is spent per batch."""
    _, step, kw = _c01_build(bug)
    opt = kw["optimizer"]
    lrs = []
    for _ in range(_C01_BPE):
        step()
        lrs.append(opt.param_groups[0]["lr"])
    return min(lrs) < 0.5 * _C01_LR


# --------------------------------------------------------------------------------------------- case-02
# BertSum-style extractive summarisation whose segment-id flag is toggled before, not after, each [SEP]

_C02_PAD, _C02_CLS, _C02_SEP = 0, 1, 2
_C02_DOCS = [
    [["how", "do", "i", "do", "my", "chores", "my", "parents", "want", "."], ["thank", "you", "so", "much", "!"],
     ["see", "you", "."]],
    [["the", "model", "reads", "every", "sentence", "."], ["it", "picks", "the", "best", "."]],
    [["see", "the", "parents", "."], ["the", "chores", "want", "you", "!"], ["thank", "my", "model", "."]],
]
_C02_SENT_LABELS = [[1, 0, 0], [0, 1], [1, 0, 1]]
_C02_VOCAB = {w: i + 3 for i, w in enumerate(sorted({w for doc in _C02_DOCS for sent in doc for w in sent}))}


def _c02_encode(doc: list[list[str]], bug: bool) -> tuple[list[int], list[int], list[int]]:
    """[CLS] sent [SEP] per sentence, alternating segment ids per sentence, [CLS] positions for the classifier."""
    input_ids: list[int] = []
    segment_ids: list[int] = []
    cls_positions: list[int] = []
    flag = 0
    for sent in doc:
        cls_positions.append(len(input_ids))
        for tok in [_C02_CLS] + [_C02_VOCAB[w] for w in sent] + [_C02_SEP]:
            if tok == _C02_SEP and bug:
                flag = 1 - flag
                segment_ids.append(flag)
            elif tok == _C02_SEP:
                segment_ids.append(flag)
                flag = 1 - flag
            else:
                segment_ids.append(flag)
            input_ids.append(tok)
    return input_ids, segment_ids, cls_positions


def _c02_batch(bug: bool) -> dict[str, torch.Tensor]:
    enc = [_c02_encode(doc, bug) for doc in _C02_DOCS]
    width = max(len(e[0]) for e in enc)
    n_sent = max(len(e[2]) for e in enc)
    ids = torch.full((len(enc), width), _C02_PAD)
    seg = torch.zeros(len(enc), width, dtype=torch.long)
    reps = torch.zeros(len(enc), n_sent, dtype=torch.long)
    rep_mask = torch.zeros(len(enc), n_sent)
    labels = torch.zeros(len(enc), n_sent)
    for i, (a, b, c) in enumerate(enc):
        ids[i, :len(a)] = torch.tensor(a)
        seg[i, :len(b)] = torch.tensor(b)
        reps[i, :len(c)] = torch.tensor(c)
        rep_mask[i, :len(c)] = 1
        labels[i, :len(c)] = torch.tensor(_C02_SENT_LABELS[i], dtype=torch.float)
    return {"input_ids": ids, "attention_mask": (ids != _C02_PAD).long(), "token_type_ids": seg,
            "sent_rep_token_ids": reps, "sent_rep_mask": rep_mask, "labels": labels}


class _ExtSummarizer(nn.Module):
    def __init__(self) -> None:
        from transformers import BertConfig, BertModel

        super().__init__()
        cfg = BertConfig(vocab_size=len(_C02_VOCAB) + 3, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                         intermediate_size=64, max_position_embeddings=64, type_vocab_size=2, pad_token_id=_C02_PAD)
        self.word_embedding_model = BertModel(cfg, add_pooling_layer=False)
        self.encoder = nn.Linear(32, 1)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, token_type_ids: torch.Tensor,
                sent_rep_token_ids: torch.Tensor, sent_rep_mask: torch.Tensor) -> torch.Tensor:
        h = self.word_embedding_model(input_ids=input_ids, attention_mask=attention_mask,
                                      token_type_ids=token_type_ids).last_hidden_state
        sents = h[torch.arange(h.shape[0])[:, None], sent_rep_token_ids] * sent_rep_mask[..., None]
        return self.encoder(sents).squeeze(-1)


def _c02_build(bug: bool) -> Case:
    batch = _c02_batch(bug)
    torch.manual_seed(0)
    model = _ExtSummarizer().train()
    opt = torch.optim.AdamW(model.parameters(), lr=2e-5)
    loss_fn = nn.BCEWithLogitsLoss(reduction="none")
    inputs = {k: v for k, v in batch.items() if k != "labels"}

    def loss() -> torch.Tensor:
        per_sent = loss_fn(model(**inputs), batch["labels"]) * batch["sent_rep_mask"]
        return per_sent.sum() / batch["sent_rep_mask"].sum()

    return model, _sgd_step(model, opt, loss), _kw(optimizer=opt, inputs=batch)


def _c02_proof(bug: bool) -> bool:
    """Some sentence's [CLS] .. [SEP] span does not carry a single segment id (its [SEP] takes the next one)."""
    for doc in _C02_DOCS:
        ids, seg, cls = _c02_encode(doc, bug)
        for start, stop in zip(cls, cls[1:] + [len(ids)]):
            if len(set(seg[start:stop])) != 1:
                return True
    return False


# --------------------------------------------------------------------------------------------- case-03
# Double DQN whose target net is the policy net itself and whose TD target is not detached

_C03_GAMMA = 0.99
_C03_S = torch.randn(32, 4, generator=_gen(803))
_C03_A = torch.randint(0, 2, (32,), generator=_gen(804))
_C03_R = torch.rand(32, generator=_gen(805))
_C03_NS = _C03_S + 0.1 * torch.randn(32, 4, generator=_gen(806))
_C03_D = (torch.rand(32, generator=_gen(807)) < 0.1).float()


class _QNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 2))

    def forward(self, s: torch.Tensor) -> torch.Tensor:
        return self.net(s)


def _c03_td_loss(policy: nn.Module, target: nn.Module, detach: bool) -> torch.Tensor:
    q = policy(_C03_S).gather(1, _C03_A[:, None]).squeeze(1)
    next_action = policy(_C03_NS).max(1)[1]
    next_q = target(_C03_NS).gather(1, next_action[:, None]).squeeze(1)
    expected = _C03_R + _C03_GAMMA * next_q * (1 - _C03_D)
    if detach:
        expected = expected.detach()
    return F.mse_loss(q, expected)


def _c03_nets(bug: bool) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    policy = _QNet().train()
    if bug:
        return policy, policy
    target = _QNet()
    target.load_state_dict(policy.state_dict())
    return policy, target.eval()


def _c03_build(bug: bool) -> Case:
    policy, target = _c03_nets(bug)
    opt = torch.optim.Adam(policy.parameters(), lr=1e-3)
    step = _sgd_step(policy, opt, lambda: _c03_td_loss(policy, target, detach=not bug))
    return policy, step, _kw(optimizer=opt, inputs=(_C03_S, _C03_A, _C03_R, _C03_NS, _C03_D))


def _c03_proof(bug: bool) -> bool:
    """The gradient the run takes differs from the semi-gradient (TD target held constant)."""
    policy, target = _c03_nets(bug)
    policy.zero_grad()
    _c03_td_loss(policy, target, detach=not bug).backward()
    used = _flat_grad(policy)
    policy.zero_grad()
    _c03_td_loss(policy, target, detach=True).backward()
    semi = _flat_grad(policy)
    return not torch.allclose(used, semi, rtol=1e-4, atol=1e-7)


# --------------------------------------------------------------------------------------------- case-04
# T5 seq2seq trained with target ids padded with pad_token_id (0) passed straight as labels

_C04_SRC_LENS, _C04_TGT_LENS = [10, 7, 5, 9], [8, 3, 5, 2]


def _c04_pad(lens: list[int], width: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = _gen(seed)
    ids = torch.zeros(len(lens), width, dtype=torch.long)
    for i, n in enumerate(lens):
        ids[i, :n - 1] = torch.randint(2, 40, (n - 1,), generator=g)
        ids[i, n - 1] = 1  # </s>
    return ids, (ids != 0).long()


_C04_SRC, _C04_SRC_MASK = _c04_pad(_C04_SRC_LENS, 10, 808)
_C04_TGT, _ = _c04_pad(_C04_TGT_LENS, 8, 809)


def _c04_labels(bug: bool) -> torch.Tensor:
    return _C04_TGT.clone() if bug else _C04_TGT.masked_fill(_C04_TGT == 0, -100)


def _c04_model() -> nn.Module:
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    cfg = T5Config(vocab_size=40, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
                   pad_token_id=0, eos_token_id=1, decoder_start_token_id=0,  # type: ignore[call-arg]
                   dropout_rate=0.0)
    return T5ForConditionalGeneration(cfg)


def _c04_build(bug: bool) -> Case:
    model = _c04_model().train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    labels = _c04_labels(bug)
    batch = {"input_ids": _C04_SRC, "attention_mask": _C04_SRC_MASK, "labels": labels}
    return model, _sgd_step(model, opt, lambda: model(**batch).loss), _kw(optimizer=opt, inputs=batch)


def _c04_proof(bug: bool) -> bool:
    """The model's loss is not the mean cross-entropy over the real target tokens alone."""
    model = _c04_model().eval()
    with torch.no_grad():
        out = model(input_ids=_C04_SRC, attention_mask=_C04_SRC_MASK, labels=_c04_labels(bug))
        real = _C04_TGT != 0
        wanted = F.cross_entropy(out.logits[real], _C04_TGT[real])
    return not torch.allclose(out.loss, wanted, atol=1e-5)


# --------------------------------------------------------------------------------------------- case-05
# continuing LoRA training from a saved adapter: PeftModel.from_pretrained(...) without is_trainable=True

_C05_IDS = torch.randint(0, 40, (4, 12), generator=_gen(810))


def _c05_base() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=40, n_positions=16, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(cfg)


@functools.cache
def _c05_adapter_dir() -> str:
    """A LoRA adapter from an earlier fine-tuning run, saved to disk (its lora_B no longer zero)."""
    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(_c05_base(), LoraConfig(r=4, lora_alpha=16, target_modules=["c_attn"],
                                                        lora_dropout=0.05, fan_in_fan_out=True,
                                                        task_type="CAUSAL_LM"))
    g = _gen(811)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.02 * torch.randn(p.shape, generator=g))
    path = tempfile.mkdtemp(prefix="b8c05-lora-")
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    peft_model.save_pretrained(path)
    return path


def _c05_model(bug: bool) -> nn.Module:
    from peft import PeftModel, prepare_model_for_kbit_training

    base = prepare_model_for_kbit_training(_c05_base())
    # what prepare_model_for_kbit_training adds for the load_in_8bit base (no 8-bit weights on CPU here)
    base.enable_input_require_grads()
    base.gradient_checkpointing_enable()
    if bug:
        model = PeftModel.from_pretrained(base, _c05_adapter_dir())
    else:
        model = PeftModel.from_pretrained(base, _c05_adapter_dir(), is_trainable=True)
    return model.train()


def _c05_build(bug: bool) -> Case:
    model = _c05_model(bug)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    batch = {"input_ids": _C05_IDS, "labels": _C05_IDS}
    return model, _sgd_step(model, opt, lambda: model(**batch).loss), _kw(optimizer=opt, inputs=batch)


def _c05_proof(bug: bool) -> bool:
    """After three training steps every LoRA weight is bitwise what was loaded."""
    model, step, _ = _c05_build(bug)
    lora = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}
    assert lora
    for _ in range(3):
        step()
    now = dict(model.named_parameters())
    return all(torch.equal(now[n].detach(), v) for n, v in lora.items())


# --------------------------------------------------------------------------------------------- case-06
# BERT-CRF NER: the fc and crf parameter group is built but never appended to the optimizer's groups

_C06_TAGS = 5
_C06_LENS = [12, 9, 7, 11]


def _c06_batch() -> dict[str, torch.Tensor]:
    g = _gen(812)
    ids = torch.zeros(4, 12, dtype=torch.long)
    mask = torch.zeros(4, 12, dtype=torch.long)
    for i, n in enumerate(_C06_LENS):
        ids[i, :n] = torch.randint(1, 40, (n,), generator=g)
        mask[i, :n] = 1
    tags = torch.randint(0, _C06_TAGS, (4, 12), generator=g) * mask
    return {"input_ids": ids, "attention_mask": mask, "labels": tags}


_C06_BATCH = _c06_batch()


def _crf_nll(em: torch.Tensor, tags: torch.Tensor, mask: torch.Tensor, start: torch.Tensor, end: torch.Tensor,
             trans: torch.Tensor) -> torch.Tensor:
    """Linear-chain CRF negative log-likelihood (mean over the batch)."""
    m = mask.bool()
    batch = torch.arange(em.shape[0])
    score = start[tags[:, 0]] + em[batch, 0, tags[:, 0]]
    alpha = start + em[:, 0]
    for t in range(1, em.shape[1]):
        step_score = trans[tags[:, t - 1], tags[:, t]] + em[batch, t, tags[:, t]]
        score = score + step_score * m[:, t]
        nxt = torch.logsumexp(alpha.unsqueeze(2) + trans + em[:, t].unsqueeze(1), dim=1)
        alpha = torch.where(m[:, t, None], nxt, alpha)
    last = tags[batch, m.sum(1) - 1]
    score = score + end[last]
    return (torch.logsumexp(alpha + end, dim=1) - score).mean()


class _BertCRF(nn.Module):
    def __init__(self) -> None:
        from transformers import BertConfig, BertModel

        super().__init__()
        cfg = BertConfig(vocab_size=40, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                         intermediate_size=64, max_position_embeddings=32, pad_token_id=0)
        self.bert = BertModel(cfg, add_pooling_layer=False)
        self.dropout = nn.Dropout(0.1)
        self.fc = nn.Linear(32, _C06_TAGS)
        self.crf_start = nn.Parameter(torch.empty(_C06_TAGS).uniform_(-0.1, 0.1))
        self.crf_end = nn.Parameter(torch.empty(_C06_TAGS).uniform_(-0.1, 0.1))
        self.crf_trans = nn.Parameter(torch.empty(_C06_TAGS, _C06_TAGS).uniform_(-0.1, 0.1))

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.bert(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        emissions = self.fc(self.dropout(h))
        return _crf_nll(emissions, labels, attention_mask, self.crf_start, self.crf_end, self.crf_trans)


def _c06_build(bug: bool) -> Case:
    torch.manual_seed(0)
    model = _BertCRF().train()
    parameters = []
    params: dict[str, Any] = {"lr": 3e-5, "weight_decay": 1e-2}
    params["params"] = [p for n, p in model.named_parameters() if "bert" in n]
    parameters.append(params)
    params = {"lr": 5e-2, "weight_decay": 1e-2}
    params["params"] = [p for n, p in model.named_parameters() if "crf" in n or n.startswith("fc")]
    if not bug:
        parameters.append(params)
    opt = torch.optim.AdamW(parameters)
    return model, _sgd_step(model, opt, lambda: model(**_C06_BATCH)), _kw(optimizer=opt, inputs=_C06_BATCH)


def _c06_proof(bug: bool) -> bool:
    """After three steps the emission layer and the CRF transitions are bitwise at their initial values."""
    model, step, _ = _c06_build(bug)
    assert isinstance(model, _BertCRF)
    before = model.fc.weight.detach().clone(), model.crf_trans.detach().clone()
    for _ in range(3):
        step()
    return torch.equal(before[0], model.fc.weight.detach()) and torch.equal(before[1], model.crf_trans.detach())


# --------------------------------------------------------------------------------------------- case-07
# fine-tuning with the message passing and batch norm "frozen" by requires_grad_(False) alone

_C07_X = (torch.rand(32, 64, generator=_gen(813)) < 0.2).float()  # molecular fingerprint bits
_C07_Y = torch.randn(32, 1, generator=_gen(814))


class _MPNNRegressor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.message_passing = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU())
        self.bn = nn.BatchNorm1d(32)
        self.predictor = nn.Sequential(nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.predictor(self.bn(self.message_passing(x)))


def _c07_freeze(module: nn.Module) -> None:
    module.requires_grad_(False)


def _c07_build(bug: bool) -> Case:
    torch.manual_seed(0)
    model = _MPNNRegressor().train()
    model.message_passing.apply(_c07_freeze)
    model.bn.apply(_c07_freeze)
    if not bug:
        model.message_passing.eval()
        model.bn.eval()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    step = _sgd_step(model, opt, lambda: F.mse_loss(model(_C07_X), _C07_Y))
    return model, step, _kw(optimizer=opt, inputs=(_C07_X, _C07_Y))


def _c07_proof(bug: bool) -> bool:
    """The frozen batch norm's running statistics move during fine-tuning."""
    model, step, _ = _c07_build(bug)
    assert isinstance(model, _MPNNRegressor) and model.bn.running_mean is not None
    before = model.bn.running_mean.clone()
    for _ in range(3):
        step()
    return not torch.equal(before, model.bn.running_mean)


# --------------------------------------------------------------------------------------------- case-08
# SegFormer semantic segmentation whose train-time flips are applied to the images and not to the label maps

_C08_IMG = torch.randn(4, 3, 32, 32, generator=_gen(815))
_C08_FLIP = [True, False, True, True]  # the p=0.5 HorizontalFlip draws of this batch


def _c08_rule(img: torch.Tensor) -> torch.Tensor:
    """The ground-truth labelling: class 1 where the smoothed first channel is positive."""
    return (F.avg_pool2d(img[:, :1], 5, 1, 2)[:, 0] > 0).long()


_C08_LBL = _c08_rule(_C08_IMG)


def _c08_augment(bug: bool) -> tuple[torch.Tensor, torch.Tensor]:
    imgs, lbls = [], []
    for img, lbl, flip in zip(_C08_IMG, _C08_LBL, _C08_FLIP):
        if flip:
            img = img.flip(-1)
            if not bug:
                lbl = lbl.flip(-1)
        imgs.append(img)
        lbls.append(lbl)
    return torch.stack(imgs), torch.stack(lbls)


def _c08_build(bug: bool) -> Case:
    from transformers import SegformerConfig, SegformerForSemanticSegmentation

    torch.manual_seed(0)
    cfg = SegformerConfig(num_channels=3, num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1],
                          hidden_sizes=[16, 32], patch_sizes=[7, 3], strides=[4, 2], num_attention_heads=[1, 2],
                          mlp_ratios=[2, 2], decoder_hidden_size=32, hidden_dropout_prob=0.0,
                          attention_probs_dropout_prob=0.0, classifier_dropout_prob=0.1, drop_path_rate=0.0)
    cfg.num_labels = 2
    model = SegformerForSemanticSegmentation(cfg).train()
    opt = torch.optim.AdamW(model.parameters(), lr=6e-5)
    pixel_values, labels = _c08_augment(bug)
    batch = {"pixel_values": pixel_values, "labels": labels}
    return model, _sgd_step(model, opt, lambda: model(**batch).loss), _kw(optimizer=opt, inputs=batch)


def _c08_proof(bug: bool) -> bool:
    """A large share of the training label pixels disagree with the labelling of the image they come with."""
    pixel_values, labels = _c08_augment(bug)
    return float((labels != _c08_rule(pixel_values)).float().mean()) > 0.1


# --------------------------------------------------------------------------------------------- case-09
# tabular regression: "normalise each feature by its max" loops over the first 13 rows instead of the 13 columns

_C09_SCALES = torch.tensor([90.0, 100, 28, 1, 0.9, 9, 100, 12, 24, 710, 22, 400, 38])
_C09_RAW = torch.rand(64, 13, generator=_gen(816)) * _C09_SCALES
_C09_Y = (_C09_RAW / _C09_SCALES) @ torch.linspace(-1, 1, 13)[:, None] * 5 + 22


def _c09_scale(x: torch.Tensor, bug: bool) -> torch.Tensor:
    x = x.clone()
    for i in range(13):
        if bug:
            x[i] = x[i] / x[i].max()
        else:
            x[:, i] = x[:, i] / x[:, i].max()
    return x


_C09_X = {True: _c09_scale(_C09_RAW, True), False: _c09_scale(_C09_RAW, False)}


def _c09_build(bug: bool) -> Case:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(13, 64), nn.ReLU(), nn.Linear(64, 1)).train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x = _C09_X[bug]
    step = _sgd_step(model, opt, lambda: F.mse_loss(model(x), _C09_Y))
    return model, step, _kw(optimizer=opt, inputs=(x, _C09_Y))


def _c09_proof(bug: bool) -> bool:
    """The features the model trains on are not scaled to a max of 1 per column (they span ~3 orders)."""
    col_max = _C09_X[bug].max(dim=0).values
    return not torch.allclose(col_max, torch.ones(13))


# --------------------------------------------------------------------------------------------- case-10
# DistilBERT document regression: the head's logits are squeezed to (B,) while the labels are (B, 1)

_C10_LENS = [12, 10, 8, 12, 6, 9, 11, 7]
_C10_Y = torch.rand(8, 1, generator=_gen(817)) * 16


def _c10_batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = _gen(818)
    ids = torch.zeros(8, 12, dtype=torch.long)
    for i, n in enumerate(_C10_LENS):
        ids[i, :n] = torch.randint(1, 40, (n,), generator=g)
    return ids, (ids != 0).long()


_C10_IDS, _C10_MASK = _c10_batch()


class _DocRegressor(nn.Module):
    def __init__(self, bug: bool) -> None:
        from transformers import DistilBertConfig, DistilBertModel

        super().__init__()
        cfg = DistilBertConfig(vocab_size=40, dim=32, n_layers=2, n_heads=4, hidden_dim=64,
                               max_position_embeddings=32, dropout=0.1, attention_dropout=0.1, pad_token_id=0)
        self.encoder = DistilBertModel(cfg)
        self.head = nn.Sequential(nn.Dropout(0.1), nn.Linear(32, 1))
        self.bug = bug

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        h = self.encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state[:, 0]
        logits = self.head(h)
        return logits.squeeze(-1) if self.bug else logits


def _c10_build(bug: bool) -> Case:
    torch.manual_seed(0)
    model = _DocRegressor(bug).train()
    opt = torch.optim.AdamW(model.parameters(), lr=2e-5)
    loss_fct = nn.MSELoss()
    step = _sgd_step(model, opt, lambda: loss_fct(model(_C10_IDS, _C10_MASK), _C10_Y))
    return model, step, _kw(optimizer=opt, inputs={"input_ids": _C10_IDS, "attention_mask": _C10_MASK,
                                                     "labels": _C10_Y})


def _c10_proof(bug: bool) -> bool:
    """The loss the run minimises is not the per-document squared error (it pairs every output with every label)."""
    import warnings

    model = _DocRegressor(bug).eval()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = model(_C10_IDS, _C10_MASK)
        used = nn.MSELoss()(out, _C10_Y)
    wanted = ((out.reshape(-1) - _C10_Y.reshape(-1)) ** 2).mean()
    return not torch.allclose(used, wanted, rtol=1e-5)


# --------------------------------------------------------------------------------------------- case-11
# RL policy-gradient trainer whose fwd_bwd() zeroes the grads for each micro-batch before its backward

_C11_MICRO = 4
_C11_IDS = torch.randint(3, 40, (8, 12), generator=_gen(819))
_C11_CMASK = torch.zeros(8, 11)
_C11_CMASK[:, 5:] = 1.0  # completion tokens (targets 6..11)
_C11_ADV = torch.randn(8, generator=_gen(820))


def _c11_model() -> nn.Module:
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(_llama_config()).train()


def _c11_micro_loss(model: nn.Module, sl: slice) -> torch.Tensor:
    ids, mask, adv = _C11_IDS[sl], _C11_CMASK[sl], _C11_ADV[sl]
    logits = model(input_ids=ids).logits[:, :-1]
    logp = logits.log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    return -(adv[:, None] * logp * mask).sum() / mask.sum() / _C11_MICRO


def _c11_fwd_bwd(model: nn.Module, opt: torch.optim.Optimizer, sl: slice, bug: bool) -> torch.Tensor:
    if bug:
        opt.zero_grad()
    loss = _c11_micro_loss(model, sl)
    loss.backward()
    return loss.detach()


def _c11_slices() -> list[slice]:
    n = _C11_IDS.shape[0] // _C11_MICRO
    return [slice(i * n, (i + 1) * n) for i in range(_C11_MICRO)]


def _c11_build(bug: bool) -> Case:
    model = _c11_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)

    def step() -> torch.Tensor:
        total = torch.zeros(())
        for sl in _c11_slices():
            total = total + _c11_fwd_bwd(model, opt, sl, bug)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if not bug:
            opt.zero_grad()
        return total

    return model, step, _kw(optimizer=opt, inputs={"input_ids": _C11_IDS, "completion_mask": _C11_CMASK,
                                                     "advantages": _C11_ADV})


def _c11_proof(bug: bool) -> bool:
    """The gradient at the optimizer step is not the whole batch's gradient (it is the last micro-batch's)."""
    model = _c11_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    opt.zero_grad()
    for sl in _c11_slices():
        _c11_fwd_bwd(model, opt, sl, bug)
    acc = _flat_grad(model)
    opt.zero_grad()
    torch.stack([_c11_micro_loss(model, sl) for sl in _c11_slices()]).sum().backward()
    full = _flat_grad(model)
    return not torch.allclose(acc, full, rtol=1e-3, atol=1e-7)


# --------------------------------------------------------------------------------------------- case-12
# LSTM acoustic model under a GradScaler: gradient_clip_global_norm applied to the still-scaled gradients

_C12_X = torch.randn(4, 20, 16, generator=_gen(821))
_C12_Y = torch.randint(0, 10, (4, 20), generator=_gen(822))
_C12_CLIP = 1.0


class _LstmAM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 32)
        self.lstm = nn.LSTM(32, 32, batch_first=True)
        self.out = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, _ = self.lstm(torch.relu(self.inp(x)))
        return self.out(h)


def _c12_loss(model: nn.Module) -> torch.Tensor:
    return F.cross_entropy(model(_C12_X).flatten(0, 1), _C12_Y.flatten())


def _c12_build(bug: bool) -> Case:
    torch.manual_seed(0)
    model = _LstmAM().train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")

    def step() -> torch.Tensor:
        opt.zero_grad()
        loss = _c12_loss(model)
        scaler.scale(loss).backward()
        if not bug:
            scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), _C12_CLIP)
        scaler.step(opt)
        scaler.update()
        return loss

    return model, step, _kw(optimizer=opt, inputs=(_C12_X, _C12_Y), scaler=scaler)


def _c12_proof(bug: bool) -> bool:
    """The gradient the optimizer steps with is orders of magnitude below both the true gradient and the clip."""
    torch.manual_seed(0)
    ref = _LstmAM()
    _c12_loss(ref).backward()
    true_norm = float(torch.linalg.vector_norm(_flat_grad(ref)))
    model, step, _ = _c12_build(bug)
    step()  # scaler.step unscales the grads in place before the optimizer reads them
    used = float(torch.linalg.vector_norm(_flat_grad(model)))
    return used < 0.01 * min(true_norm, _C12_CLIP)


# --------------------------------------------------------------------------------------------- case-13
# GAN speech enhancement: the discriminator optimizer lists loss_mrd's parameters twice and loss_mpd's never

_C13_CLEAN = torch.randn(4, 1, 256, generator=_gen(823)).cumsum(-1) / 16
_C13_NOISY = _C13_CLEAN + 0.3 * torch.randn(4, 1, 256, generator=_gen(824))


class _MRD(nn.Module):
    """Multi-resolution (spectrogram) discriminator."""

    def __init__(self) -> None:
        super().__init__()
        self.convs = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.LeakyReLU(0.1), nn.Conv2d(8, 1, 3, padding=1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        spec = torch.stft(x.squeeze(1), n_fft=32, hop_length=8, window=torch.hann_window(32),
                          return_complex=True).abs()
        return self.convs(spec.unsqueeze(1))


class _MPD(nn.Module):
    """Multi-period discriminator (one period)."""

    def __init__(self, period: int = 4) -> None:
        super().__init__()
        self.period = period
        self.convs = nn.Sequential(nn.Conv2d(1, 8, (5, 1), padding=(2, 0)), nn.LeakyReLU(0.1),
                                   nn.Conv2d(8, 1, (3, 1), padding=(1, 0)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, t = x.shape
        return self.convs(x.view(b, c, t // self.period, self.period))


class _UniverseGAN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.score_model = nn.Sequential(nn.Conv1d(1, 16, 9, padding=4), nn.PReLU(), nn.Conv1d(16, 16, 9, padding=4),
                                         nn.PReLU(), nn.Conv1d(16, 1, 9, padding=4))
        self.loss_mrd = _MRD()
        self.loss_mpd = _MPD()

    def forward(self, noisy: torch.Tensor) -> torch.Tensor:
        return noisy + self.score_model(noisy)


def _c13_build(bug: bool) -> Case:
    import warnings

    torch.manual_seed(0)
    model = _UniverseGAN().train()
    opt_g = torch.optim.Adam(model.score_model.parameters(), lr=2e-4, betas=(0.8, 0.99))
    second = model.loss_mrd if bug else model.loss_mpd
    params_disc = list(model.loss_mrd.parameters()) + list(second.parameters())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns about the duplicated parameters
        opt_d = torch.optim.Adam(params_disc, lr=2e-4, betas=(0.8, 0.99))
    discs = (model.loss_mrd, model.loss_mpd)

    def step() -> torch.Tensor:
        fake = model(_C13_NOISY)
        opt_d.zero_grad()
        d_loss = sum(((d(_C13_CLEAN) - 1) ** 2).mean() + (d(fake.detach()) ** 2).mean() for d in discs)
        d_loss.backward()
        opt_d.step()
        opt_g.zero_grad()
        g_adv = sum(((d(fake) - 1) ** 2).mean() for d in discs)
        g_loss = g_adv + 45 * F.l1_loss(fake, _C13_CLEAN)
        g_loss.backward()
        opt_g.step()
        return g_loss

    return model, step, _kw(optimizer=opt_g, inputs=(_C13_NOISY, _C13_CLEAN))


def _c13_proof(bug: bool) -> bool:
    """After three GAN iterations the period discriminator is bitwise at its initial weights."""
    model, step, _ = _c13_build(bug)
    assert isinstance(model, _UniverseGAN)
    before = [p.detach().clone() for p in model.loss_mpd.parameters()]
    for _ in range(3):
        step()
    return all(torch.equal(b, p.detach()) for b, p in zip(before, model.loss_mpd.parameters()))


# --------------------------------------------------------------------------------------------- case-14
# causal-LM tutorial with MBartForCausalLM swapped in: labels = input_ids, and MBart does not shift them

_C14_IDS = torch.randint(3, 40, (4, 12), generator=_gen(825))


def _c14_labels(bug: bool) -> torch.Tensor:
    if bug:
        return _C14_IDS.clone()  # DataCollatorForLanguageModeling(mlm=False)
    return torch.cat([_C14_IDS[:, 1:], torch.full((4, 1), -100)], dim=1)


def _c14_model() -> nn.Module:
    from transformers import MBartConfig, MBartForCausalLM

    torch.manual_seed(0)
    cfg = MBartConfig(vocab_size=40, d_model=32, decoder_layers=2, decoder_attention_heads=4, decoder_ffn_dim=64,
                      encoder_layers=2, encoder_attention_heads=4, encoder_ffn_dim=64, max_position_embeddings=32,
                      pad_token_id=1, bos_token_id=0, eos_token_id=2, dropout=0.1, attention_dropout=0.0)
    return MBartForCausalLM(cfg)


def _c14_build(bug: bool) -> Case:
    model = _c14_model().train()
    opt = torch.optim.AdamW(model.parameters(), lr=2e-5, weight_decay=0.01)
    batch = {"input_ids": _C14_IDS, "labels": _c14_labels(bug)}
    return model, _sgd_step(model, opt, lambda: model(**batch).loss), _kw(optimizer=opt, inputs=batch)


def _c14_proof(bug: bool) -> bool:
    """The loss the run minimises scores each position against its own input token: a copy task."""
    model = _c14_model().eval()
    with torch.no_grad():
        out = model(input_ids=_C14_IDS, labels=_c14_labels(bug))
        same_position = F.cross_entropy(out.logits.reshape(-1, 40), _C14_IDS.reshape(-1))
    return bool(torch.isclose(out.loss, same_position, rtol=1e-5))


# --------------------------------------------------------------------------------------------- case-15
# TuckER link prediction with padding_idx=0 on the entity and relation embeddings (0 is a real id)

_C15_NE, _C15_NR, _C15_D1, _C15_D2 = 30, 4, 16, 8
_C15_BPE, _C15_EPOCHS = 10, 50
_C15_E1 = torch.randint(0, _C15_NE, (16,), generator=_gen(826))
_C15_R = torch.arange(16) % _C15_NR  # relation 0 is in every batch
_C15_T = (torch.rand(16, _C15_NE, generator=_gen(827)) < 0.1).float()


class _TuckER(nn.Module):
    def __init__(self, bug: bool) -> None:
        super().__init__()
        pad: dict[str, Any] = {"padding_idx": 0} if bug else {}
        self.E = nn.Embedding(_C15_NE, _C15_D1, **pad)
        self.R = nn.Embedding(_C15_NR, _C15_D2, **pad)
        self.W = nn.Parameter(torch.empty(_C15_D2, _C15_D1, _C15_D1).uniform_(-1, 1))
        self.input_dropout, self.hidden_dropout1, self.hidden_dropout2 = nn.Dropout(0.3), nn.Dropout(0.4), \
            nn.Dropout(0.5)
        self.bn0, self.bn1 = nn.BatchNorm1d(_C15_D1), nn.BatchNorm1d(_C15_D1)
        nn.init.xavier_normal_(self.E.weight)
        nn.init.xavier_normal_(self.R.weight)

    def forward(self, e1_idx: torch.Tensor, r_idx: torch.Tensor) -> torch.Tensor:
        x = self.input_dropout(self.bn0(self.E(e1_idx))).view(-1, 1, _C15_D1)
        w = torch.mm(self.R(r_idx), self.W.view(_C15_D2, -1)).view(-1, _C15_D1, _C15_D1)
        x = torch.bmm(x, self.hidden_dropout1(w)).view(-1, _C15_D1)
        x = self.hidden_dropout2(self.bn1(x))
        return torch.sigmoid(torch.mm(x, self.E.weight.t()))


def _c15_build(bug: bool) -> Case:
    torch.manual_seed(0)
    model = _TuckER(bug).train()
    opt = torch.optim.Adam(model.parameters(), lr=0.0005)
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, 0.99)
    targets = (1.0 - 0.1) * _C15_T + 1.0 / _C15_NE  # label smoothing
    loss_fn = nn.BCELoss()
    seen = [0]

    def step() -> torch.Tensor:
        opt.zero_grad()
        loss = loss_fn(model(_C15_E1, _C15_R), targets)
        loss.backward()
        opt.step()
        seen[0] += 1
        if seen[0] % _C15_BPE == 0:  # decayed once per epoch
            sched.step()
        return loss

    return model, step, _kw(optimizer=opt, inputs=(_C15_E1, _C15_R, targets), lr_scheduler=sched,
                            total_steps=_C15_BPE * _C15_EPOCHS)


def _c15_proof(bug: bool) -> bool:
    """Relation 0 is in every batch, yet its embedding is bitwise unchanged after three steps."""
    model, step, _ = _c15_build(bug)
    assert isinstance(model, _TuckER)
    before = model.R.weight[0].detach().clone()
    for _ in range(3):
        step()
    return torch.equal(before, model.R.weight[0].detach())


CASES: list[BlindCase] = [
    BlindCase("b8-case-01", "https://github.com/ivadomed/ivadomed/pull/55", "schedules",
              "the per-epoch cosine scheduler (T_max = number of epochs) is stepped in the batch loop: the lr "
              "decays to zero within the first epoch and then cycles", _c01_build, _c01_proof),
    BlindCase("b8-case-02", "https://github.com/HHousen/TransformerSum/pull/35", "tokenization / segment ids",
              "the segment flag is toggled before each [SEP] is appended: every [SEP] gets the next sentence's "
              "token_type_id, so the alternating segments are misaligned with the sentences", _c02_build,
              _c02_proof,
              known_miss="blind batch 8: the [SEP] tokens' segment ids are a tokenization convention; no invariant knows which segment a separator belongs to"),
    BlindCase("b8-case-03", "https://github.com/datawhalechina/easy-rl/pull/117", "RL / gradient flow",
              "the Double DQN target network is the policy network itself and the TD target is not detached: the "
              "update backpropagates through the bootstrap target instead of a semi-gradient", _c03_build,
              _c03_proof,
              known_miss="blind batch 8: a regression target that is computed by the trained network itself (no target network, not detached) is not judged; consistency losses do that on purpose"),
    BlindCase("b8-case-04", "https://github.com/allenai/allennlp/issues/5342", "masks / padding",
              "T5 targets padded with pad_token_id are passed as labels without replacing the pads by -100: the "
              "loss is also computed on the padding", _c04_build, _c04_proof),
    BlindCase("b8-case-05", "https://github.com/tloen/alpaca-lora/issues/352", "LoRA / PEFT",
              "the saved LoRA adapter is loaded with PeftModel.from_pretrained without is_trainable=True: 0 "
              "trainable parameters, the loss runs and nothing is trained", _c05_build, _c05_proof),
    BlindCase("b8-case-06", "https://github.com/zjunlp/HVPNeT/issues/5", "optimizer / param groups",
              "the parameter group holding the fc and CRF layers is built but never appended to the optimizer's "
              "groups: the NER head is never updated", _c06_build, _c06_proof),
    BlindCase("b8-case-07", "https://github.com/chemprop/chemprop/pull/952", "freezing / BatchNorm",
              "the batch norm is frozen with requires_grad_(False) only, left in train mode: its running "
              "statistics keep updating during fine-tuning", _c07_build, _c07_proof),
    BlindCase("b8-case-08", "https://github.com/huggingface/cookbook/issues/248", "data pipeline / augmentation",
              "the random flips of the train transforms are applied to the images but not to the label maps: "
              "flipped images are trained against unflipped masks", _c08_build, _c08_proof,
              known_miss="blind batch 8: the flip is a data-pipeline draw applied to the image only; one step cannot tell an aligned label map from a flipped one"),
    BlindCase("b8-case-09", "https://github.com/GoogleCloudPlatform/vertex-ai-samples/issues/1599",
              "data preprocessing / normalization",
              "the per-feature max scaling loop indexes rows instead of columns: the first 13 samples are "
              "rescaled and the features keep their raw scales", _c09_build, _c09_proof),
    BlindCase("b8-case-10", "https://github.com/deepset-ai/FARM/issues/229", "shapes / broadcasting",
              "the regression logits are squeezed to (B,) while the labels are (B, 1): MSELoss broadcasts to "
              "(B, B) and pulls every prediction toward the batch mean", _c10_build, _c10_proof),
    BlindCase("b8-case-11", "https://github.com/pytorch/torchtitan/pull/3575", "gradient accumulation",
              "zero_grad is called in each micro-batch's forward/backward instead of at the optimizer step: only "
              "the last micro-batch's gradient is applied", _c11_build, _c11_proof),
    BlindCase("b8-case-12", "https://github.com/rwth-i6/returnn/issues/1590", "mixed precision / clipping",
              "with a GradScaler the global-norm clipping runs on the scaled gradients: it always fires and the "
              "optimizer receives a gradient about clip/scale in norm", _c12_build, _c12_proof),
    BlindCase("b8-case-13", "https://github.com/line/open-universe/issues/5", "optimizer / param groups",
              "the discriminator optimizer is given loss_mrd's parameters twice and loss_mpd's never: the period "
              "discriminator stays at its initialisation", _c13_build, _c13_proof),
    BlindCase("b8-case-14", "https://github.com/huggingface/transformers/issues/27517", "labels / causal shift",
              "MBartForCausalLM does not shift labels, and the tutorial collator sets labels = input_ids: the "
              "model is trained to copy its current input token", _c14_build, _c14_proof),
    BlindCase("b8-case-15", "https://github.com/ibalazevic/TuckER/issues/17", "embeddings / padding_idx",
              "the entity and relation embeddings are built with padding_idx=0 although 0 is a real id: relation "
              "0 gets no gradient and is never trained", _c15_build, _c15_proof),
]
