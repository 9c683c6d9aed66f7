"""Blind batch 28 (part c): silent training bugs outside language and vision, each with its fixed twin.

Collected by someone who does not write the audit's checks. Every case builds the user's setup on a tiny model in
plain PyTorch (a SAC agent, a time-series forecaster, a metric-learning embedder with a triplet miner, a DDPM-style
denoiser, a logit-matching distillation pair; nothing is downloaded) and proves the bug without the audit on real
tensors and real steps.
"""

from __future__ import annotations

import copy
import math

import torch
import torch.nn.functional as F
from torch import nn

from tests._blind import BlindCase, Case
from tests._blind_batch5 import _gen, _kw

# --------------------------------------------------------------------------------------------- case-01
# DLR-RM/stable-baselines3 issue #76 ("[Bug] Wrong target q in SAC", opened and fixed by the maintainer araffin):
# SAC's critic target was written as
#     q_backup = rewards + (1 - dones) * gamma * min(Q1', Q2')
#     q_backup = q_backup - ent_coef * next_log_prob
# so the entropy bonus of the next state is subtracted even for terminal transitions, where nothing should be
# bootstrapped: the target of a terminal step is not its reward but reward minus the log-prob of an action sampled
# in a state that does not exist. Training runs, critic loss falls, nothing warns. Fix (the maintainer's): put the
# entropy term inside the bootstrapped part,
#     target_q = min(Q1', Q2') - ent_coef * next_log_prob
#     q_backup = rewards + (1 - dones) * gamma * target_q

_C01_OBS, _C01_ACT, _C01_B = 6, 2, 8


