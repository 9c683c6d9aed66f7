"""Blind batch 25 (part c): silent training bugs outside LLMs and vision, each with its fixed twin.

Collected by someone who does not write the audit's checks. Reinforcement learning (a double-DQN agent, a batch
A2C loss), knowledge distillation, a factorization-machine rating predictor and a cyclically annealed VAE, each
from a public GitHub thread, rebuilt on tiny plain-PyTorch models and proven without the audit on real tensors and
real steps.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from tests._blind import BlindCase, Case
from tests._blind_batch5 import _gen, _kw

# --------------------------------------------------------------------------------------------- case-01
# shakedzy/tic_tac_toe issue #1: a double-DQN tic-tac-toe agent (`QPlayer.learn`) trains its Q-network once every
# `learning_batch_size` calls of learn() (`self.learn_counter % learning_batch_size == 0`) and was meant to copy the
# Q-network into the Q-target every `batches_to_q_target_switch` trainings. The copy was gated on
# `self.memory.counter % (batches_to_q_target_switch * learning_batch_size) == 0`, and the memory counter runs one
# ahead of the learn counter, so on every training call it is 1 modulo the batch size and the copy never happens:
# the Bellman targets come from the randomly initialised target network for the whole run. The loss still goes
# down (the Q-network fits a fixed random target), nothing errors. The maintainer confirmed and fixed it by testing
# `self.learn_counter` instead.


class _QNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(9, 32), nn.ReLU(), nn.Linear(32, 9))

    def forward(self, board: torch.Tensor) -> torch.Tensor:
        return self.net(board)


_C01_BATCH = 4          # learning_batch_size
_C01_SWITCH = 2         # batches_to_q_target_switch
_C01_POOL = torch.randint(-1, 2, (64, 9), generator=_gen(2501)).float()
_C01_NEXT = torch.randint(-1, 2, (64, 9), generator=_gen(2502)).float()
_C01_ACT = torch.randint(0, 9, (64,), generator=_gen(2503))
_C01_REW = torch.randint(-1, 2, (64,), generator=_gen(2504)).float()
_C01_DONE = torch.rand(64, generator=_gen(2505)) < 0.2


class _C01Player:
    """The QPlayer of the thread, in PyTorch: replay memory, a learning Q-network and a (soft-copied) Q-target."""

    def __init__(self, bug: bool) -> None:
        torch.manual_seed(0)
        self.bug = bug
        self.qnn = _QNet()
        self.q_target = _QNet()
        self.opt = torch.optim.SGD(self.qnn.parameters(), lr=0.05)
        self.gamma, self.tau = 0.95, 1.0
        self.memory: list[int] = []
        self.memory_counter = 0
        self.learn_counter = 0
        self.copies = 0
        self.add_to_memory()  # the game's first observation is stored before the first learn() call

    def add_to_memory(self) -> None:
        self.memory.append(self.memory_counter % 64)
        self.memory_counter += 1

    def learn(self) -> torch.Tensor | None:
        self.learn_counter += 1
        if self.learn_counter % _C01_BATCH != 0 or self.memory_counter < _C01_BATCH:
            return None
        idx = torch.tensor(self.memory[-_C01_BATCH:])
        s, a, r, s2, done = _C01_POOL[idx], _C01_ACT[idx], _C01_REW[idx], _C01_NEXT[idx], _C01_DONE[idx]
        with torch.no_grad():
            next_q = self.q_target(s2)
            best = self.qnn(s2).argmax(dim=1)  # double DQN: online net picks, target net scores
            target = r + self.gamma * next_q.gather(1, best[:, None]).squeeze(1) * (~done).float()
        q = self.qnn(s).gather(1, a[:, None]).squeeze(1)
        cost = F.mse_loss(q, target)
        self.opt.zero_grad()
        cost.backward()
        self.opt.step()
        counter = self.memory_counter if self.bug else self.learn_counter
        if counter % (_C01_SWITCH * _C01_BATCH) == 0:
            with torch.no_grad():
                for t, p in zip(self.q_target.parameters(), self.qnn.parameters()):
                    t.copy_(p * self.tau + (1 - self.tau) * t)
            self.copies += 1
        return cost

    def play_until_learned(self) -> torch.Tensor:
        """Game moves (store the transition, call learn()) until one learning procedure has run."""
        while True:
            self.add_to_memory()
            cost = self.learn()
            if cost is not None:
                return cost


class _C01Agent(nn.Module):
    def __init__(self, player: _C01Player) -> None:
        super().__init__()
        self.qnn = player.qnn
        self.q_target = player.q_target


def _c01_build(bug: bool) -> Case:
    """Double-DQN tic-tac-toe agent; one step = the game moves up to and including one training of the Q-network."""
    player = _C01Player(bug)
    model = _C01Agent(player).train()
    return model, player.play_until_learned, _kw(optimizer=player.opt, inputs=_C01_POOL[:_C01_BATCH])


def _c01_proof(bug: bool) -> bool:
    """After 6 trainings (3 scheduled copies) the Q-target still holds its initial random weights."""
    player = _C01Player(bug)
    init = copy.deepcopy(player.q_target.state_dict())
    for _ in range(3 * _C01_SWITCH):
        player.play_until_learned()
    return player.copies == 0 and all(torch.equal(init[k], v) for k, v in player.q_target.state_dict().items())


# --------------------------------------------------------------------------------------------- case-02
# google-deepmind/open_spiel issue #962: `BatchA2CLoss` (open_spiel/python/{algorithms,pytorch}/losses/rl_losses.py)
# adds the entropy regulariser to the policy loss, `total_loss = total_loss + entropy_cost * mean(entropy)`, while
# `compute_entropy` returns the (positive) entropy -sum(p log p). Minimising the loss therefore *minimises* the
# policy entropy: the "exploration bonus" pushes the policy to collapse early. Training runs and the policy loss
# looks normal. A maintainer confirmed it ("This is indeed a bug") and the fix subtracts the entropy term
# (equivalently, compute the negative entropy) so that the minimised loss maximises entropy.


class _ActorCritic(nn.Module):
    def __init__(self, obs: int = 6, n_act: int = 4, hidden: int = 32) -> None:
        super().__init__()
        self.torso = nn.Sequential(nn.Linear(obs, hidden), nn.Tanh())
        self.pi = nn.Linear(hidden, n_act)
        self.v = nn.Linear(hidden, 1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.torso(x)
        return self.pi(h), self.v(h).squeeze(-1)


def _c02_entropy(policy_logits: torch.Tensor) -> torch.Tensor:
    return torch.sum(-F.softmax(policy_logits, dim=1) * F.log_softmax(policy_logits, dim=1), dim=-1)


class _BatchA2CLoss:
    """open_spiel's batch A2C policy loss; ``fixed`` applies the thread's sign fix to the entropy term."""

    def __init__(self, entropy_cost: float, fixed: bool) -> None:
        self._entropy_cost = entropy_cost
        self._fixed = fixed

    def loss(self, policy_logits: torch.Tensor, baseline: torch.Tensor, actions: torch.Tensor,
             returns: torch.Tensor) -> torch.Tensor:
        advantages = (returns - baseline).detach()
        cross_entropy = F.cross_entropy(policy_logits, actions, reduction="none")
        total_loss = torch.mean(cross_entropy * advantages, dim=0)
        if self._entropy_cost:
            entropy_loss = float(self._entropy_cost) * torch.mean(_c02_entropy(policy_logits))
            total_loss = total_loss - entropy_loss if self._fixed else total_loss + entropy_loss
        return total_loss


_C02_OBS = torch.randn(8, 6, generator=_gen(2511))
_C02_ACT = torch.randint(0, 4, (8,), generator=_gen(2512))
_C02_RET = torch.randn(8, generator=_gen(2513))


def _c02_setup(bug: bool, entropy_cost: float) -> tuple[_ActorCritic, torch.optim.Optimizer, Callable[[], torch.Tensor]]:
    torch.manual_seed(0)
    model = _ActorCritic().train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    pi_loss = _BatchA2CLoss(entropy_cost=entropy_cost, fixed=not bug)

    def step() -> torch.Tensor:
        opt.zero_grad()
        logits, value = model(_C02_OBS)
        loss = pi_loss.loss(logits, value, _C02_ACT, _C02_RET) + 0.5 * F.mse_loss(value, _C02_RET)
        loss.backward()
        opt.step()
        return loss

    return model, opt, step


def _c02_build(bug: bool) -> Case:
    """Actor-critic on a batch of transitions: batch A2C policy loss with entropy_cost=0.1 plus a value MSE."""
    model, opt, step = _c02_setup(bug, 0.1)
    return model, step, _kw(optimizer=opt, inputs=_C02_OBS)


def _c02_proof(bug: bool) -> bool:
    """After 20 steps the policy is *less* entropic with the entropy regulariser switched on than with it off."""
    ends = []
    for cost in (0.0, 0.1):
        model, _, step = _c02_setup(bug, cost)
        for _ in range(20):
            step()
        with torch.no_grad():
            ends.append(_c02_entropy(model(_C02_OBS)[0]).mean().item())
    return ends[1] < ends[0]

# --------------------------------------------------------------------------------------------- case-03
# IntelLabs/distiller issue #122: distiller's `KnowledgeDistillationPolicy` combines the student's hard-label loss
# with the soft-target term `KL(softmax(teacher / T) || softmax(student / T))` as
# `student_w * ce + distill_w * kl`, without the T**2 factor of Hinton et al. The soft-target gradients scale as
# 1 / T**2, so at the usual T = 4..5 the distillation term contributes a few percent of what its weight says: the
# student silently trains almost on the hard labels alone, and changing T changes the effective loss weighting.
# A maintainer confirmed it ("you're correct ... Will fix") and the fix multiplies the soft term by T**2.

_C03_T = 4.0
_C03_X = torch.randn(8, 12, generator=_gen(2521))
_C03_Y = torch.randint(0, 5, (8,), generator=_gen(2522))


def _c03_nets() -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    teacher = nn.Sequential(nn.Linear(12, 64), nn.ReLU(), nn.Linear(64, 5))
    with torch.no_grad():
        teacher[2].weight.mul_(6.0)  # a confident (trained-looking) teacher
    teacher.eval().requires_grad_(False)
    student = nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 5)).train()
    return teacher, student


def _c03_terms(teacher: nn.Module, student: nn.Module, temperature: float,
               bug: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weighted hard-label loss, weighted distillation loss) as the policy combines them."""
    student_w, distill_w = 0.3, 0.7
    logits = student(_C03_X)
    with torch.no_grad():
        teacher_logits = teacher(_C03_X)
    hard = F.cross_entropy(logits, _C03_Y)
    soft_log_probs = F.log_softmax(logits / temperature, dim=1)
    soft_targets = F.softmax(teacher_logits / temperature, dim=1)
    distill = F.kl_div(soft_log_probs, soft_targets.detach(), reduction="sum") / soft_targets.shape[0]
    if not bug:
        distill = distill * temperature ** 2
    return student_w * hard, distill_w * distill


