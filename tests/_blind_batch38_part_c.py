"""Blind batch 38 (part c): silent training bugs outside the usual LLM fine-tune, from public GitHub threads.

Collected by someone who does not write the audit's checks. Reinforcement learning (a CleanRL-style PPO whose done
flags are written one slot late), federated learning (FedAvg that averages parameters but not BatchNorm buffers),
continual learning (EWC with a Fisher diagonal averaged to one number), scientific ML (a PINO loss that adds its
interior weight instead of multiplying by it) and training-loop plumbing (a zero_grad at each epoch start that throws
away a partial gradient-accumulation window). Every case is built on a plain torch module, nothing is downloaded, and
each proof shows the bug on real tensors and real steps without the audit.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributions.normal import Normal

from tests._blind import BlindCase, Case
from tests._blind_batch5 import _gen, _kw

# --------------------------------------------------------------------------------------------- case-01
# RoboVerseOrg/RoboVerse PR #814 ("fix(rl): stop PPO from bootstrapping across the episode boundary"): the CleanRL-style
# PPO rollout loop wrote `dones[step]` twice, once before acting (`dones[step] = next_done`, CleanRL's meaning: obs[t]
# is a post-reset state) and again after `envs.step()` with the post-step flag. The second write shifts the buffer by
# one slot, so GAE's `nextnonterminal = ~dones[t + 1]` asks whether the *next* action ended the episode. On the
# transition that actually terminated, the mask is 1 and the advantage bootstraps gamma * V(reset state of a fresh
# episode): ending an episode pays a bonus. Silent: PPO trains, losses look normal, the advantages are just wrong at
# every episode boundary. Fix in the PR: drop the post-step write and keep only the pre-step one.

_C01_ENVS, _C01_OBS, _C01_STEPS, _C01_LEN = 2, 3, 4, 3


class _C01Agent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.critic = nn.Sequential(nn.Linear(_C01_OBS, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))
        self.actor_mean = nn.Sequential(nn.Linear(_C01_OBS, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                                        nn.Linear(16, 1))
        self.actor_logstd = nn.Parameter(torch.zeros(1, 1))
        gen = _gen(3801)
        for layer in [*self.critic, *self.actor_mean]:
            if isinstance(layer, nn.Linear):
                nn.init.orthogonal_(layer.weight, 2 ** 0.5, generator=gen)
                nn.init.constant_(layer.bias, 0.0)
        nn.init.orthogonal_(self.critic[-1].weight, 1.0, generator=gen)
        nn.init.orthogonal_(self.actor_mean[-1].weight, 0.01, generator=gen)

    def get_value(self, x):
        return self.critic(x)

    def get_action_and_value(self, x, action=None, gen=None):
        mean = self.actor_mean(x)
        std = torch.exp(self.actor_logstd.expand_as(mean))
        probs = Normal(mean, std)
        if action is None:
            action = mean + std * torch.randn(mean.shape, generator=gen)
        return action, probs.log_prob(action).sum(1), probs.entropy().sum(1), self.critic(x)


class _C01Env:
    """Two vectorised envs with fixed-length episodes and auto-reset inside step() (as RoboVerse's RLTaskEnv)."""

    def __init__(self) -> None:
        self.t = torch.tensor([0, 1])

    def _obs(self):
        return torch.stack([self.t.float() / _C01_LEN, torch.arange(_C01_ENVS).float(), torch.ones(_C01_ENVS)], 1)

    def reset(self):
        self.t = torch.tensor([0, 1])
        return self._obs()

    def step(self, action):
        reward = 1.0 - (action.view(-1) - 0.5) ** 2
        terminations = self.t + 1 >= _C01_LEN
        reward = torch.where(terminations, torch.full_like(reward, -1.0), reward)  # falling over ends the episode
        self.t = torch.where(terminations, torch.zeros_like(self.t), self.t + 1)
        return self._obs(), reward, terminations, torch.zeros_like(terminations), {}


def _c01_setup(bug: bool):
    torch.manual_seed(0)
    agent = _C01Agent()
    optimizer = torch.optim.Adam(agent.parameters(), lr=3e-4, eps=1e-5)
    envs = _C01Env()
    gen = _gen(3804)
    gamma, lam, clip_coef, vf_coef, ent_coef = 0.99, 0.95, 0.2, 0.5, 0.0
    obs = torch.zeros(_C01_STEPS, _C01_ENVS, _C01_OBS)
    actions = torch.zeros(_C01_STEPS, _C01_ENVS, 1)
    logprobs = torch.zeros(_C01_STEPS, _C01_ENVS)
    rewards = torch.zeros(_C01_STEPS, _C01_ENVS)
    dones = torch.zeros(_C01_STEPS, _C01_ENVS, dtype=torch.bool)
    values = torch.zeros(_C01_STEPS, _C01_ENVS)
    state = {"next_obs": envs.reset(), "next_done": torch.zeros(_C01_ENVS, dtype=torch.bool)}

    def step() -> torch.Tensor:
        terminated = torch.zeros(_C01_STEPS, _C01_ENVS, dtype=torch.bool)
        for t in range(_C01_STEPS):
            obs[t] = state["next_obs"]
            dones[t] = state["next_done"]
            with torch.no_grad():
                action, logprob, _, value = agent.get_action_and_value(state["next_obs"], gen=gen)
                values[t] = value.flatten()
            actions[t] = action
            logprobs[t] = logprob
            next_obs, reward, terms, truncs, _ = envs.step(action)
            state["next_obs"], state["next_done"] = next_obs, torch.logical_or(terms, truncs)
            rewards[t] = reward.view(-1)
            terminated[t] = terms
            if bug:
                dones[t] = state["next_done"]  # the second, post-step write the PR removed
        with torch.no_grad():
            next_value = agent.get_value(state["next_obs"]).reshape(1, -1)
            advantages = torch.zeros_like(rewards)
            lastgaelam = 0
            for t in reversed(range(_C01_STEPS)):
                if t == _C01_STEPS - 1:
                    nextnonterminal, nextvalues = (~state["next_done"]).float(), next_value
                else:
                    nextnonterminal, nextvalues = (~dones[t + 1]).float(), values[t + 1]
                delta = rewards[t] + gamma * nextvalues * nextnonterminal - values[t]
                advantages[t] = lastgaelam = delta + gamma * lam * nextnonterminal * lastgaelam
            returns = advantages + values
        state.update(advantages=advantages.clone(), rewards=rewards.clone(), values=values.clone(),
                     terminated=terminated)
        b_obs, b_act = obs.reshape(-1, _C01_OBS), actions.reshape(-1, 1)
        b_logp, b_adv, b_ret, b_val = logprobs.reshape(-1), advantages.reshape(-1), returns.reshape(-1), values.reshape(-1)
        _, newlogprob, entropy, newvalue = agent.get_action_and_value(b_obs, b_act)
        ratio = (newlogprob - b_logp).exp()
        mb_adv = (b_adv - b_adv.mean()) / (b_adv.std() + 1e-8)
        pg_loss = torch.max(-mb_adv * ratio, -mb_adv * torch.clamp(ratio, 1 - clip_coef, 1 + clip_coef)).mean()
        newvalue = newvalue.view(-1)
        v_clipped = b_val + torch.clamp(newvalue - b_val, -clip_coef, clip_coef)
        v_loss = 0.5 * torch.max((newvalue - b_ret) ** 2, (v_clipped - b_ret) ** 2).mean()
        loss = pg_loss - ent_coef * entropy.mean() + vf_coef * v_loss
        optimizer.zero_grad()
        loss.backward()
        nn.utils.clip_grad_norm_(agent.parameters(), 0.5)
        optimizer.step()
        return loss

    return agent, optimizer, step, state


def _c01_build(bug: bool) -> Case:
    agent, optimizer, step, _ = _c01_setup(bug)
    return agent, step, _kw(optimizer=optimizer)


def _c01_proof(bug: bool) -> bool:
    """On a transition that terminated the episode, is the advantage anything but r - V(s) (no bootstrap)?"""
    _, _, step, state = _c01_setup(bug)
    step()
    term = state["terminated"]
    expected = state["rewards"] - state["values"]
    return bool((state["advantages"][term] - expected[term]).abs().max() > 1e-5)


# --------------------------------------------------------------------------------------------- case-02
# SymbioticLab/FedScale issue #57 ("BatchNorm params not being collected / averaged properly across clients"): the
# clients hand back `model.parameters()` and the server averages those into the global model. BatchNorm's
# running_mean / running_var / num_batches_tracked are buffers, not parameters, so they are never aggregated: the
# global model keeps its initial statistics (zeros and ones) while every client's drift with its own data. Training
# loss still falls on the clients; the global model is just evaluated with statistics no client has. Fix suggested in
# the issue and accepted by the maintainer: aggregate over `model.state_dict().items()` so the buffers are averaged too.

_C02_X = [torch.randn(8, 4, generator=_gen(3811)) * 1.5 + 2.0, torch.randn(8, 4, generator=_gen(3812)) * 0.5 - 1.0]
_C02_Y = [torch.randint(0, 3, (8,), generator=_gen(3813)), torch.randint(0, 3, (8,), generator=_gen(3814))]


def _c02_setup(bug: bool):
    torch.manual_seed(0)
    global_model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))
    last: dict[str, list[nn.Module]] = {"clients": []}

    def step() -> torch.Tensor:
        clients, losses = [], []
        for x, y in zip(_C02_X, _C02_Y):  # one local step per client (the executor's run_client)
            local = copy.deepcopy(global_model).train()
            opt = torch.optim.SGD(local.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
            opt.zero_grad()
            loss = F.cross_entropy(local(x), y)
            loss.backward()
            opt.step()
            clients.append(local)
            losses.append(loss)
        importance = 1.0 / len(clients)
        with torch.no_grad():
            if bug:  # aggregate model.parameters() only
                for gp, *cps in zip(global_model.parameters(), *[c.parameters() for c in clients]):
                    gp.data = sum(cp.data * importance for cp in cps)
            else:  # aggregate the whole state_dict, buffers included
                states = [c.state_dict() for c in clients]
                new = {}
                for k, v in global_model.state_dict().items():
                    if v.is_floating_point():
                        new[k] = sum(s[k] * importance for s in states)
                    else:
                        new[k] = states[0][k].clone()
                global_model.load_state_dict(new)
        last["clients"] = clients
        return torch.stack(losses).mean()

    return global_model, step, last


def _c02_build(bug: bool) -> Case:
    model, step, _ = _c02_setup(bug)
    return model, step, _kw(inputs={"x": _C02_X[0]})


def _c02_proof(bug: bool) -> bool:
    """After a round, does the global BatchNorm running_mean differ from the average of the clients'?"""
    model, step, last = _c02_setup(bug)
    step()
    client_mean = torch.stack([c[1].running_mean for c in last["clients"]]).mean(0)
    return bool((model[1].running_mean - client_mean).abs().max() > 1e-6)


# --------------------------------------------------------------------------------------------- case-03
# kuc2477/pytorch-ewc issue #2 ("The size of fisher matrix is wrong"): `estimate_fisher` stacks the per-sample
# gradients of the log-likelihood and reduces them with `(g ** 2).mean()`, over every dimension, so each layer's
# "Fisher diagonal" is one scalar. The EWC penalty `fisher * (p - mean) ** 2` broadcasts it, so every weight of a layer
# is anchored equally hard, including weights task A never used (inputs that are always zero there, like MNIST's
# border pixels). Training on task B runs and the loss falls; EWC just protects the wrong weights. Fix (commit
# 4afaa66, "critical bug"): average only over the sample dimension, `(g ** 2).mean(0)`.

_C03_DEAD = 6  # task A's inputs 6 and 7 are always zero
_C03_XA = torch.randn(32, 8, generator=_gen(3821))
_C03_XA[:, _C03_DEAD:] = 0.0
_C03_YA = torch.randint(0, 3, (32,), generator=_gen(3822))
_C03_XB = torch.randn(16, 8, generator=_gen(3823))
_C03_YB = torch.randint(0, 3, (16,), generator=_gen(3824))


class _C03MLP(nn.Module):
    def __init__(self, bug: bool, lamda: float = 40.0) -> None:
        super().__init__()
        self.bug, self.lamda = bug, lamda
        # the repo's MLP with its dropout probabilities at 0 so the reproduction is deterministic
        self.layers = nn.ModuleList([nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.0), nn.Linear(16, 16), nn.ReLU(),
                                     nn.Dropout(0.0), nn.Linear(16, 3)])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x

    def estimate_fisher(self, x, y, batch_size=8):
        loglikelihoods = []
        for i in range(0, len(x), batch_size):
            xb, yb = x[i:i + batch_size], y[i:i + batch_size]
            loglikelihoods.append(F.log_softmax(self(xb), dim=1)[range(len(xb)), yb])
        loglikelihoods = torch.cat(loglikelihoods).unbind()
        grads = zip(*[torch.autograd.grad(ll, self.parameters(), retain_graph=(i < len(loglikelihoods)))
                      for i, ll in enumerate(loglikelihoods, 1)])
        grads = [torch.stack(gs) for gs in grads]
        fisher = [(g ** 2).mean() if self.bug else (g ** 2).mean(0) for g in grads]
        names = [n.replace(".", "__") for n, _ in self.named_parameters()]
        return {n: f.detach() for n, f in zip(names, fisher)}

    def consolidate(self, fisher):
        for n, p in self.named_parameters():
            n = n.replace(".", "__")
            self.register_buffer(f"{n}_mean", p.data.clone())
            self.register_buffer(f"{n}_fisher", fisher[n].data.clone())

    def ewc_loss(self):
        losses = []
        for n, p in self.named_parameters():
            n = n.replace(".", "__")
            losses.append((getattr(self, f"{n}_fisher") * (p - getattr(self, f"{n}_mean")) ** 2).sum())
        return (self.lamda / 2) * sum(losses)


