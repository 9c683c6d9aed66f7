"""Blind batch 17 (part b): silent training bugs from public threads, each with its fixed twin."""

from __future__ import annotations

import math
import warnings

import torch
import torch.nn.functional as F
from torch import nn

from tests._blind import BlindCase, Case
from tests._blind_batch5 import _gen, _kw, _sgd_step

# --------------------------------------------------------------------------------------------- case-06


class _TinyEffNet(nn.Module):
    """An EfficientNet-shaped classifier: ``features`` then ``classifier = Sequential(Dropout, Linear)``."""

    def __init__(self, n_pretrained_cls: int = 10) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, 3, stride=2, padding=1), nn.BatchNorm2d(8), nn.SiLU(),
            nn.Conv2d(8, 16, 3, stride=2, padding=1), nn.BatchNorm2d(16), nn.SiLU(),
        )
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Sequential(nn.Dropout(p=0.2, inplace=True), nn.Linear(16, n_pretrained_cls))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.avgpool(self.features(x)), 1))


_C06_X = torch.randn(8, 3, 16, 16, generator=_gen(1601))
_C06_Y = torch.randint(0, 3, (8,), generator=_gen(1602))


def _c06_build(bug: bool) -> Case:
    """Transfer learning to 3 classes: the head is 'resized' by setting ``out_features`` on the pretrained Linear."""
    torch.manual_seed(16)
    model = _TinyEffNet()  # stands in for the pretrained 1000-class network
    for p in model.features.parameters():
        p.requires_grad = False
    if bug:
        model.classifier[1].out_features = 3  # only the attribute changes; the weight stays (10, 16)
    else:
        model.classifier = nn.Sequential(nn.Dropout(p=0.2, inplace=True), nn.Linear(16, 3))
    model.train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    step = _sgd_step(model, opt, lambda: F.cross_entropy(model(_C06_X), _C06_Y))
    return model, step, _kw(optimizer=opt, inputs=_C06_X)


def _c06_proof(bug: bool) -> bool:
    """The model prints ``out_features=3`` but still emits one logit per pretrained class (10, not 3)."""
    model, step, _ = _c06_build(bug)
    step()
    model.eval()
    with torch.no_grad():
        logits = model(_C06_X)
    head = model.classifier[1]
    return logits.shape[1] != head.out_features or head.weight.shape[0] != 3


# --------------------------------------------------------------------------------------------- case-07


class _BasicBlock(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + x)


class _TinyResNet(nn.Module):
    """ResNet trunk whose forward ends ``avgpool -> flatten -> dropout -> fc`` as the repository's resnet.py."""

    def __init__(self, dropout_in_forward: bool, n_cls: int = 5) -> None:
        super().__init__()
        self.dropout_in_forward = dropout_in_forward
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(8)
        self.layer1 = _BasicBlock(8)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        if not dropout_in_forward:
            self.dropout = nn.Dropout(p=0.5)
        self.fc = nn.Linear(8, n_cls)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layer1(F.relu(self.bn1(self.conv1(x))))
        x = torch.flatten(self.avgpool(x), 1)
        if self.dropout_in_forward:
            x = nn.Dropout(p=0.5)(x)  # a fresh module, always in training mode: net.eval() never reaches it
        else:
            x = self.dropout(x)
        return self.fc(x)


_C07_X = torch.randn(6, 3, 12, 12, generator=_gen(1701))
_C07_Y = torch.randint(0, 5, (6,), generator=_gen(1702))


def _c07_build(bug: bool) -> Case:
    """Fine-grained classifier with dropout before the fc layer, created inside forward()."""
    torch.manual_seed(17)
    model = _TinyResNet(dropout_in_forward=bug).train()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9, weight_decay=1e-4)
    step = _sgd_step(model, opt, lambda: F.cross_entropy(model(_C07_X), _C07_Y))
    return model, step, _kw(optimizer=opt, inputs=_C07_X)


def _c07_proof(bug: bool) -> bool:
    """After training and net.eval(), the same test batch gives different predictions on two passes."""
    model, step, _ = _c07_build(bug)
    for _ in range(2):
        step()
    model.eval()
    torch.manual_seed(170)
    with torch.no_grad():
        a = model(_C07_X)
        b = model(_C07_X)
    return float((a - b).abs().max()) > 1e-6


# --------------------------------------------------------------------------------------------- case-08


class _RandomFlipRotate:
    """Random horizontal flip then random rotation, re-sampling its parameters on every call (as torchvision's)."""

    def __init__(self, degrees: float = 30.0, p: float = 0.5) -> None:
        self.degrees = degrees
        self.p = p

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # x: (C, H, W)
        if float(torch.rand(1)) < self.p:
            x = x.flip(-1)
        angle = math.radians(float(torch.empty(1).uniform_(-self.degrees, self.degrees)))
        cos, sin = math.cos(angle), math.sin(angle)
        theta = torch.tensor([[cos, -sin, 0.0], [sin, cos, 0.0]])[None]
        grid = F.affine_grid(theta, [1, *x.shape], align_corners=False)
        return F.grid_sample(x[None], grid, mode="nearest", padding_mode="zeros", align_corners=False)[0]


