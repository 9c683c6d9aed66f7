"""Blind batch 16 (part c): silent training bugs from public GitHub threads, each with its fixed twin."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tests._blind import BlindCase, Case
from tests._blind_batch5 import _gen, _kw, _sgd_step

# --------------------------------------------------------------------------------------------- case-11


class _PatchEncoder(nn.Module):
    """Time-series patch encoder: 1-D conv embedding, a projection head for the triplet loss, and a pretext
    discriminator that tells temporally adjacent patch pairs from random ones."""

    def __init__(self, c: int = 1, d: int = 16) -> None:
        super().__init__()
        self.embedding = nn.Sequential(nn.Conv1d(c, 8, 3, padding=1), nn.ReLU(), nn.Conv1d(8, d, 3, padding=1),
                                       nn.ReLU(), nn.AdaptiveAvgPool1d(1), nn.Flatten())
        self.projection = nn.Sequential(nn.Linear(d, d), nn.ReLU(), nn.Linear(d, 8))
        self.classifier = nn.Sequential(nn.Linear(2 * d, d), nn.ReLU(), nn.Linear(d, 1))


_C11_SERIES = torch.cumsum(torch.randn(1, 1, 200, generator=_gen(1101)), -1) * 0.1
_C11_STARTS = torch.randint(0, 200 - 24 - 4, (8,), generator=_gen(1102))


def _c11_patches() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    anchors = torch.stack([_C11_SERIES[0, :, s:s + 16] for s in _C11_STARTS.tolist()])
    positives = torch.stack([_C11_SERIES[0, :, s + 2:s + 18] for s in _C11_STARTS.tolist()])  # small shift
    pretext = torch.stack([_C11_SERIES[0, :, s + 8:s + 24] for s in _C11_STARTS.tolist()])  # adjacent patch
    return anchors, positives, pretext


_C11_A, _C11_P, _C11_N = _c11_patches()


def _c11_loss(model: _PatchEncoder, bug: bool) -> torch.Tensor:
    m = _C11_A.shape[0]
    h = model.embedding(torch.cat([_C11_A, _C11_P, _C11_N], 0))
    h_anchors, h_pos, h_pre = h[:m], h[m:2 * m], h[2 * m:]
    z_anchor = F.normalize(model.projection(h_anchors), dim=1)
    z_pos = F.normalize(model.projection(h_pos), dim=1)
    sim_ap = (z_anchor @ z_pos.T) / 1.0
    pos_sims = sim_ap.diag()
    sim_ap_f = sim_ap.clone()
    sim_ap_f.diagonal().fill_(-float("inf") if bug else float("inf"))  # bug: -inf becomes +inf distance
    neg_dists = 1 - sim_ap_f
    hard_neg_dists, _ = torch.max(neg_dists, dim=1)
    pos_dists = 1 - pos_sims
    triplet_loss = F.relu(pos_dists - hard_neg_dists + 0.5).mean()
    # temporal pretext task: adjacent pairs (label 1) vs shuffled pairs (label 0)
    unadj = h_anchors[torch.roll(torch.arange(m), 3)]
    logits = model.classifier(torch.cat([torch.cat([h_anchors, h_pre], 1), torch.cat([h_anchors, unadj], 1)], 0))
    labels = torch.cat([torch.ones(m, 1), torch.zeros(m, 1)])
    pretext_loss = F.binary_cross_entropy_with_logits(logits, labels)
    return triplet_loss + 0.5 * pretext_loss


def _c11_build(bug: bool) -> Case:
    """Patch triplet loss whose 'farthest negative' mask fills the diagonal of the similarity with -inf."""
    torch.manual_seed(11)
    model = _PatchEncoder().train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    step = _sgd_step(model, opt, lambda: _c11_loss(model, bug))
    return model, step, _kw(optimizer=opt, inputs=(_C11_A, _C11_P, _C11_N))


def _c11_proof(bug: bool) -> bool:
    """The diagonal (the positive itself) is always picked as the farthest negative, so the triplet term is 0
    and the projection head, trained by nothing else, gets an exactly zero gradient."""
    model, _, _ = _c11_build(bug)
    model.zero_grad()
    _c11_loss(model, bug).backward()
    return all(p.grad is None or float(p.grad.abs().sum()) == 0.0 for p in model.projection.parameters())

# --------------------------------------------------------------------------------------------- case-12


class _TinyCenterNet(nn.Module):
    """One-shot tracker backbone with CenterNet-style heads: heatmap, box size, offset and re-ID embedding."""

    def __init__(self, emb: int = 8) -> None:
        super().__init__()
        self.base = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1), nn.ReLU())
        self.heads = nn.ModuleDict({"hm": nn.Conv2d(16, 1, 1), "wh": nn.Conv2d(16, 2, 1), "reg": nn.Conv2d(16, 2, 1),
                                    "id": nn.Conv2d(16, emb, 1)})
        self.heads["hm"].bias.data.fill_(-2.19)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        f = self.base(x)
        return {k: h(f) for k, h in self.heads.items()}


def _c12_focal(pred: torch.Tensor, gt: torch.Tensor) -> torch.Tensor:
    pos, neg = gt.eq(1).float(), gt.lt(1).float()
    pos_loss = (torch.log(pred) * (1 - pred) ** 2 * pos).sum()
    neg_loss = (torch.log(1 - pred) * pred ** 2 * (1 - gt) ** 4 * neg).sum()
    return -(pos_loss + neg_loss) / pos.sum().clamp(min=1)


def _c12_gather(feat: torch.Tensor, ind: torch.Tensor) -> torch.Tensor:
    b, c = feat.shape[:2]
    feat = feat.view(b, c, -1).permute(0, 2, 1)
    return feat.gather(1, ind[..., None].expand(-1, -1, c))


class _MotLoss(nn.Module):
    """Detection + re-ID loss with learnable task uncertainties; the re-ID classifier lives in the loss."""

    def __init__(self, emb: int = 8, n_id: int = 6) -> None:
        super().__init__()
        self.classifier = nn.Linear(emb, n_id)
        self.emb_scale = (2 ** 0.5) * torch.log(torch.tensor(n_id - 1.0))
        self.s_det = nn.Parameter(-1.85 * torch.ones(1))
        self.s_id = nn.Parameter(-1.05 * torch.ones(1))

    def forward(self, out: dict[str, torch.Tensor], batch: dict[str, torch.Tensor]) -> torch.Tensor:
        hm = out["hm"].sigmoid().clamp(1e-4, 1 - 1e-4)
        hm_loss = _c12_focal(hm, batch["hm"])
        mask = batch["reg_mask"][..., None].float()
        wh_loss = F.l1_loss(_c12_gather(out["wh"], batch["ind"]) * mask, batch["wh"] * mask, reduction="sum") / (
            mask.sum() * 2 + 1e-4)
        off_loss = F.l1_loss(_c12_gather(out["reg"], batch["ind"]) * mask, batch["reg"] * mask, reduction="sum") / (
            mask.sum() * 2 + 1e-4)
        det_loss = hm_loss + 0.1 * wh_loss + off_loss
        id_head = _c12_gather(out["id"], batch["ind"])[batch["reg_mask"] > 0]
        id_head = self.emb_scale * F.normalize(id_head, dim=1)
        id_loss = F.cross_entropy(self.classifier(id_head), batch["ids"][batch["reg_mask"] > 0])
        loss = torch.exp(-self.s_det) * det_loss + torch.exp(-self.s_id) * id_loss + (self.s_det + self.s_id)
        return 0.5 * loss


class _ModelWithLoss(nn.Module):
    def __init__(self, model: nn.Module, loss: nn.Module) -> None:
        super().__init__()
        self.model, self.loss = model, loss

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.loss(self.model(batch["input"]), batch)


def _c12_batch() -> dict[str, torch.Tensor]:
    g = _gen(1201)
    b, h, w, k = 2, 8, 8, 3
    ind = torch.stack([torch.randperm(h * w, generator=g)[:k] for _ in range(b)])
    hm = torch.zeros(b, 1, h, w)
    hm.view(b, -1).scatter_(1, ind, 1.0)
    return {"input": torch.randn(b, 3, h, w, generator=g), "hm": hm, "ind": ind,
            "reg_mask": torch.ones(b, k, dtype=torch.long), "wh": torch.rand(b, k, 2, generator=g) * 4,
            "reg": torch.rand(b, k, 2, generator=g), "ids": torch.randint(0, 6, (b, k), generator=g)}


_C12_BATCH = _c12_batch()


def _c12_build(bug: bool) -> Case:
    """Trainer builds the optimizer from model.parameters(); the loss module's parameters are never added."""
    torch.manual_seed(12)
    model = _TinyCenterNet()
    loss = _MotLoss()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    if not bug:
        optimizer.add_param_group({"params": loss.parameters()})
    model_with_loss = _ModelWithLoss(model, loss).train()
    step = _sgd_step(model_with_loss, optimizer, lambda: model_with_loss(_C12_BATCH))
    return model_with_loss, step, _kw(optimizer=optimizer, inputs=_C12_BATCH["input"])