def _c03_setup(bug: bool):
    torch.manual_seed(0)
    model = _C03MLP(bug).train()
    model.consolidate(model.estimate_fisher(_C03_XA, _C03_YA))  # task A done: consolidate before task B
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2, weight_decay=1e-5)

    def step() -> torch.Tensor:
        optimizer.zero_grad()
        loss = F.cross_entropy(model(_C03_XB), _C03_YB) + model.ewc_loss()
        loss.backward()
        optimizer.step()
        return loss

    return model, optimizer, step


def _c03_build(bug: bool) -> Case:
    model, optimizer, step = _c03_setup(bug)
    return model, step, _kw(optimizer=optimizer, inputs={"x": _C03_XB})


def _c03_proof(bug: bool) -> bool:
    """Does EWC give importance to first-layer weights whose log-likelihood gradient was zero on every task-A sample?"""
    model, _, _ = _c03_setup(bug)
    w = model.layers[0].weight
    fisher = torch.broadcast_to(model.layers__0__weight_fisher, w.shape)
    # the per-sample gradients those weights got on task A: all exactly zero (their inputs are always zero)
    ll = F.log_softmax(model(_C03_XA), 1)[range(len(_C03_XA)), _C03_YA].sum()
    (g,) = torch.autograd.grad(ll, w)
    assert g[:, _C03_DEAD:].abs().max() == 0
    return bool(fisher[:, _C03_DEAD:].abs().max() > 0)


