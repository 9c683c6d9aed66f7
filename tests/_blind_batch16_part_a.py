"""Blind batch 16 (part a): silent training bugs from public GitHub threads, each with its fixed twin."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tests._blind import BlindCase, Case
from tests._blind_batch5 import _gen, _kw, _sgd_step

# --------------------------------------------------------------------------------------------- case-01


class _TinySentenceEncoder(nn.Module):
    """A bi-encoder: token embedding, one transformer layer, attention-masked mean pooling."""

    def __init__(self, vocab: int = 40, d: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d, padding_idx=0)
        self.layer = nn.TransformerEncoderLayer(d, 2, 32, dropout=0.0, batch_first=True)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        mask = ids != 0
        h = self.layer(self.embed(ids), src_key_padding_mask=~mask)
        m = mask.unsqueeze(-1).float()
        return (h * m).sum(1) / m.sum(1).clamp(min=1.0)


class _SoftmaxLoss(nn.Module):
    """sentence-transformers' SoftmaxLoss: classifier over concat(u, v, |u - v|) for NLI pair labels.

    It holds the sentence model and its own classifier, which is part of the loss, not of the model."""

    def __init__(self, model: _TinySentenceEncoder, dim: int, num_labels: int) -> None:
        super().__init__()
        self.model = model
        self.classifier = nn.Linear(3 * dim, num_labels)

    def forward(self, ids_a: torch.Tensor, ids_b: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        u, v = self.model(ids_a), self.model(ids_b)
        logits = self.classifier(torch.cat([u, v, (u - v).abs()], -1))
        return F.cross_entropy(logits, labels)


_C01_A = torch.randint(1, 40, (8, 7), generator=_gen(1601))
_C01_B = torch.randint(1, 40, (8, 7), generator=_gen(1602))
_C01_A[:, 5:] = 0
_C01_B[:, 6:] = 0
_C01_Y = torch.randint(0, 3, (8,), generator=_gen(1603))


def _c01_build(bug: bool) -> Case:
    """NLI pair-class training with SoftmaxLoss; the trainer builds its optimizer from the model's parameters
    only (bug) instead of from the parameters of the loss, which include the classifier (fix)."""
    torch.manual_seed(0)
    st_model = _TinySentenceEncoder()
    loss_model = _SoftmaxLoss(st_model, 16, 3).train()
    params = st_model.parameters() if bug else loss_model.parameters()
    opt = torch.optim.AdamW(params, lr=2e-3)
    step = _sgd_step(loss_model, opt, lambda: loss_model(_C01_A, _C01_B, _C01_Y))
    return loss_model, step, _kw(optimizer=opt, inputs=(_C01_A, _C01_B, _C01_Y))


def _c01_proof(bug: bool) -> bool:
    """After three steps the SoftmaxLoss classifier, which gets a nonzero gradient, is still at its random init."""
    model, step, _ = _c01_build(bug)
    before = model.classifier.weight.detach().clone()
    for _ in range(3):
        step()
    got_grad = model.classifier.weight.grad is not None and float(model.classifier.weight.grad.abs().sum()) > 0
    return got_grad and torch.equal(before, model.classifier.weight.detach())

# --------------------------------------------------------------------------------------------- case-02


def _c02_tokenize_row(prompt: list[int], steps: list[list[int]], step_labels: list[bool]) -> list[int]:
    """trl's PRMTrainer.tokenize_row: only the last token of each step carries its (0/1) label, the rest -100."""
    labels = [-100] * len(prompt)
    for ids, lab in zip(steps, step_labels):
        labels += [-100] * (len(ids) - 1) + [int(lab)]
    return labels


_C02_ROWS = [([3, 4, 5], [[6, 7, 8], [9, 10]], [True, False]),
             ([11, 4, 12], [[13, 14], [15, 16, 17]], [False, True]),
             ([5, 6, 18], [[19, 20, 21], [22, 23]], [True, True]),
             ([24, 25, 3], [[26, 27], [28, 29, 30]], [False, False])]
_C02_IDS = torch.tensor([p + sum(s, []) for p, s, _ in _C02_ROWS])
_C02_MASK = torch.ones_like(_C02_IDS)
_C02_TRUE = torch.tensor([_c02_tokenize_row(*r) for r in _C02_ROWS])