def _c12_proof(bug: bool) -> bool:
    """After three steps the task uncertainties s_det/s_id and the re-ID classifier still hold their initial
    values although they receive gradients."""
    mwl, step, _ = _c12_build(bug)
    before = [p.detach().clone() for p in mwl.loss.parameters()]
    for _ in range(3):
        step()
    has_grad = all(p.grad is not None and float(p.grad.abs().sum()) > 0 for p in mwl.loss.parameters())
    unchanged = all(torch.equal(a, p) for a, p in zip(before, mwl.loss.parameters()))
    return has_grad and unchanged

# --------------------------------------------------------------------------------------------- case-13


class _SSLNet(nn.Module):
    """Small conv classifier with batch norm returning {'logits', 'feat'} like the SSL toolkit's nets."""

    def __init__(self, n_cls: int = 4) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                                      nn.Conv2d(8, 16, 3, padding=1, stride=2), nn.BatchNorm2d(16), nn.ReLU(),
                                      nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.fc = nn.Linear(16, n_cls)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        feat = self.features(x)
        return {"logits": self.fc(feat), "feat": feat}


class _EMA:
    """Shadow weights swapped into the model for the teacher pass (apply_shadow / restore), updated after step."""

    def __init__(self, model: nn.Module, decay: float = 0.999) -> None:
        self.model, self.decay = model, decay
        self.shadow = {n: p.detach().clone() for n, p in model.named_parameters()}
        self.backup: dict[str, torch.Tensor] = {}

    def apply_shadow(self) -> None:
        for n, p in self.model.named_parameters():
            self.backup[n] = p.data.clone()
            p.data.copy_(self.shadow[n])

    def restore(self) -> None:
        for n, p in self.model.named_parameters():
            p.data.copy_(self.backup[n])
        self.backup = {}

    def update(self) -> None:
        for n, p in self.model.named_parameters():
            self.shadow[n].mul_(self.decay).add_(p.detach(), alpha=1 - self.decay)