# --------------------------------------------------------------------------------------------- case-04
# neuraloperator/neuraloperator PR #619 ("Fix the small bug for PINO loss"): PoissonEqnLoss, the physics-informed
# loss for the nonlinear Poisson problem, combined its two parts as `interior_weight + interior_loss(...)` instead of
# `interior_weight * interior_loss(...)`. The weight (1e-2 in the Poisson GINO config) only shifts the loss by a
# constant; the PDE residual enters the gradient with weight 1, a hundred times what the config asks for, so it
# dominates the data and boundary terms. Silent: the loss is finite and falls. Fix in the PR: multiply.

_C04_NB, _C04_NI, _C04_IW, _C04_BW = 8, 16, 1e-2, 1.0
_C04_T = torch.rand(_C04_NB, generator=_gen(3831))
_C04_BND = torch.stack([torch.cat([_C04_T[:4], torch.tensor([0.0, 1.0, 0.0, 1.0])]),
                        torch.cat([torch.tensor([0.0, 1.0, 0.0, 1.0]), _C04_T[4:]])], 1)
_C04_INT = torch.rand(_C04_NI, 2, generator=_gen(3832)) * 0.8 + 0.1
_C04_Q = torch.cat([_C04_BND, _C04_INT]).unsqueeze(0)  # (1, boundary + interior, 2), boundary points first