def _c02_labels(bug: bool) -> torch.Tensor:
    """The `labels` column after `dataset.map(tokenize_row)`: in the bug the column keeps the dataset's original
    bool feature type, so the ints are cast back to bool (-100 -> True, 0 -> False, 1 -> True)."""
    rows = [_c02_tokenize_row(*r) for r in _C02_ROWS]
    if bug:
        rows = [[bool(x) for x in row] for row in rows]
    return torch.tensor(rows).long()


def _c02_model() -> nn.Module:
    from transformers import Qwen2Config, Qwen2ForTokenClassification

    cfg = Qwen2Config(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32, num_labels=2,
                      pad_token_id=0)
    return Qwen2ForTokenClassification(cfg)


def _c02_build(bug: bool) -> Case:
    """Process reward model (token classification) trained on step-end labels prepared by PRM tokenization."""
    torch.manual_seed(0)
    model = _c02_model().train()
    labels = _c02_labels(bug)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = _sgd_step(model, opt, lambda: model(input_ids=_C02_IDS, attention_mask=_C02_MASK, labels=labels).loss)
    return model, step, _kw(optimizer=opt, inputs=(_C02_IDS, _C02_MASK, labels))


def _c02_proof(bug: bool) -> bool:
    """The loss the model trains on differs from the cross-entropy over the step-end tokens only (the intended
    objective): every prompt and mid-step token is supervised as a positive step."""
    model, _, _ = _c02_build(bug)
    with torch.no_grad():
        out = model(input_ids=_C02_IDS, attention_mask=_C02_MASK, labels=_c02_labels(bug))
        keep = _C02_TRUE != -100
        ref = F.cross_entropy(out.logits[keep], _C02_TRUE[keep])
    return abs(float(out.loss) - float(ref)) > 1e-6

# --------------------------------------------------------------------------------------------- case-03

_C03_IGNORE = -1
_C03_SPEECH = 12  # speech codebook size; the decoder predicts speech_token_size + 3 classes (eos, fill, ...)


class _TinySpeechLM(nn.Module):
    """CosyVoice2-style text-to-speech-token LM: [sos, text, task_id, speech] through a Qwen2 backbone."""

    def __init__(self, n_text: int = 20, d: int = 32) -> None:
        super().__init__()
        from transformers import Qwen2Config, Qwen2Model

        cfg = Qwen2Config(vocab_size=8, hidden_size=d, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32)
        self.llm = Qwen2Model(cfg)
        self.text_embedding = nn.Embedding(n_text, d)
        self.speech_embedding = nn.Embedding(_C03_SPEECH + 3, d)
        self.llm_embedding = nn.Embedding(2, d)  # sos_eos, task_id
        self.llm_decoder = nn.Linear(d, _C03_SPEECH + 3)

    def forward(self, text: torch.Tensor, speech: torch.Tensor) -> torch.Tensor:
        b = text.shape[0]
        sos = self.llm_embedding.weight[0].expand(b, 1, -1)
        task = self.llm_embedding.weight[1].expand(b, 1, -1)
        emb = torch.cat([sos, self.text_embedding(text), task, self.speech_embedding(speech.clamp(min=0))], 1)
        return self.llm_decoder(self.llm(inputs_embeds=emb).last_hidden_state)


def _c03_target(text: torch.Tensor, speech: torch.Tensor) -> torch.Tensor:
    """lm_target: IGNORE over sos + text, then the speech tokens and eos; speech padding stays IGNORE."""
    b, t = text.shape
    eos = torch.full((b, 1), _C03_SPEECH, dtype=torch.long)
    tgt = torch.cat([torch.full((b, t + 1), _C03_IGNORE), speech, eos], 1)
    pad = torch.cat([torch.zeros(b, t + 1, dtype=torch.bool), speech == _C03_IGNORE,
                     torch.zeros(b, 1, dtype=torch.bool)], 1)
    tgt[pad] = _C03_IGNORE
    return tgt


_C03_TEXT = torch.randint(0, 20, (3, 4), generator=_gen(1631))
_C03_CHOSEN = torch.randint(0, _C03_SPEECH, (3, 5), generator=_gen(1632))
_C03_REJECTED = torch.randint(0, _C03_SPEECH, (3, 5), generator=_gen(1633))
_C03_REJECTED[0, 3:] = _C03_IGNORE  # a shorter rejected utterance, padded