class _C01Actor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(_C01_OBS, 32), nn.ReLU())
        self.mu = nn.Linear(32, _C01_ACT)
        self.log_std = nn.Linear(32, _C01_ACT)

    def forward(self, obs: torch.Tensor, gen: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.body(obs)
        mu, log_std = self.mu(h), self.log_std(h).clamp(-5, 2)
        std = log_std.exp()
        eps = torch.randn(mu.shape, generator=gen)
        pre = mu + std * eps
        act = torch.tanh(pre)
        log_prob = (-0.5 * eps.pow(2) - log_std - 0.5 * math.log(2 * math.pi)).sum(-1)
        log_prob = log_prob - torch.log(1 - act.pow(2) + 1e-6).sum(-1)
        return act, log_prob


def _c01_q() -> nn.Module:
    return nn.Sequential(nn.Linear(_C01_OBS + _C01_ACT, 32), nn.ReLU(), nn.Linear(32, 1))


class _C01SAC(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.actor = _C01Actor()
        self.q1, self.q2 = _c01_q(), _c01_q()
        self.q1_target, self.q2_target = copy.deepcopy(self.q1), copy.deepcopy(self.q2)
        for p in list(self.q1_target.parameters()) + list(self.q2_target.parameters()):
            p.requires_grad_(False)


def _c01_batch() -> dict[str, torch.Tensor]:
    g = _gen(2801)
    return {"obs": torch.randn(_C01_B, _C01_OBS, generator=g),
            "actions": torch.rand(_C01_B, _C01_ACT, generator=g) * 2 - 1,
            "rewards": torch.randn(_C01_B, 1, generator=g),
            "next_obs": torch.randn(_C01_B, _C01_OBS, generator=g),
            "dones": torch.tensor([[0.0], [1.0], [0.0], [0.0], [1.0], [0.0], [0.0], [1.0]])}


def _c01_backup(agent: _C01SAC, b: dict[str, torch.Tensor], bug: bool, ent_coef: float = 0.2,
                gamma: float = 0.99, seed: int = 0) -> torch.Tensor:
    with torch.no_grad():
        next_a, next_logp = agent.actor(b["next_obs"], _gen(seed))
        sa = torch.cat([b["next_obs"], next_a], -1)
        target_q = torch.min(agent.q1_target(sa), agent.q2_target(sa))
        if bug:
            q_backup = b["rewards"] + (1 - b["dones"]) * gamma * target_q
            q_backup = q_backup - ent_coef * next_logp.reshape(-1, 1)
        else:
            target_q = target_q - ent_coef * next_logp.reshape(-1, 1)
            q_backup = b["rewards"] + (1 - b["dones"]) * gamma * target_q
    return q_backup


def _c01_build(bug: bool) -> Case:
    """SB3-style SAC update: critic from the (buggy or fixed) backup, then the actor, then Polyak targets."""
    torch.manual_seed(0)
    agent = _C01SAC()
    critic_opt = torch.optim.Adam(list(agent.q1.parameters()) + list(agent.q2.parameters()), lr=3e-4)
    actor_opt = torch.optim.Adam(agent.actor.parameters(), lr=3e-4)
    batch = _c01_batch()
    tau, ent_coef = 0.005, 0.2
    calls = [0]

    def step() -> torch.Tensor:
        calls[0] += 1
        q_backup = _c01_backup(agent, batch, bug, ent_coef, seed=calls[0])
        sa = torch.cat([batch["obs"], batch["actions"]], -1)
        critic_loss = 0.5 * (F.mse_loss(agent.q1(sa), q_backup) + F.mse_loss(agent.q2(sa), q_backup))
        critic_opt.zero_grad()
        critic_loss.backward()
        critic_opt.step()

        pi, logp = agent.actor(batch["obs"], _gen(1000 + calls[0]))
        spi = torch.cat([batch["obs"], pi], -1)
        actor_loss = (ent_coef * logp.reshape(-1, 1) - torch.min(agent.q1(spi), agent.q2(spi))).mean()
        actor_opt.zero_grad()
        actor_loss.backward()
        actor_opt.step()

        with torch.no_grad():
            for net, tgt in ((agent.q1, agent.q1_target), (agent.q2, agent.q2_target)):
                for p, tp in zip(net.parameters(), tgt.parameters()):
                    tp.mul_(1 - tau).add_(tau * p)
        return critic_loss.detach()

    return agent, step, _kw(optimizer=critic_opt, inputs=batch)


def _c01_proof(bug: bool) -> bool:
    """The target of a terminal transition must be its reward exactly; under the bug it is not."""
    torch.manual_seed(0)
    agent = _C01SAC()
    b = _c01_batch()
    q_backup = _c01_backup(agent, b, bug)
    done = b["dones"].squeeze(-1) == 1
    gap = (q_backup[done] - b["rewards"][done]).abs().max().item()
    return gap > 1e-4


# --------------------------------------------------------------------------------------------- case-02
# shiyu-coder/Kronos issue #228 (fix PR #234, "Fix data leakage in normalization window"; the maintainer confirmed:
# mean and std should be computed from the lookback window only): the fine-tuning dataset cuts a window of
# lookback + predict + 1 rows and z-normalises it with the mean and std of the WHOLE window, history and future
# together, then trains the autoregressive model on it. Every input value of the history is thus scaled by statistics
# of the future it is asked to predict: the future leaks into the inputs, the training loss is better than anything
# reachable at inference (where the future is unknown). Nothing errors or warns. Fix: compute mean/std over the
# lookback part of the window only, and apply them to the whole window.

_C02_FEAT, _C02_LOOK, _C02_PRED = 4, 11, 4


def _c02_series() -> torch.Tensor:
    g = _gen(2802)
    t = torch.arange(64, dtype=torch.float32).unsqueeze(-1)
    trend = 0.05 * t * torch.tensor([1.0, -0.5, 0.3, 2.0])
    return torch.sin(t / 5.0) + trend + 0.1 * torch.randn(64, _C02_FEAT, generator=g)


def _c02_item(series: torch.Tensor, start: int, bug: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The dataset's __getitem__: a window, instance-normalised, split into inputs and next-step targets."""
    win = series[start:start + _C02_LOOK + _C02_PRED + 1]
    stats = win if bug else win[:_C02_LOOK]
    mean, std = stats.mean(0), stats.std(0, unbiased=False)
    x = (win - mean) / (std + 1e-5)
    x = x.clamp(-5, 5)
    return x[:-1], x[1:]


class _C02Forecaster(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.GRU(_C02_FEAT, 32, batch_first=True)
        self.head = nn.Linear(32, _C02_FEAT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, _ = self.rnn(x)
        return self.head(h)


def _c02_build(bug: bool) -> Case:
    torch.manual_seed(0)
    model = _C02Forecaster().train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    series = _c02_series()
    items = [_c02_item(series, s, bug) for s in (0, 5, 10, 15, 20, 25, 30, 35)]
    x = torch.stack([i[0] for i in items])
    y = torch.stack([i[1] for i in items])

    def step() -> torch.Tensor:
        pred = model(x)
        loss = F.mse_loss(pred, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss.detach()

    return model, step, _kw(optimizer=opt, inputs={"x": x, "y": y})


def _c02_proof(bug: bool) -> bool:
    """Change only the future part of a window: does the normalised history the model reads change with it?"""
    series = _c02_series()
    x_a, _ = _c02_item(series, 8, bug)
    altered = series.clone()
    altered[8 + _C02_LOOK:8 + _C02_LOOK + _C02_PRED + 1] += 3.0
    x_b, _ = _c02_item(altered, 8, bug)
    history_shift = (x_a[:_C02_LOOK] - x_b[:_C02_LOOK]).abs().max().item()
    return history_shift > 1e-4


# --------------------------------------------------------------------------------------------- case-03
# WildlifeDatasets/wildlife-tools issue #24 ("Typo in TripletLoss, resulting in incorrect 'semihard' mining";
# the maintainer: "Good catch! Thank you for reporting."): the library's TripletLoss defaults to
# mining="seminard" and hands it to pytorch-metric-learning's TripletMarginMiner as type_of_triplets. The miner only
# compares the string against "easy", "hard" and "semihard", so the misspelt value falls through silently to mining
# every triplet inside the margin (hard negatives included), not the semi-hard triplets the user asked for. Training
# runs, the triplet loss falls. Fix: mining="semihard". The miner and loss below follow pytorch-metric-learning's
# TripletMarginMiner / TripletMarginLoss (Euclidean distance, mean over non-zero triplet losses).


def _c03_all_triplets(labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    same = labels.unsqueeze(0) == labels.unsqueeze(1)
    pos = same & ~torch.eye(len(labels), dtype=torch.bool)
    neg = ~same
    trip = pos.unsqueeze(2) & neg.unsqueeze(1)
    a, p, n = torch.where(trip)
    return a, p, n


class _C03TripletMarginMiner:
    def __init__(self, margin: float, type_of_triplets: str) -> None:
        self.margin, self.type_of_triplets = margin, type_of_triplets

    def __call__(self, emb: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, ...]:
        with torch.no_grad():
            a, p, n = _c03_all_triplets(labels)
            mat = torch.cdist(emb, emb)
            ap, an = mat[a, p], mat[a, n]
            triplet_margin = an - ap
            if self.type_of_triplets == "easy":
                cond = triplet_margin > self.margin
            else:
                cond = triplet_margin <= self.margin
                if self.type_of_triplets == "hard":
                    cond &= triplet_margin <= 0
                elif self.type_of_triplets == "semihard":
                    cond &= triplet_margin > 0
        return a[cond], p[cond], n[cond]


class _C03TripletLoss(nn.Module):
    """wildlife-tools' TripletLoss: a TripletMarginMiner feeding a TripletMarginLoss."""

    def __init__(self, margin: float = 0.2, mining: str = "seminard") -> None:
        super().__init__()
        self.margin = margin
        self.miner = _C03TripletMarginMiner(margin, mining)

    def forward(self, emb: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        a, p, n = self.miner(emb, labels)
        if len(a) == 0:
            return emb.sum() * 0
        mat = torch.cdist(emb, emb)
        losses = F.relu(mat[a, p] - mat[a, n] + self.margin)
        nz = losses > 0
        return losses[nz].mean() if nz.any() else losses.sum() * 0


def _c03_data() -> tuple[torch.Tensor, torch.Tensor]:
    g = _gen(2803)
    labels = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
    centers = torch.randn(4, 16, generator=g) * 0.6
    x = centers[labels] + torch.randn(8, 16, generator=g)
    return x, labels


def _c03_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))


def _c03_build(bug: bool) -> Case:
    model = _c03_model().train()
    criterion = _C03TripletLoss(margin=0.2) if bug else _C03TripletLoss(margin=0.2, mining="semihard")
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x, labels = _c03_data()

    def step() -> torch.Tensor:
        emb = model(x)
        loss = criterion(emb, labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss.detach()

    return model, step, _kw(optimizer=opt, inputs={"x": x, "labels": labels})


def _c03_proof(bug: bool) -> bool:
    """Does the "semi-hard" miner hand the loss hard triplets (negative nearer than the positive)?"""
    model = _c03_model()
    criterion = _C03TripletLoss(margin=0.2) if bug else _C03TripletLoss(margin=0.2, mining="semihard")
    x, labels = _c03_data()
    with torch.no_grad():
        emb = model(x)
        a, p, n = criterion.miner(emb, labels)
        all_a, all_p, all_n = _c03_all_triplets(labels)
        mat = torch.cdist(emb, emb)
        hard_exists = bool((mat[all_a, all_n] < mat[all_a, all_p]).any())
        mined_hard = int((mat[a, n] < mat[a, p]).sum())
    assert hard_exists, "the batch must hold hard triplets for the proof to mean anything"
    return mined_hard > 0


# --------------------------------------------------------------------------------------------- case-04
# Ryota-Kawamura/How-Diffusion-Models-Work issue #1 (the DeepLearning.AI "How Diffusion Models Work" course code,
# L2_Training.ipynb): the forward noising used for training is
#     perturb_input(x, t, noise) = ab_t[t].sqrt() * x + (1 - ab_t[t]) * noise
# while DDPM's q(x_t | x_0) (and the course's own sampler, which removes sqrt(1 - ab_t) * eps_pred) needs
# sqrt(1 - ab_t) * noise. The network is trained to predict noise at the wrong noise level for every t, so the model
# the sampler uses is not the model it assumes; the MSE loss still falls nicely. Fix (from the issue, per the paper):
# (1 - ab_t[t]).sqrt() * noise.

_C04_T = 500


def _c04_schedule() -> torch.Tensor:
    beta1, beta2 = 1e-4, 0.02
    b_t = (beta2 - beta1) * torch.linspace(0, 1, _C04_T + 1) + beta1
    a_t = 1 - b_t
    ab_t = torch.cumsum(a_t.log(), dim=0).exp()
    ab_t[0] = 1
    return ab_t


def _c04_perturb(x: torch.Tensor, t: torch.Tensor, noise: torch.Tensor, ab_t: torch.Tensor, bug: bool) -> torch.Tensor:
    ab = ab_t[t, None, None, None]
    if bug:
        return ab.sqrt() * x + (1 - ab) * noise
    return ab.sqrt() * x + (1 - ab).sqrt() * noise


class _C04Denoiser(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Conv2d(1, 16, 3, padding=1)
        self.temb = nn.Linear(1, 16)
        self.mid = nn.Conv2d(16, 16, 3, padding=1)
        self.out = nn.Conv2d(16, 1, 3, padding=1)

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.inp(x)) + self.temb(t.view(-1, 1)).view(-1, 16, 1, 1)
        h = F.gelu(self.mid(h))
        return self.out(h)


def _c04_images() -> torch.Tensor:
    g = _gen(2804)
    return (torch.rand(8, 1, 8, 8, generator=g) * 2 - 1)


def _c04_build(bug: bool) -> Case:
    torch.manual_seed(0)
    model = _C04Denoiser().train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    ab_t = _c04_schedule()
    x = _c04_images()
    g = _gen(14)

    def step() -> torch.Tensor:
        noise = torch.randn(x.shape, generator=g)
        t = torch.randint(1, _C04_T + 1, (x.shape[0],), generator=g)
        x_pert = _c04_perturb(x, t, noise, ab_t, bug)
        pred_noise = model(x_pert, t / _C04_T)
        loss = F.mse_loss(pred_noise, noise)
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss.detach()

    return model, step, _kw(optimizer=opt, inputs=x)


def _c04_proof(bug: bool) -> bool:
    """Noise images, then undo it with the true noise the way the sampler does: is x_0 recovered?"""
    ab_t = _c04_schedule()
    x = _c04_images()
    noise = torch.randn(x.shape, generator=_gen(40))
    t = torch.full((x.shape[0],), 250)
    x_t = _c04_perturb(x, t, noise, ab_t, bug)
    ab = ab_t[t, None, None, None]
    x0_hat = (x_t - (1 - ab).sqrt() * noise) / ab.sqrt()
    return (x0_hat - x).abs().max().item() > 1e-3


# --------------------------------------------------------------------------------------------- case-05
# vrvlive/knowlege-distillation issue #2 ("teacher.eval() when performing distillation"): DistilledTrainingModule
# holds the pretrained teacher as a child module, sets requires_grad=False on its parameters and matches the
# student's logits to the teacher's with MSE in training_step. Nothing ever puts the teacher in eval mode, and the
# framework's train() switches every child to train mode, so the teacher's dropout is active (its targets are noisy
# and change from call to call) and its BatchNorm keeps overwriting its running statistics with the student's
# training batches: the frozen teacher drifts although none of its parameters gets a gradient. Fix asked in the
# issue: call eval() on the teacher (here: keep it in eval mode after every train() switch).


class _C05Net(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(),
                                      nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.drop = nn.Dropout(0.3)
        self.fc = nn.Linear(width, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.drop(self.features(x)))


class _C05Distilled(nn.Module):
    def __init__(self, fix: bool) -> None:
        super().__init__()
        self.fix = fix
        torch.manual_seed(0)
        self._model = _C05Net(8)
        self._teacher_model = _C05Net(16)
        with torch.no_grad():  # a "pretrained" teacher: non-trivial running statistics
            self._teacher_model.features[1].running_mean.uniform_(-0.5, 0.5, generator=_gen(55))
            self._teacher_model.features[1].running_var.uniform_(0.5, 1.5, generator=_gen(56))
        for p in self._teacher_model.parameters():
            p.requires_grad = False
        self._mse_loss = nn.MSELoss()

    def train(self, mode: bool = True) -> _C05Distilled:
        super().train(mode)
        if self.fix:
            self._teacher_model.eval()
        return self

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self._model(images)

    def training_step(self, images: torch.Tensor) -> torch.Tensor:
        y_hat_student = self.forward(images)
        y_hat_teacher = self._teacher_model.forward(images)
        return self._mse_loss(y_hat_student, y_hat_teacher)


def _c05_images() -> torch.Tensor:
    return torch.randn(8, 3, 8, 8, generator=_gen(2805)) * 2 + 1


def _c05_build(bug: bool) -> Case:
    module = _C05Distilled(fix=not bug)
    module.train()
    opt = torch.optim.SGD(module._model.parameters(), lr=0.01, momentum=0.9)
    images = _c05_images()

    def step() -> torch.Tensor:
        loss = module.training_step(images)
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss.detach()

    return module, step, _kw(optimizer=opt, inputs=images)


def _c05_proof(bug: bool) -> bool:
    """Train two steps: does the frozen teacher's BatchNorm state move, or its target change between calls?"""
    torch.manual_seed(0)
    module, step, _ = _c05_build(bug)
    bn = module._teacher_model.features[1]
    before = bn.running_mean.clone()
    images = _c05_images()
    with torch.no_grad():
        t1 = module._teacher_model(images)
        t2 = module._teacher_model(images)
    step()
    step()
    moved = (bn.running_mean - before).abs().max().item() > 1e-6
    noisy = (t1 - t2).abs().max().item() > 1e-6
    return moved or noisy


CASES: list[BlindCase] = [
    BlindCase("b28c-01", "https://github.com/DLR-RM/stable-baselines3/issues/76", "terminal mask in TD target",
              "SAC's entropy bonus of the next state is subtracted outside the (1 - done) mask, so terminal "
              "transitions bootstrap a log-prob from a state that does not exist.", _c01_build, _c01_proof,
              known_miss="the terminal mask misapplied in the TD target: arithmetic of the target, whose gradient has the usual shape"),
    BlindCase("b28c-02", "https://github.com/shiyu-coder/Kronos/issues/228", "future leakage via normalisation",
              "Each training window is z-normalised with statistics of history and future together, so the inputs "
              "carry information about the values the model is trained to predict.", _c02_build, _c02_proof,
              known_miss="normalisation statistics taken over the future window: which time steps a statistic may read is not known to the step"),
    BlindCase("b28c-03", "https://github.com/WildlifeDatasets/wildlife-tools/issues/24",
              "misspelt option silently ignored",
              "The triplet loss's default mining mode 'seminard' matches no miner branch, so every triplet inside the "
              "margin, hard negatives included, is mined instead of the semi-hard ones.", _c03_build, _c03_proof,
              known_miss="a misspelt option silently ignored by a miner: which hyper-parameters a call honours is not judged"),
    BlindCase("b28c-04", "https://github.com/Ryota-Kawamura/How-Diffusion-Models-Work/issues/1",
              "wrong diffusion noising coefficient",
              "Training noises x_0 with (1 - alpha_bar) * eps instead of sqrt(1 - alpha_bar) * eps, so the denoiser "
              "learns noise levels the sampler does not assume.", _c04_build, _c04_proof,
              known_miss="a wrong noise coefficient in the diffusion forward process: arithmetic of the target inside the loss"),
    BlindCase("b28c-05", "https://github.com/vrvlive/knowlege-distillation/issues/2", "frozen teacher left in train mode",
              "The distillation teacher is frozen by requires_grad only and stays in train mode, so dropout noises its "
              "targets and its BatchNorm statistics drift on the student's batches.", _c05_build, _c05_proof),
]