def _c03_build(bug: bool) -> Case:
    """Student MLP distilled from a frozen teacher at T=4, weights 0.3 (labels) / 0.7 (teacher)."""
    teacher, student = _c03_nets()

    class _KD(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.student, self.teacher = student, teacher

    model = _KD()
    opt = torch.optim.SGD(student.parameters(), lr=0.1, momentum=0.9)

    def step() -> torch.Tensor:
        opt.zero_grad()
        hard, distill = _c03_terms(teacher, student, _C03_T, bug)
        loss = hard + distill
        loss.backward()
        opt.step()
        return loss

    return model, step, _kw(optimizer=opt, inputs=_C03_X)


def _c03_proof(bug: bool) -> bool:
    """Going from T=1 to T=4 shrinks the distillation term's gradient share (against the hard-label term's) by
    more than 4x: its weight no longer means what it says once T is raised."""
    teacher, student = _c03_nets()
    params = list(student.parameters())

    def share(temperature: float) -> float:
        hard, distill = _c03_terms(teacher, student, temperature, bug)
        g_hard = torch.cat([g.flatten() for g in torch.autograd.grad(hard, params, retain_graph=True)]).norm()
        g_soft = torch.cat([g.flatten() for g in torch.autograd.grad(distill, params)]).norm()
        return (g_soft / g_hard).item()

    return share(_C03_T) < 0.25 * share(1.0)

# --------------------------------------------------------------------------------------------- case-04
# ShomyLiu/Neu-Review-Rec issue #9: the review-based recommender's factorization-machine prediction layer
# (framework/prediction.py, `FM.build_fm`) computes the pairwise-interaction term as
# `0.5 * torch.sum(fm_interactions_1 - fm_interactions_2) + fm_linear_part` with no `dim`, so the interactions of
# the whole batch are summed into one scalar that is broadcast onto every sample's linear part. Every rating in the
# batch gets the same (batch-summed) interaction term, so each prediction depends on the other samples in the
# batch, and the shapes still line up, so nothing errors and the MSE goes down. The maintainer confirmed and fixed
# it with `torch.sum(..., 1, keepdim=True)`.


class _C04FM(nn.Module):
    """framework/prediction.py's FM over the fused user/item feature, plus user and item biases."""

    def __init__(self, dim: int, user_num: int, item_num: int, bug: bool) -> None:
        super().__init__()
        self.bug = bug
        self.fc = nn.Linear(dim, 1)
        self.fm_V = nn.Parameter(torch.randn(dim, 10))
        self.b_users = nn.Parameter(torch.randn(user_num, 1))
        self.b_items = nn.Parameter(torch.randn(item_num, 1))
        nn.init.uniform_(self.fc.weight, -0.05, 0.05)
        nn.init.constant_(self.fc.bias, 0.0)
        nn.init.uniform_(self.b_users, a=0, b=0.1)
        nn.init.uniform_(self.b_items, a=0, b=0.1)
        nn.init.uniform_(self.fm_V, -0.05, 0.05)

    def build_fm(self, input_vec: torch.Tensor) -> torch.Tensor:
        fm_linear_part = self.fc(input_vec)
        fm_interactions_1 = torch.pow(torch.mm(input_vec, self.fm_V), 2)
        fm_interactions_2 = torch.mm(torch.pow(input_vec, 2), torch.pow(self.fm_V, 2))
        if self.bug:
            return 0.5 * torch.sum(fm_interactions_1 - fm_interactions_2) + fm_linear_part
        return 0.5 * torch.sum(fm_interactions_1 - fm_interactions_2, 1, keepdim=True) + fm_linear_part

    def forward(self, feature: torch.Tensor, uids: torch.Tensor, iids: torch.Tensor) -> torch.Tensor:
        return self.build_fm(feature) + self.b_users[uids] + self.b_items[iids]


class _C04Rec(nn.Module):
    """User and item representations (stand-ins for the review encoders), concatenated, then the FM layer."""

    def __init__(self, bug: bool) -> None:
        super().__init__()
        self.user = nn.Embedding(20, 16)
        self.item = nn.Embedding(30, 16)
        self.predict = _C04FM(32, 20, 30, bug)

    def forward(self, uids: torch.Tensor, iids: torch.Tensor) -> torch.Tensor:
        feature = torch.cat([self.user(uids), self.item(iids)], dim=1)
        return self.predict(feature, uids, iids).squeeze(1)


_C04_U = torch.randint(0, 20, (8,), generator=_gen(2531))
_C04_I = torch.randint(0, 30, (8,), generator=_gen(2532))
_C04_R = torch.randint(1, 6, (8,), generator=_gen(2533)).float()


def _c04_model(bug: bool) -> _C04Rec:
    torch.manual_seed(0)
    return _C04Rec(bug).train()


def _c04_build(bug: bool) -> Case:
    """Rating regression (MSE on 1-5 stars) through the FM prediction layer."""
    model = _c04_model(bug)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)

    def step() -> torch.Tensor:
        opt.zero_grad()
        loss = F.mse_loss(model(_C04_U, _C04_I), _C04_R)
        loss.backward()
        opt.step()
        return loss

    return model, step, _kw(optimizer=opt, inputs=(_C04_U, _C04_I))