class _MassSegDataset(torch.utils.data.Dataset):
    """Mammogram-like images with a bright mass and its binary mask; the mask is the thresholded image."""

    def __init__(self, joint: bool, n: int = 8, size: int = 16) -> None:
        g = _gen(1801)
        yy, xx = torch.meshgrid(torch.arange(size), torch.arange(size), indexing="ij")
        imgs, masks = [], []
        for _ in range(n):
            cy, cx = torch.randint(3, size // 2, (2,), generator=g).tolist()  # masses sit off-centre
            r = 2 + int(torch.randint(0, 3, (1,), generator=g))
            m = (((yy - cy) ** 2 + (xx - cx) ** 2) <= r * r).float()
            imgs.append(0.2 * torch.rand(size, size, generator=g) + 0.7 * m)
            masks.append(m)
        self.images = torch.stack(imgs)[:, None]
        self.masks = torch.stack(masks)[:, None]
        self.transform = _RandomFlipRotate()
        self.joint = joint

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        image, mass_mask = self.images[i], self.masks[i]
        if self.joint:
            combined = self.transform(torch.cat([image, mass_mask], dim=0))
            image, mass_mask = combined[0:1], combined[1:2]
        else:
            image = self.transform(image)
            mass_mask = self.transform(mass_mask)
        return image, mass_mask


class _TinySegNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.mid = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.ReLU())
        self.out = nn.Conv2d(16, 1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        e = self.enc(x)
        return self.out(torch.cat([e, self.mid(e)], 1))


def _c08_build(bug: bool) -> Case:
    """U-Net-style mass segmentation; augmentation applied by calling the random transform on image and mask."""
    torch.manual_seed(18)
    ds = _MassSegDataset(joint=not bug)
    loader = torch.utils.data.DataLoader(ds, batch_size=4, shuffle=True)
    model = _TinySegNet().train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    it = iter(loader)
    first_x, _ = ds[0]

    def step() -> torch.Tensor:
        nonlocal it
        try:
            x, y = next(it)
        except StopIteration:
            it = iter(loader)
            x, y = next(it)
        opt.zero_grad()
        loss = F.binary_cross_entropy_with_logits(model(x), y)
        loss.backward()
        opt.step()
        return loss

    model.dataset = ds  # type: ignore[assignment]  # kept for the proof
    return model, step, _kw(optimizer=opt, inputs=first_x[None])


def _c08_proof(bug: bool) -> bool:
    """In the augmented pairs the loader yields, the mask no longer covers the mass that is in the image."""
    torch.manual_seed(180)
    ds = _MassSegDataset(joint=not bug)
    wrong = 0.0
    for i in range(len(ds)):
        image, mask = ds[i]
        wrong = max(wrong, float(((image > 0.5).float() != mask).float().mean()))
    return wrong > 0.01


# --------------------------------------------------------------------------------------------- case-09


class _ActorCritic(nn.Module):
    def __init__(self, obs: int = 4, n_act: int = 2, h: int = 16) -> None:
        super().__init__()
        self.actor = nn.Sequential(nn.Linear(obs, h), nn.Tanh(), nn.Linear(h, n_act))
        self.critic = nn.Sequential(nn.Linear(obs, h), nn.Tanh(), nn.Linear(h, 1))


_C09_STATES = torch.randn(12, 4, generator=_gen(1901))
_C09_GAMMA = 0.99


def _c09_rollout_loss(model: _ActorCritic, bug: bool) -> torch.Tensor:
    """One episode: sample actions, reward action 0 on positive first feature, then the actor-critic loss."""
    log_probs, values, rewards = [], [], []
    for s in _C09_STATES:
        dist = torch.distributions.Categorical(logits=model.actor(s))
        a = dist.sample()
        log_probs.append(dist.log_prob(a))
        values.append(model.critic(s).squeeze(-1))
        rewards.append(1.0 if int(a) == int(s[0] > 0) else 0.0)
    rets, g = [], 0.0
    for r in reversed(rewards):
        g = r + _C09_GAMMA * g
        rets.insert(0, g)
    returns = torch.tensor(rets)
    if bug:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            log_probs_t = torch.tensor(log_probs)  # a brand-new tensor: cut from the graph
    else:
        log_probs_t = torch.stack(log_probs)
    values_t = torch.stack(values)
    advantage = returns - values_t.detach()
    policy_loss = -(log_probs_t * advantage).mean()
    value_loss = F.mse_loss(values_t, returns)
    return policy_loss + 0.5 * value_loss


def _c09_build(bug: bool) -> Case:
    """Actor-critic where the per-step log-probs are gathered into one tensor for the policy loss."""
    torch.manual_seed(19)
    model = _ActorCritic().train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    step = _sgd_step(model, opt, lambda: _c09_rollout_loss(model, bug))
    return model, step, _kw(optimizer=opt, inputs=_C09_STATES)


def _c09_proof(bug: bool) -> bool:
    """After a training step the actor has received no gradient at all and its weights did not move."""
    model, step, _ = _c09_build(bug)
    before = [p.detach().clone() for p in model.actor.parameters()]
    step()
    grads = [p.grad for p in model.actor.parameters()]
    no_grad = all(g is None or float(g.abs().sum()) == 0.0 for g in grads)
    unmoved = all(torch.equal(b, p) for b, p in zip(before, model.actor.parameters()))
    return no_grad and unmoved


# --------------------------------------------------------------------------------------------- case-10


class _QuestionerBot(nn.Module):
    """Question decoder (policy over tokens) plus an image-feature regression head, as in a visual-dialog Q-bot."""

    def __init__(self, d: int = 12, vocab: int = 10, feat: int = 6) -> None:
        super().__init__()
        self.state = nn.Linear(feat, d)
        self.decoder = nn.GRUCell(vocab, d)
        self.word = nn.Linear(d, vocab)
        self.feat_net = nn.Linear(d, feat)  # regresses the image feature from the dialog state
        self.vocab = vocab


_C10_IMG = torch.randn(4, 6, generator=_gen(2001))
_C10_CAP = torch.randn(4, 6, generator=_gen(2002))
_C10_T = 5


def _c10_losses(model: _QuestionerBot, bug: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample a question; reward = improvement of the feature regression; REINFORCE + feature loss."""
    h = torch.tanh(model.state(_C10_CAP))
    prev_err = ((model.feat_net(h) - _C10_IMG) ** 2).sum(1)
    tok = torch.zeros(h.shape[0], model.vocab)
    rl_loss = torch.zeros(())
    feat_loss = torch.zeros(())
    for _ in range(_C10_T):
        h = model.decoder(tok, h)
        dist = torch.distributions.Categorical(logits=model.word(h))
        w = dist.sample()
        tok = F.one_hot(w, model.vocab).float()
        err = ((model.feat_net(h) - _C10_IMG) ** 2).sum(1)
        reward = prev_err - err
        feat_loss = feat_loss + err.mean()
        if bug:
            rl_loss = rl_loss + (-1 * dist.log_prob(w) * reward).mean()
        else:
            rl_loss = rl_loss + (-1 * dist.log_prob(w) * reward.detach()).mean()
        prev_err = err
    return rl_loss, feat_loss


def _c10_build(bug: bool) -> Case:
    """RL fine-tuning of a question bot whose REINFORCE term uses a reward computed from its own regression."""
    torch.manual_seed(20)
    model = _QuestionerBot().train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)

    def loss_fn() -> torch.Tensor:
        rl, feat = _c10_losses(model, bug)
        return rl + feat

    step = _sgd_step(model, opt, loss_fn)
    return model, step, _kw(optimizer=opt, inputs=(_C10_CAP, _C10_IMG))


def _c10_proof(bug: bool) -> bool:
    """The REINFORCE term alone sends a gradient into the feature-regression head (it should send none)."""
    model, _, _ = _c10_build(bug)
    torch.manual_seed(200)
    rl, _ = _c10_losses(model, bug)
    g = torch.autograd.grad(rl, model.feat_net.weight, allow_unused=True)[0]
    return g is not None and float(g.abs().sum()) > 0.0


CASES: list[BlindCase] = [
    BlindCase("b17-case-06",
              "https://discuss.pytorch.org/t/transfer-learning-reduced-performance-when-updating-out-features-directly/170534",
              "classifier head not resized",
              "Setting out_features on the pretrained Linear leaves its weight at the old class count, so the "
              "model keeps emitting logits for every pretrained class and trains far worse.",
              _c06_build, _c06_proof,
              known_miss="the head keeps its old class count after out_features is reassigned; the audit does "
                         "not compare the output's classes with the classes the targets use",
              known_alarm=('MODE-003',)),
    BlindCase("b17-case-07", "https://github.com/yangze0930/NTS-Net/issues/14",
              "dropout active at eval",
              "A Dropout module built inside forward() is never switched by net.eval(), so test predictions stay "
              "randomly dropped and differ from run to run.",
              _c07_build, _c07_proof),
    BlindCase("b17-case-08", "https://php.bkmy88.com/faq/2068558.html",
              "unpaired image/mask augmentation",
              "Calling the random transform separately on image and mask samples different flips and angles, so "
              "the masks the model learns from no longer line up with the masses in the images.",
              _c08_build, _c08_proof,
              known_miss="the augmentation that misaligns image and mask runs in the dataset, before the step"),
    BlindCase("b17-case-09", "https://github.com/kengz/SLM-Lab/pull/133",
              "policy loss cut from graph",
              "torch.tensor() over the collected log-probs builds a new tensor without history, so the policy "
              "loss trains nothing and only the critic learns.",
              _c09_build, _c09_proof),
    BlindCase("b17-case-10", "https://github.com/batra-mlp-lab/visdial-rl/issues/13",
              "reward not detached",
              "The REINFORCE reward is computed from the model's own feature regression and not detached, so "
              "the policy loss pushes a spurious log-prob-scaled gradient into the regression head.",
              _c10_build, _c10_proof),
]