def _c04_u_true(q):
    return (torch.sin(torch.pi * q[..., 0]) * torch.sin(torch.pi * q[..., 1]) + 0.5 * q[..., 0]).unsqueeze(-1)


def _c04_lhs(u, q):
    """Left-hand side of the nonlinear Poisson equation on the interior points (PoissonInteriorLoss.autograd)."""
    nb = _C04_NB
    (u_prime,) = torch.autograd.grad(u.sum(), q, create_graph=True)
    u_x, u_y = u_prime[:, :, 0], u_prime[:, :, 1]
    u_xx = torch.autograd.grad(u_x.sum(), q, create_graph=True)[0][:, nb:, 0].squeeze(0)
    u_yy = torch.autograd.grad(u_y.sum(), q, create_graph=True)[0][:, nb:, 1].squeeze(0)
    u_prime = u_prime[:, nb:].squeeze(0)
    u = u[:, nb:].squeeze(0).squeeze(-1)
    laplacian = u_xx + u_yy
    return laplacian + laplacian * 0.1 * u ** 2 + 0.2 * u * u_prime.pow(2).sum(-1)


_C04_QT = _C04_Q.clone().requires_grad_(True)
_C04_Y = _c04_u_true(_C04_Q).detach()
_C04_F = _c04_lhs(_c04_u_true(_C04_QT), _C04_QT).detach()  # source terms f(x) of the true solution