def _c04_proof(bug: bool) -> bool:
    """Changing only the other samples of the batch changes the predicted rating of sample 0."""
    model = _c04_model(bug)
    with torch.no_grad():
        with_batch = model(_C04_U, _C04_I)[0]
        other_items = (_C04_I + 7) % 30
        other_items[0] = _C04_I[0]
        with_other_batch = model(_C04_U, other_items)[0]
        alone = model(_C04_U[:1], _C04_I[:1])[0]
    return not (torch.allclose(with_batch, with_other_batch) and torch.allclose(with_batch, alone))

# --------------------------------------------------------------------------------------------- case-05
# valdersoul/bn-vae issue #1: the text VAE's training loop (cyclical KL annealing) anneals the KL weight per batch,
# `kl_weight = min(1.0, kl_weight + anneal_rate)`, and then, still inside the batch loop, restarts the cycle with
# `if args.cycle > 0 and (epoch - 1) % args.cycle == 0: kl_weight = args.kl_start`. In every restart epoch the
# weight is therefore reset on every batch and stays at kl_start (here 0) for the whole epoch instead of ramping
# up from it: for an epoch per cycle the model trains as a plain autoencoder with the KL term switched off. The loss
# drops (faster, even), nothing errors. The fix moves the restart before the batch loop, once per epoch (the
# repository's training loop now has it there).