class _BNController:
    """Keeps BN running statistics unchanged across the unlabeled forward passes."""

    def __init__(self) -> None:
        self.backup: dict[str, torch.Tensor] = {}

    def freeze_bn(self, model: nn.Module) -> None:
        self.backup = {n: b.clone() for n, b in model.named_buffers()}

    def unfreeze_bn(self, model: nn.Module) -> None:
        for n, b in model.named_buffers():
            b.data = self.backup[n]


def _c13_consistency_mse(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(torch.softmax(logits, dim=-1), targets, reduction="none").mean(dim=1).mean()


def _c13_data() -> tuple[torch.Tensor, ...]:
    g = _gen(1301)
    x_lb = torch.randn(4, 3, 8, 8, generator=g)
    y_lb = torch.randint(0, 4, (4,), generator=g)
    base = torch.randn(6, 3, 8, 8, generator=g)
    x_ulb_w = base + 0.05 * torch.randn(base.shape, generator=g)  # weak: light noise
    x_ulb_s = torch.flip(base, dims=[3]) * 0.7 + 0.5 * torch.randn(base.shape, generator=g)  # strong
    return x_lb, y_lb, x_ulb_w, x_ulb_s


_C13_XLB, _C13_YLB, _C13_XW, _C13_XS = _c13_data()


class _MeanTeacher:
    def __init__(self, bug: bool) -> None:
        self.bug = bug
        self.model = _SSLNet().train()
        self.ema = _EMA(self.model)
        self.bn_controller = _BNController()
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.03, momentum=0.9, weight_decay=5e-4)
        self.it, self.num_train_iter, self.unsup_warm_up, self.lambda_u = 2000, 5000, 0.4, 50.0
        self.log: list[dict[str, float]] = []

    def train_step(self, x_lb: torch.Tensor, y_lb: torch.Tensor, x_ulb_w: torch.Tensor,
                   x_ulb_s: torch.Tensor) -> torch.Tensor:
        logits_x_lb = self.model(x_lb)["logits"]
        self.ema.apply_shadow()
        with torch.no_grad():
            self.bn_controller.freeze_bn(self.model)
            outs_x_ulb_w = self.model(x_ulb_w)
            logits_x_ulb_w = outs_x_ulb_w["logits"]
            self.bn_controller.unfreeze_bn(self.model)
        self.ema.restore()
        self.bn_controller.freeze_bn(self.model)
        outs_x_ulb_s = self.model(x_ulb_s)
        logits_x_ulb_s = outs_x_ulb_w["logits"] if self.bug else outs_x_ulb_s["logits"]
        self.bn_controller.unfreeze_bn(self.model)
        sup_loss = F.cross_entropy(logits_x_lb, y_lb)
        unsup_loss = _c13_consistency_mse(logits_x_ulb_s, torch.softmax(logits_x_ulb_w.detach(), dim=-1))
        unsup_warmup = min(max(self.it / (self.unsup_warm_up * self.num_train_iter), 0.0), 1.0)
        total_loss = sup_loss + self.lambda_u * unsup_loss * unsup_warmup
        self.log.append({"sup_loss": sup_loss.item(), "unsup_loss": unsup_loss.item()})
        return total_loss

    def step(self) -> None:
        self.optimizer.zero_grad()
        self.train_step(_C13_XLB, _C13_YLB, _C13_XW, _C13_XS).backward()
        self.optimizer.step()
        self.ema.update()
        self.it += 1