def _c04_terms(model):
    q = _C04_Q.clone().requires_grad_(True)
    u = model(q)
    mse = F.mse_loss(u, _C04_Y)
    interior = F.mse_loss(_c04_lhs(u, q), _C04_F)
    boundary = F.mse_loss(u.squeeze(0).squeeze(-1)[:_C04_NB], _C04_Y.squeeze(0).squeeze(-1)[:_C04_NB])
    return mse, interior, boundary


def _c04_total(model, bug: bool):
    mse, interior, boundary = _c04_terms(model)
    interior_loss = _C04_IW + interior if bug else _C04_IW * interior
    bc_loss = _C04_BW * boundary
    return 1.0 * mse + 1.0 * (interior_loss + bc_loss)  # WeightedSumLoss([mse, equation], [1, 1])


def _c04_setup(bug: bool):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)

    def step() -> torch.Tensor:
        optimizer.zero_grad()
        loss = _c04_total(model, bug)
        loss.backward()
        optimizer.step()
        return loss

    return model, optimizer, step


def _c04_build(bug: bool) -> Case:
    model, optimizer, step = _c04_setup(bug)
    return model, step, _kw(optimizer=optimizer, inputs={"q": _C04_Q})


def _c04_proof(bug: bool) -> bool:
    """Is the training gradient anything but mse + 1e-2 * interior + 1.0 * boundary, the weights the config sets?"""
    model, _, _ = _c04_setup(bug)
    params = list(model.parameters())
    parts = [torch.autograd.grad(t, params, retain_graph=True) for t in _c04_terms(model)]
    total = torch.autograd.grad(_c04_total(model, bug), params)
    err = max((gt - (gm + _C04_IW * gi + _C04_BW * gb)).abs().max().item()
              for gt, gm, gi, gb in zip(total, *parts))
    scale = max(g.abs().max().item() for g in total)
    return err > 1e-4 * scale


# --------------------------------------------------------------------------------------------- case-05
# ultralytics/ultralytics PR #11217 ("fix double zero_grad call messing up gradient accumulation"): BaseTrainer
# calls `optimizer.zero_grad()` at the start of every epoch as well as inside `optimizer_step()`. The step only runs
# when `ni - last_opt_step >= accumulate`, so when the batches of an epoch are not a multiple of `accumulate` the
# gradients of the epoch's last batches are wiped by the next epoch's zero_grad before any step uses them (120 batches
# with accumulate=32 drop 24 batches every epoch). Silent: training proceeds, those batches just never count. Fix in
# the PR: remove the epoch-start zero_grad; the leftover window carries into the next epoch's first step.

_C05_NB, _C05_ACC = 3, 2  # three batches an epoch, accumulate two: one batch is left over each odd epoch
_C05_X = torch.randn(_C05_NB, 4, 6, generator=_gen(3841))
_C05_Y = torch.randint(0, 4, (_C05_NB, 4), generator=_gen(3842))