def _c03_forward_dpo(model: _TinySpeechLM, bug: bool) -> dict[str, torch.Tensor]:
    """The LM's forward_dpo: SFT loss on chosen plus per-utterance mean logps of chosen and rejected speech."""
    text = torch.cat([_C03_TEXT, _C03_TEXT])
    speech = torch.cat([_C03_CHOSEN, _C03_REJECTED])
    logits = model(text, speech)
    lm_target = _c03_target(text, speech)
    n = _C03_TEXT.shape[0]
    chosen_logits, rejected_logits = logits[:n], logits[n:]
    chosen_lm_target, rejected_lm_target = lm_target[:n], lm_target[n:]
    loss = F.cross_entropy(chosen_logits.transpose(1, 2), chosen_lm_target, ignore_index=_C03_IGNORE)
    if bug:
        chosen_lm_mask = chosen_lm_target == _C03_IGNORE
        rejected_lm_mask = rejected_lm_target == _C03_IGNORE
    else:
        chosen_lm_mask = chosen_lm_target != _C03_IGNORE
        rejected_lm_mask = rejected_lm_target != _C03_IGNORE
    chosen_logps = torch.gather(chosen_logits.log_softmax(dim=-1), dim=2,
                                index=chosen_lm_target.masked_fill(~(chosen_lm_target != _C03_IGNORE), 0)
                                .unsqueeze(-1)).squeeze(-1)
    rejected_logps = torch.gather(rejected_logits.log_softmax(dim=-1), dim=2,
                                  index=rejected_lm_target.masked_fill(~(rejected_lm_target != _C03_IGNORE), 0)
                                  .unsqueeze(-1)).squeeze(-1)
    if bug:
        chosen_logps = (chosen_logps * chosen_lm_mask).mean(dim=-1)
        rejected_logps = (rejected_logps * chosen_lm_mask).mean(dim=-1)
    else:
        chosen_logps = (chosen_logps * chosen_lm_mask).sum(dim=-1) / chosen_lm_mask.sum(dim=-1)
        rejected_logps = (rejected_logps * rejected_lm_mask).sum(dim=-1) / rejected_lm_mask.sum(dim=-1)
    return {"loss": loss, "logits": logits, "chosen_logps": chosen_logps, "rejected_logps": rejected_logps}


def _c03_dpo_loss(policy: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], beta: float = 0.1) -> torch.Tensor:
    logits = (policy["chosen_logps"] - policy["rejected_logps"]) - (ref["chosen_logps"] - ref["rejected_logps"])
    return -F.logsigmoid(beta * logits).mean()


def _c03_models(bug: bool) -> tuple[_TinySpeechLM, _TinySpeechLM]:
    import copy

    torch.manual_seed(0)
    policy = _TinySpeechLM().train()
    ref = copy.deepcopy(policy).eval().requires_grad_(False)
    return policy, ref


def _c03_build(bug: bool) -> Case:
    """DPO fine-tune of a speech-token LM against a frozen reference copy; total loss = SFT loss + DPO loss."""
    policy, ref = _c03_models(bug)
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-4)

    def loss_fn() -> torch.Tensor:
        out = _c03_forward_dpo(policy, bug)
        with torch.no_grad():
            ref_out = _c03_forward_dpo(ref, bug)
        return out["loss"] + _c03_dpo_loss(out, ref_out)

    step = _sgd_step(policy, opt, loss_fn)
    return policy, step, _kw(optimizer=opt, inputs=(_C03_TEXT, _C03_CHOSEN, _C03_REJECTED))


def _c03_proof(bug: bool) -> bool:
    """The DPO term's gradient w.r.t. the logits at every real speech-token target position is exactly zero:
    the preference signal is computed on the ignored (text / padding) positions instead."""
    policy, ref = _c03_models(bug)
    out = _c03_forward_dpo(policy, bug)
    out["logits"].retain_grad()
    with torch.no_grad():
        ref_out = _c03_forward_dpo(ref, bug)
    _c03_dpo_loss(out, ref_out).backward()
    text = torch.cat([_C03_TEXT, _C03_TEXT])
    speech = torch.cat([_C03_CHOSEN, _C03_REJECTED])
    real = _c03_target(text, speech) != _C03_IGNORE
    return float(out["logits"].grad[real].abs().sum()) == 0.0