def _c13_build(bug: bool) -> Case:
    """Mean Teacher step whose 'strong' student logits are taken from the teacher's weak-view outputs."""
    torch.manual_seed(13)
    algo = _MeanTeacher(bug)
    return algo.model, algo.step, _kw(optimizer=algo.optimizer, inputs=(_C13_XLB, _C13_XW, _C13_XS))


def _c13_proof(bug: bool) -> bool:
    """The consistency loss compares the teacher's weak-view probabilities with themselves: it is exactly 0 on
    every step, so the unlabeled data contribute nothing."""
    torch.manual_seed(13)
    algo = _MeanTeacher(bug)
    for _ in range(3):
        algo.step()
    return all(rec["unsup_loss"] == 0.0 for rec in algo.log)

# --------------------------------------------------------------------------------------------- case-14


def _c14_cnn(width: int, n_cls: int = 5) -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(width, 2 * width, 3, padding=1), nn.BatchNorm2d(2 * width), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(0.2), nn.Linear(2 * width, n_cls))


_C14_X = torch.randn(24, 3, 8, 8, generator=_gen(1401))
_C14_Y = torch.randint(0, 5, (24,), generator=_gen(1402))
_C14_ALPHA, _C14_T = 0.9, 20.0


def _c14_loss_fn_kd(outputs: torch.Tensor, labels: torch.Tensor, teacher_outputs: torch.Tensor) -> torch.Tensor:
    t = _C14_T
    kd = nn.KLDivLoss(reduction="batchmean")(F.log_softmax(outputs / t, dim=1), F.softmax(teacher_outputs / t, dim=1))
    return kd * (_C14_ALPHA * t * t) + F.cross_entropy(outputs, labels) * (1.0 - _C14_ALPHA)