def _c05_setup(bug: bool):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, nesterov=True)
    state = {"epoch": 0, "it": None, "last_opt_step": -1}

    def optimizer_step() -> None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=10.0)
        optimizer.step()
        optimizer.zero_grad()

    def step() -> torch.Tensor:
        """Run the trainer's batch loop until its next optimizer step (crossing an epoch boundary if it must)."""
        while True:
            if state["it"] is None:  # epoch start
                if bug:
                    optimizer.zero_grad()
                state["it"] = iter(range(_C05_NB))
            i = next(state["it"], None)
            if i is None:
                state["it"], state["epoch"] = None, state["epoch"] + 1
                continue
            ni = i + _C05_NB * state["epoch"]
            loss = F.cross_entropy(model(_C05_X[i]), _C05_Y[i])
            loss.backward()
            if ni - state["last_opt_step"] >= _C05_ACC:
                optimizer_step()
                state["last_opt_step"] = ni
                return loss

    return model, optimizer, step


def _c05_build(bug: bool) -> Case:
    model, optimizer, step = _c05_setup(bug)
    return model, step, _kw(optimizer=optimizer, inputs={"x": _C05_X[0]})


def _c05_proof(bug: bool) -> bool:
    """Over two steps, does a zero_grad wipe gradients that backward produced and no optimizer step used?"""
    model, optimizer, step = _c05_setup(bug)
    seen = {"used": False, "discarded": False}
    real_step, real_zero = optimizer.step, optimizer.zero_grad

    def counted_step(*a, **k):
        seen["used"] = True
        return real_step(*a, **k)

    def counted_zero(*a, **k):
        live = any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())
        if live and not seen["used"]:
            seen["discarded"] = True
        seen["used"] = False
        return real_zero(*a, **k)

    optimizer.step, optimizer.zero_grad = counted_step, counted_zero
    step()
    step()
    return seen["discarded"]


CASES: list[BlindCase] = [
    BlindCase("b38c-01", "https://github.com/RoboVerseOrg/RoboVerse/pull/814", "PPO done mask shifted",
              "The rollout writes dones[step] again after env.step, shifting the buffer so GAE bootstraps the "
              "terminating transition from the next episode's reset-state value.", _c01_build, _c01_proof,
              known_miss="a PPO done mask shifted by one step: the estimator's arithmetic is outside the model"),
    BlindCase("b38c-02", "https://github.com/SymbioticLab/FedScale/issues/57", "FedAvg skips BatchNorm buffers",
              "The server averages model.parameters() only, so BatchNorm running statistics are never aggregated and "
              "the global model keeps its initial ones.", _c02_build, _c02_proof,
              known_miss="federated averaging that skips BatchNorm buffers: the step writes the model from copies, whose arithmetic is not judged"),
    BlindCase("b38c-03", "https://github.com/kuc2477/pytorch-ewc/issues/2", "EWC Fisher reduced to scalar",
              "The Fisher diagonal is averaged over every dimension, so each layer gets one importance and EWC anchors "
              "weights task A never used as hard as the ones it did.", _c03_build, _c03_proof,
              known_miss="an EWC Fisher reduced to one scalar: arithmetic inside the regulariser"),
    BlindCase("b38c-04", "https://github.com/neuraloperator/neuraloperator/pull/619", "loss weight added, not multiplied",
              "The PINO Poisson loss adds interior_weight to the PDE residual loss instead of multiplying, so the "
              "residual enters the gradient with weight 1 instead of 1e-2.", _c04_build, _c04_proof,
              known_miss="a loss weight added instead of multiplied: a term's weight is not measured"),
    BlindCase("b38c-05", "https://github.com/ultralytics/ultralytics/pull/11217", "epoch-start zero_grad drops accumulation",
              "A zero_grad at every epoch start wipes the gradients of a partial accumulation window left from the "
              "previous epoch before any optimizer step uses them.", _c05_build, _c05_proof,
              known_miss="an epoch-start zero_grad that drops the leftover accumulation window: one audited step does not cross an epoch boundary",
              known_alarm=("LOOP-004",)),
]