_C05_V, _C05_Z = 30, 8
_C05_BATCHES = [torch.randint(3, _C05_V, (8, 12), generator=_gen(2540 + k)) for k in range(6)]


class _TextVAE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(_C05_V, 16)
        self.enc = nn.LSTM(16, 32, batch_first=True)
        self.mu = nn.Linear(32, _C05_Z)
        self.logvar = nn.Linear(32, _C05_Z)
        self.z_to_h = nn.Linear(_C05_Z, 32)
        self.dec = nn.LSTM(16, 32, batch_first=True)
        self.out = nn.Linear(32, _C05_V)

    def forward(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(reconstruction loss per sentence, KL per sentence), both averaged over the batch."""
        _, (h, _) = self.enc(self.emb(tokens))
        mu, logvar = self.mu(h[-1]), self.logvar(h[-1])
        z = mu + torch.randn_like(mu) * torch.exp(0.5 * logvar)
        h0 = torch.tanh(self.z_to_h(z))[None]
        dec, _ = self.dec(self.emb(tokens[:, :-1]), (h0, torch.zeros_like(h0)))
        logits = self.out(dec)
        rec = F.cross_entropy(logits.reshape(-1, _C05_V), tokens[:, 1:].reshape(-1), reduction="sum") / len(tokens)
        kl = 0.5 * (mu.pow(2) + logvar.exp() - logvar - 1).sum(1).mean()
        return rec, kl


class _C05Trainer:
    """The training loop of the thread: cycle=10, kl_start=0, warm_up=10 epochs, six batches per epoch."""

    cycle, kl_start, warm_up = 10, 0.0, 10

    def __init__(self, bug: bool) -> None:
        torch.manual_seed(0)
        self.bug = bug
        self.model = _TextVAE().train()
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.5, momentum=0.0)
        self.anneal_rate = (1.0 - self.kl_start) / (self.warm_up * len(_C05_BATCHES))
        # the state after epoch 0: the weight has ramped up once over its six batches
        self.kl_weight = self.kl_start + self.anneal_rate * len(_C05_BATCHES)
        self.epoch = 0
        self.batch = 0
        self.used: list[float] = []

    def start_epoch(self, epoch: int) -> None:
        self.epoch, self.batch = epoch, 0
        if not self.bug and self.cycle > 0 and (epoch - 1) % self.cycle == 0:
            self.kl_weight = self.kl_start  # fixed: restart the cycle once, before the batch loop

    def train_batch(self) -> torch.Tensor:
        tokens = _C05_BATCHES[self.batch % len(_C05_BATCHES)]
        self.batch += 1
        self.kl_weight = min(1.0, self.kl_weight + self.anneal_rate)
        if self.bug and self.cycle > 0 and (self.epoch - 1) % self.cycle == 0:
            self.kl_weight = self.kl_start  # the bug: the restart runs inside the batch loop, on every batch
        self.used.append(self.kl_weight)
        self.opt.zero_grad()
        rec, kl = self.model(tokens)
        loss = rec + self.kl_weight * kl
        loss.backward()
        self.opt.step()
        return loss


def _c05_build(bug: bool) -> Case:
    """One batch of the restart epoch (epoch 1) of the cyclically annealed text VAE."""
    trainer = _C05Trainer(bug)
    trainer.start_epoch(1)
    return trainer.model, trainer.train_batch, _kw(optimizer=trainer.opt, inputs=_C05_BATCHES[0])


def _c05_proof(bug: bool) -> bool:
    """Over the whole restart epoch (six real steps) the KL term is weighted kl_start = 0 on every step, instead of
    ramping up from it."""
    trainer = _C05Trainer(bug)
    trainer.start_epoch(1)
    for _ in range(len(_C05_BATCHES)):
        trainer.train_batch()
    return max(trainer.used) == trainer.kl_start

# --------------------------------------------------------------------------------------------- cases

CASES: list[BlindCase] = [
    BlindCase("b25c-01", "https://github.com/shakedzy/tic_tac_toe/issues/1", "target network never synced",
              "The double-DQN target copy is gated on the replay-memory counter, which runs one ahead of the learn "
              "counter, so it never fires and the Bellman targets come from the random initial target network.",
              _c01_build, _c01_proof,
              known_miss="the target copy is synced on a counter that never matches: a copy that should follow only every N steps is not measured in one step"),
    BlindCase("b25c-02", "https://github.com/google-deepmind/open_spiel/issues/962", "entropy regulariser sign",
              "The batch A2C loss adds entropy_cost * entropy to the minimised loss, so the exploration bonus drives "
              "the policy entropy down instead of up.", _c02_build, _c02_proof,
              known_miss="an entropy bonus minimised: the sign of a regulariser's term is not judged"),
    BlindCase("b25c-03", "https://github.com/IntelLabs/distiller/issues/122", "distillation temperature scaling",
              "The soft-target KL term is not multiplied by T**2, so at T=4 its gradients are ~1/16 of what its loss "
              "weight intends and the student trains almost on the hard labels alone.", _c03_build, _c03_proof,
              known_miss="a distillation term without T**2: the gradient share of a loss term against its weight is not measured"),
    BlindCase("b25c-04", "https://github.com/ShomyLiu/Neu-Review-Rec/issues/9", "reduction over the batch dimension",
              "The factorization machine sums its pairwise interactions with no dim, so the whole batch's interaction "
              "term is one scalar added to every sample's prediction.", _c04_build, _c04_proof),
    BlindCase("b25c-05", "https://github.com/valdersoul/bn-vae/issues/1", "loss-weight schedule reset every step",
              "The cyclical KL-annealing restart sits inside the batch loop, so in every restart epoch the KL weight "
              "is reset to kl_start=0 on each batch and the VAE trains with its KL term switched off.",
              _c05_build, _c05_proof,
              known_miss="the KL weight is reset to 0 on every batch: at step 0 a zero KL weight is what annealing starts from"),
]