class _C14Distill:
    """Student trained against a fixed teacher over a shuffled training DataLoader."""

    def __init__(self, bug: bool) -> None:
        self.bug = bug
        torch.manual_seed(14)
        self.teacher = _c14_cnn(16).eval()
        self.student = _c14_cnn(4).train()
        self.optimizer = torch.optim.Adam(self.student.parameters(), lr=1e-3)
        ds = torch.utils.data.TensorDataset(_C14_X, _C14_Y)
        self.loader = torch.utils.data.DataLoader(ds, batch_size=8, shuffle=True, generator=_gen(1403))
        self.teacher_outputs: list[torch.Tensor] = []
        if bug:  # fetch_teacher_outputs: one pass over the (shuffled) train loader before training
            with torch.no_grad():
                self.teacher_outputs = [self.teacher(xb) for xb, _ in self.loader]
        self.it = iter(enumerate(self.loader))
        self.mismatch: list[float] = []

    def step(self) -> None:
        try:
            i, (train_batch, labels_batch) = next(self.it)
        except StopIteration:
            self.it = iter(enumerate(self.loader))
            i, (train_batch, labels_batch) = next(self.it)
        output_batch = self.student(train_batch)
        with torch.no_grad():
            own = self.teacher(train_batch)
        output_teacher_batch = self.teacher_outputs[i] if self.bug else own
        self.mismatch.append(float((output_teacher_batch - own).abs().max()))
        loss = _c14_loss_fn_kd(output_batch, labels_batch, output_teacher_batch)
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()


def _c14_build(bug: bool) -> Case:
    """KD where teacher logits are precomputed in one shuffled pass and indexed by batch number later."""
    kd = _C14Distill(bug)
    return kd.student, kd.step, _kw(optimizer=kd.optimizer, inputs=_C14_X)


def _c14_proof(bug: bool) -> bool:
    """The soft targets used for a batch are not the teacher's outputs on that batch's images (the loader
    reshuffled between the teacher pass and the training pass)."""
    kd = _C14Distill(bug)
    for _ in range(3):
        kd.step()
    return max(kd.mismatch) > 1e-4

# --------------------------------------------------------------------------------------------- case-15


class _SoftDotAttention(nn.Module):
    """Luong 'general' attention over the encoder states; optional mask of padded source positions."""

    def __init__(self, dim: int, masked: bool) -> None:
        super().__init__()
        self.masked = masked
        self.linear_in = nn.Linear(dim, dim, bias=False)
        self.linear_out = nn.Linear(dim * 2, dim, bias=False)

    def forward(self, inp: torch.Tensor, context: torch.Tensor, src_mask: torch.Tensor) -> torch.Tensor:
        target = self.linear_in(inp).unsqueeze(2)  # batch x dim x 1
        attn = torch.bmm(context, target).squeeze(2)  # batch x sourceL
        if self.masked:
            attn = attn.masked_fill(~src_mask, -float("inf"))
        attn = torch.softmax(attn, dim=1)
        weighted = torch.bmm(attn.unsqueeze(1), context).squeeze(1)
        return torch.tanh(self.linear_out(torch.cat((weighted, inp), 1)))


class _Seq2SeqAttention(nn.Module):
    """Bi-LSTM encoder over packed padded sources, LSTMCell decoder with dot attention at every step."""

    def __init__(self, masked: bool, vocab: int = 20, emb: int = 8, hid: int = 16, pad: int = 0) -> None:
        super().__init__()
        self.src_embedding = nn.Embedding(vocab, emb, pad)
        self.trg_embedding = nn.Embedding(vocab, emb, pad)
        self.encoder = nn.LSTM(emb, hid // 2, 1, bidirectional=True, batch_first=True)
        self.encoder2decoder = nn.Linear(hid, hid)
        self.decoder = nn.LSTMCell(emb, hid)
        self.attention_layer = _SoftDotAttention(hid, masked)
        self.decoder2vocab = nn.Linear(hid, vocab)

    def forward(self, input_src: torch.Tensor, input_trg: torch.Tensor, src_lengths: torch.Tensor) -> torch.Tensor:
        packed = nn.utils.rnn.pack_padded_sequence(self.src_embedding(input_src), src_lengths, batch_first=True)
        packed_h, (h_t, c_t) = self.encoder(packed)
        ctx, _ = nn.utils.rnn.pad_packed_sequence(packed_h, batch_first=True)
        src_mask = torch.arange(ctx.shape[1])[None] < src_lengths[:, None]
        h = torch.tanh(self.encoder2decoder(torch.cat((h_t[-1], h_t[-2]), 1)))
        c = torch.cat((c_t[-1], c_t[-2]), 1)
        outs = []
        for t in range(input_trg.shape[1]):
            hy, c = self.decoder(self.trg_embedding(input_trg[:, t]), (h, c))
            h = self.attention_layer(hy, ctx, src_mask)
            outs.append(h)
        return self.decoder2vocab(torch.stack(outs, 1))


def _c15_batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = _gen(1501)
    lengths = torch.tensor([7, 5, 3, 2])  # sorted, as the batching code does for pack_padded_sequence
    src = torch.zeros(4, 7, dtype=torch.long)
    for i, n in enumerate(lengths.tolist()):
        src[i, :n] = torch.randint(3, 20, (n,), generator=g)
    trg = torch.randint(3, 20, (4, 6), generator=g)
    return src, trg[:, :-1], trg[:, 1:], lengths


_C15_SRC, _C15_TRG_IN, _C15_TRG_OUT, _C15_LEN = _c15_batch()


def _c15_loss(model: _Seq2SeqAttention) -> torch.Tensor:
    logits = model(_C15_SRC, _C15_TRG_IN, _C15_LEN)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), _C15_TRG_OUT.reshape(-1), ignore_index=0)