# --------------------------------------------------------------------------------------------- case-04


class _TinyYolo(nn.Module):
    """Darknet-style conv backbone and a 1x1 YOLO head: per grid cell (x, y, w, h, objectness, 2 classes)."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.LeakyReLU(0.1), nn.MaxPool2d(2),
            nn.Conv2d(8, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.LeakyReLU(0.1), nn.MaxPool2d(2))
        self.head = nn.Conv2d(16, 7, 1)

    def forward(self, imgs: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(imgs)).permute(0, 2, 3, 1)


_C04_IMGS = torch.randn(4, 3, 16, 16, generator=_gen(1641))
_C04_OBJ = (torch.rand(4, 4, 4, generator=_gen(1642)) > 0.7).float()
_C04_BOX = torch.rand(4, 4, 4, 4, generator=_gen(1643))
_C04_CLS = torch.randint(0, 2, (4, 4, 4), generator=_gen(1644))


def _c04_loss(out: torch.Tensor) -> torch.Tensor:
    obj = _C04_OBJ.bool()
    box = F.mse_loss(torch.sigmoid(out[..., :4])[obj], _C04_BOX[obj])
    conf = F.binary_cross_entropy_with_logits(out[..., 4], _C04_OBJ)
    cls = F.cross_entropy(out[..., 5:][obj], _C04_CLS[obj])
    return box + conf + cls


def _c04_build(bug: bool) -> Case:
    """YOLOv3 train.py loop with --gradient_accumulations 1: backward every batch, optimizer step gated on
    `batches_done % gradient_accumulations` (bug) instead of `... == 0` (fix)."""
    torch.manual_seed(0)
    model = _TinyYolo().train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    gradient_accumulations = 1
    state = {"batches_done": 0}

    def step() -> torch.Tensor:
        loss = _c04_loss(model(_C04_IMGS))
        loss.backward()
        batches_done = state["batches_done"]
        do_step = batches_done % gradient_accumulations if bug else batches_done % gradient_accumulations == 0
        if do_step:
            opt.step()
            opt.zero_grad()
        state["batches_done"] += 1
        return loss

    return model, step, _kw(optimizer=opt, inputs=_C04_IMGS)


def _c04_proof(bug: bool) -> bool:
    """After five batches no weight has moved (the optimizer never stepped) while gradients keep piling up."""
    model, step, _ = _c04_build(bug)
    before = [p.detach().clone() for p in model.parameters()]
    for _ in range(5):
        step()
    return all(torch.equal(b, p.detach()) for b, p in zip(before, model.parameters()))

# --------------------------------------------------------------------------------------------- case-05


class _ModelEmaV2(nn.Module):
    """timm's ModelEmaV2: a deepcopy of the model whose state is lerped toward the live model every step.

    The fix (the optax-style EMA from the thread) starts the average at zero and divides by the bias correction
    1 - decay**t, so the kept weights are an average of the trained iterates rather than mostly the init."""

    def __init__(self, model: nn.Module, decay: float, debias: bool) -> None:
        super().__init__()
        import copy

        self.module = copy.deepcopy(model).eval().requires_grad_(False)
        self.decay, self.debias, self.updates = decay, debias, 0
        self.shadow = [torch.zeros_like(v) for v in self.module.state_dict().values()] if debias else None

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        self.updates += 1
        live = list(model.state_dict().values())
        kept = list(self.module.state_dict().values())
        if not self.debias:
            for ema_v, model_v in zip(kept, live):
                if ema_v.is_floating_point():
                    ema_v.copy_(self.decay * ema_v + (1.0 - self.decay) * model_v)
                else:
                    ema_v.copy_(model_v)
            return
        assert self.shadow is not None
        corr = 1.0 - self.decay ** self.updates
        for sh, ema_v, model_v in zip(self.shadow, kept, live):
            if ema_v.is_floating_point():
                sh.mul_(self.decay).add_(model_v, alpha=1.0 - self.decay)
                ema_v.copy_(sh / corr)
            else:
                ema_v.copy_(model_v)


class _SmallConvNet(nn.Module):
    def __init__(self, n_cls: int = 5) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
                                      nn.Conv2d(8, 16, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(16),
                                      nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.fc = nn.Linear(16, n_cls)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.features(x))


_C05_X = torch.randn(8, 3, 12, 12, generator=_gen(1651))
_C05_Y = torch.randint(0, 5, (8,), generator=_gen(1652))
_C05_DECAY = 0.995


def _c05_build(bug: bool) -> Case:
    """Fine-tuning with a high-decay weight EMA (the model that gets evaluated and saved) updated after every step."""
    torch.manual_seed(0)
    model = _SmallConvNet().train()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ema = _ModelEmaV2(model, _C05_DECAY, debias=not bug)
    model.model_ema = [ema]  # kept out of the module tree (a list), as a training script holds it beside the model

    def step() -> torch.Tensor:
        opt.zero_grad()
        loss = F.cross_entropy(model(_C05_X), _C05_Y)
        loss.backward()
        opt.step()
        ema.update(model)
        return loss

    return model, step, _kw(optimizer=opt, inputs=_C05_X)


def _c05_proof(bug: bool) -> bool:
    """After 40 steps the EMA weights have covered under a quarter of the way from the init to the trained weights
    (projection onto the training displacement): the kept model is essentially the untrained init."""
    model, step, _ = _c05_build(bug)
    init = torch.cat([p.detach().flatten().clone() for p in model.parameters()])
    for _ in range(40):
        step()
    cur = torch.cat([p.detach().flatten() for p in model.parameters()])
    ema_w = torch.cat([p.detach().flatten() for p in model.model_ema[0].module.parameters()])
    d = cur - init
    frac = float(torch.dot(ema_w - init, d) / torch.dot(d, d))
    return frac < 0.25


CASES: list[BlindCase] = [
    BlindCase("b16-case-01", "https://github.com/huggingface/sentence-transformers/issues/2872",
              "parameters missing from optimizer",
              "The optimizer is built from the sentence model's parameters only, so the SoftmaxLoss classifier "
              "stays at its random init and the encoder is fitted to a fixed random projection.",
              _c01_build, _c01_proof),
    BlindCase("b16-case-02", "https://github.com/huggingface/trl/pull/2127", "ignore-index labels corrupted",
              "The -100 ignore labels are cast to bool by the dataset's original label feature, so every prompt "
              "and mid-step token becomes a positive target and the reward model learns to say 'correct' everywhere.",
              _c02_build, _c02_proof,
              known_miss="the -100 labels are cast to bool upstream, so every position is a valid positive target; "
                         "nothing marks them as meant to be ignored"),
    BlindCase("b16-case-03", "https://github.com/FunAudioLLM/CosyVoice/issues/1449", "inverted loss mask",
              "The DPO log-probabilities are masked with target == IGNORE_ID (and the rejected side with the chosen "
              "mask), so the preference term is computed on ignored text/padding positions and never pushes on the "
              "speech tokens being compared.", _c03_build, _c03_proof,
              known_miss="the inverted mask selects ignored positions inside the preference loss's own arithmetic, "
                         "after the model's outputs; supervision is measured at the model's outputs only"),
    BlindCase("b16-case-04", "https://github.com/eriklindernoren/PyTorch-YOLOv3/issues/325",
              "gradient accumulation condition",
              "The optimizer step is gated on `batches_done % gradient_accumulations`, which is always 0 for an "
              "accumulation of 1, so the optimizer never steps and the detector's weights never change.",
              _c04_build, _c04_proof,
              known_miss="the optimizer step is gated by a condition that never fires; one audited call cannot tell "
                         "a skipped step from gradient accumulation"),
    BlindCase("b16-case-05", "https://github.com/huggingface/pytorch-image-models/issues/1182",
              "EMA bias (no debias / warmup)",
              "The weight EMA starts as a copy of the initial weights and, with a high decay and no bias correction, "
              "stays almost exactly at the init, so the evaluated and saved EMA model has barely learned.",
              _c05_build, _c05_proof,
              known_miss="the EMA copy kept beside the model is updated outside any optimizer; its (lack of) bias "
                         "correction is not measured"),
]