def _c15_build(bug: bool) -> Case:
    """Attention softmax over all source positions, the zero-filled padded encoder states included."""
    torch.manual_seed(15)
    model = _Seq2SeqAttention(masked=not bug).train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    step = _sgd_step(model, opt, lambda: _c15_loss(model))
    return model, step, _kw(optimizer=opt, inputs=(_C15_SRC, _C15_TRG_IN, _C15_LEN))


def _c15_proof(bug: bool) -> bool:
    """The short sentence's predictions change with how much padding its batch adds: decoded alone (no padding)
    and decoded inside the padded batch give different logits."""
    model, _, _ = _c15_build(bug)
    model.eval()
    i, n = 3, int(_C15_LEN[3])
    with torch.no_grad():
        in_batch = model(_C15_SRC, _C15_TRG_IN, _C15_LEN)[i]
        alone = model(_C15_SRC[i:i + 1, :n], _C15_TRG_IN[i:i + 1], _C15_LEN[i:i + 1])[0]
    return float((in_batch - alone).abs().max()) > 1e-5


CASES: list[BlindCase] = [
    BlindCase("b16-case-11", "https://github.com/jinnnju/PaAno/issues/1", "masking sentinel sign / dead loss term",
              "The self-pair is masked with -inf in similarity space, which becomes +inf in distance space, so the "
              "hardest-negative max always picks it, the triplet loss is identically 0 and the projection head "
              "never trains.", _c11_build, _c11_proof),
    BlindCase("b16-case-12", "https://github.com/ifzhang/FairMOT/issues/19", "parameters missing from optimizer",
              "The learnable task-uncertainty weights and the re-ID classifier live in the loss module, which is "
              "never added to the optimizer, so they get gradients every step but never change.",
              _c12_build, _c12_proof),
    BlindCase("b16-case-13", "https://github.com/microsoft/Semi-supervised-learning/issues/102",
              "wrong tensor used in loss (copy-paste)",
              "The student's strong-view logits are overwritten by the teacher's no-grad weak-view logits, so the "
              "consistency loss is identically zero and training is purely supervised.", _c13_build, _c13_proof,
              known_miss="the consistency term reads the teacher's no-grad logits in place of the student's, so it "
                         "carries no gradient; a loss term without gradient is not attributed"),
    BlindCase("b16-case-14", "https://github.com/haitongli/knowledge-distillation-pytorch/pull/16",
              "data misalignment (shuffled loader re-iterated)",
              "Teacher logits are computed in one pass over a shuffled DataLoader and looked up by batch index in "
              "a later, reshuffled pass, so the student distills soft targets that belong to other images.",
              _c14_build, _c14_proof,
              known_miss="teacher logits misaligned by a reshuffled loader are data the step consumes correctly"),
    BlindCase("b16-case-15", "https://github.com/MaximumEntropy/Seq2Seq-PyTorch/issues/6",
              "missing attention padding mask",
              "The decoder's attention softmax also covers the padded source positions, so attention mass leaks "
              "onto padding and a sentence's translation depends on how long the other sentences in its batch are.",
              _c15_build, _c15_proof,
              known_miss="the decoder's hand-written attention softmax covers padded source positions; the batch "
                         "passes no padding mask the audit can read"),
]
