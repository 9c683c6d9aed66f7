"""Blind batch 36 (part c): silent training bugs outside plain LM fine-tuning, each with its fixed twin.

Collected by someone who does not write the audit's checks. Domains: a sharpness-aware optimizer (LookSAM), federated
averaging (PySyft), continuous-control Q-learning (NAF), imitation learning with action chunks (SmolVLA-style flow
matching) and machine-learned interatomic potentials trained on forces (EquiformerV2). Every case builds the user's
setup on a tiny plain-torch model (nothing is downloaded) and proves the bug without the audit on real tensors and
real steps.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

from tests._blind import BlindCase, Case
from tests._blind_batch5 import _gen, _kw

# --------------------------------------------------------------------------------------------- case-01
# rollovd/LookSAM issue #3 ("A problem about the code"): LookSAM.step() takes the user's gradient g(w) (from the
# loss.backward() before the call), perturbs the weights by rho * g / ||g||, and runs a second forward/backward at
# w + e(w) -- but it never clears p.grad in between. The second backward accumulates onto the first, so the base
# optimizer steps with g(w) + g(w + e) instead of the sharpness-aware gradient g(w + e). Silent: the loss still falls
# (the update is roughly twice a plain-SGD step) but it is not SAM. The maintainer agreed ("Yeah, it makes sense") and
# fixed it in commit 8f5c8ef, which adds `zero_sam_grad=True` and calls self.zero_grad() before the second backward.
# (k=1 here, so every step is a SAM step.)

_C01_X = torch.randn(16, 8, generator=_gen(3601))
_C01_Y = torch.randint(0, 3, (16,), generator=_gen(3602))


class _LookSAM(torch.optim.Optimizer):
    """The repository's LookSAM, trimmed; ``zero_sam_grad`` is the fix."""

    def __init__(self, k, alpha, model, base_optimizer, criterion, rho=0.05, zero_sam_grad=True, **kwargs):
        defaults = dict(alpha=alpha, rho=rho, **kwargs)
        self.model = model
        super().__init__(self.model.parameters(), defaults)
        self.k = k
        self.alpha = torch.tensor(alpha, requires_grad=False)
        self.criterion = criterion
        self.zero_sam_grad = zero_sam_grad
        self.base_optimizer = base_optimizer(self.param_groups, **kwargs)
        self.param_groups = self.base_optimizer.param_groups

    @staticmethod
    def normalized(g):
        return g / g.norm(p=2)

    def _grad_norm(self):
        return torch.norm(torch.stack([p.grad.norm(p=2) for group in self.param_groups for p in group["params"]
                                       if p.grad is not None]), p=2)

    def step(self, t, samples, targets, zero_grad=True):
        if not t % self.k:
            group = self.param_groups[0]
            scale = group["rho"] / (self._grad_norm() + 1e-8)
            for index_p, p in enumerate(group["params"]):
                if p.grad is None:
                    continue
                self.state[p]["old_p"] = p.data.clone()
                self.state[f"old_grad_p_{index_p}"]["old_grad_p"] = p.grad.clone()
                with torch.no_grad():
                    p.add_(p.grad * scale.to(p))
            if self.zero_sam_grad:
                self.zero_grad()
            self.criterion(self.model(samples), targets).backward()

        group = self.param_groups[0]
        for index_p, p in enumerate(group["params"]):
            if p.grad is None:
                continue
            if not t % self.k:
                old_grad_p = self.state[f"old_grad_p_{index_p}"]["old_grad_p"]
                g_grad_norm = _LookSAM.normalized(old_grad_p)
                g_s_grad_norm = _LookSAM.normalized(p.grad)
                self.state[f"gv_{index_p}"]["gv"] = torch.sub(
                    p.grad, p.grad.norm(p=2) * torch.sum(g_grad_norm * g_s_grad_norm) * g_grad_norm)
            else:
                with torch.no_grad():
                    gv = self.state[f"gv_{index_p}"]["gv"]
                    p.grad.add_(self.alpha.to(p) * (p.grad.norm(p=2) / (gv.norm(p=2) + 1e-8) * gv))
            p.data = self.state[p]["old_p"]

        self.base_optimizer.step()
        if zero_grad:
            self.zero_grad()


def _c01_setup(bug: bool):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3)).train()
    criterion = nn.CrossEntropyLoss()
    opt = _LookSAM(k=1, alpha=0.7, model=model, base_optimizer=torch.optim.SGD, criterion=criterion, rho=0.05,
                   zero_sam_grad=not bug, lr=0.1)
    return model, criterion, opt


def _c01_build(bug: bool) -> Case:
    model, criterion, opt = _c01_setup(bug)
    counter = [0]

    def step() -> torch.Tensor:
        loss = criterion(model(_C01_X), _C01_Y)
        loss.backward()
        opt.step(t=counter[0], samples=_C01_X, targets=_C01_Y, zero_grad=True)
        counter[0] += 1
        return loss

    return model, step, _kw(optimizer=opt, inputs=_C01_X)


def _c01_proof(bug: bool) -> bool:
    """Does the base optimizer step with a gradient other than the one at the perturbed weights w + e(w)?"""
    model, criterion, opt = _c01_setup(bug)
    params = list(model.parameters())
    # the reference: the SAM gradient computed on its own, on a copy of the model
    ref = copy.deepcopy(model)
    g = torch.autograd.grad(criterion(ref(_C01_X), _C01_Y), list(ref.parameters()))
    scale = 0.05 / (torch.norm(torch.stack([x.norm() for x in g])) + 1e-8)
    with torch.no_grad():
        for q, gi in zip(ref.parameters(), g):
            q.add_(gi * scale)
    g_sam = torch.autograd.grad(criterion(ref(_C01_X), _C01_Y), list(ref.parameters()))
    used: list[torch.Tensor] = []
    opt.base_optimizer.register_step_pre_hook(lambda o, a, k: used.extend(p.grad.clone() for p in params))
    criterion(model(_C01_X), _C01_Y).backward()
    opt.step(t=0, samples=_C01_X, targets=_C01_Y)
    return not all(torch.allclose(u, s, atol=1e-6) for u, s in zip(used, g_sam))


# --------------------------------------------------------------------------------------------- case-02
# OpenMined/PySyft PR #4595 ("Fixing several issues in federated_avg()", from issue #3863 "Averaging method
# utils.federated_avg(models) returns wrong results"): federated_avg() builds its accumulator as `model = type(model_list[0])()` -- a freshly, randomly initialised model --
# and then adds every client model to it and scales by 1/N. The "average" is (random_init + sum(clients)) / N, so every
# federated round mixes fresh random weights into the global model. Silent: training still runs and the loss can fall,
# but the global model is never the clients' mean. Fix in the merged PR: start from a copy of the first model scaled
# to zero (`model = copy.deepcopy(model_list[0]); model = scale_model(model, 0.0)`),
# then add and scale.

_C02_SHARDS = [(torch.randn(12, 4, generator=_gen(3611 + i)), torch.randint(0, 3, (12,), generator=_gen(3621 + i)))
               for i in range(2)]


class _FedNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(4, 16)
        self.fc2 = nn.Linear(16, 3)

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(x)))


def _add_model(dst_model, src_model):
    params1 = src_model.named_parameters()
    dict_params2 = dict(dst_model.named_parameters())
    with torch.no_grad():
        for name1, param1 in params1:
            if name1 in dict_params2:
                dict_params2[name1].set_(param1.data + dict_params2[name1].data)
    return dst_model


def _scale_model(model, scale):
    dict_params = dict(model.named_parameters())
    with torch.no_grad():
        for name in dict_params:
            dict_params[name].set_(dict_params[name].data * scale)
    return model


def _federated_avg(models, bug: bool):
    nr_models = len(models)
    model_list = list(models.values())
    if bug:
        model = type(model_list[0])()
    else:
        model = copy.deepcopy(model_list[0])
        model = _scale_model(model, 0.0)
    for i in range(nr_models):
        model = _add_model(model, model_list[i])
    return _scale_model(model, 1.0 / nr_models)


def _c02_setup(bug: bool):
    torch.manual_seed(0)
    global_model = _FedNet().train()
    last_clients: list[nn.Module] = []

    def step() -> torch.Tensor:
        clients, losses = {}, []
        for worker, (x, y) in enumerate(_C02_SHARDS):
            local = copy.deepcopy(global_model)
            opt = torch.optim.SGD(local.parameters(), lr=0.1)
            opt.zero_grad()
            loss = F.cross_entropy(local(x), y)
            loss.backward()
            opt.step()
            clients[worker] = local
            losses.append(loss.detach())
        avg = _federated_avg(clients, bug)
        global_model.load_state_dict(avg.state_dict())
        last_clients[:] = list(clients.values())
        return torch.stack(losses).mean()

    return global_model, step, last_clients


def _c02_build(bug: bool) -> Case:
    model, step, _ = _c02_setup(bug)
    return model, step, _kw(inputs=_C02_SHARDS[0][0])


def _c02_proof(bug: bool) -> bool:
    """After one federated round, is the global model something other than the mean of the two client models?"""
    model, step, clients = _c02_setup(bug)
    step()
    for name, p in model.named_parameters():
        mean = sum(dict(c.named_parameters())[name].detach() for c in clients) / len(clients)
        if not torch.allclose(p.detach(), mean, atol=1e-6):
            return True
    return False


# --------------------------------------------------------------------------------------------- case-03
# ikostrikov/pytorch-ddpg-naf issue #16 ("Typo in the Implementation"): NAF.update_parameters() builds the Q target as
# `reward_batch + (self.gamma * mask_batch + next_state_values)` instead of
# `reward_batch + (self.gamma * mask_batch * next_state_values)`. Every target is off by gamma * mask, the next-state
# value is never discounted, and terminal transitions (mask = 0) still bootstrap from V(s'). Silent: the MSE loss falls
# normally (Q just fits the wrong targets). The maintainer fixed it in commit d900aa6 (linked in the thread) by making
# it a product.

_C03_B = 16
_C03_STATE = torch.randn(_C03_B, 3, generator=_gen(3631))
_C03_ACTION = torch.rand(_C03_B, 1, generator=_gen(3632)) * 2 - 1
_C03_REWARD = torch.randn(_C03_B, generator=_gen(3633))
_C03_MASK = torch.ones(_C03_B)
_C03_MASK[::4] = 0.0  # every fourth transition ends its episode
_C03_NEXT = torch.randn(_C03_B, 3, generator=_gen(3634))


def _soft_update(target, source, tau):
    for target_param, param in zip(target.parameters(), source.parameters()):
        target_param.data.copy_(target_param.data * (1.0 - tau) + param.data * tau)


def _hard_update(target, source):
    for target_param, param in zip(target.parameters(), source.parameters()):
        target_param.data.copy_(param.data)


class _NAFPolicy(nn.Module):
    def __init__(self, hidden_size, num_inputs, action_space):
        super().__init__()
        num_outputs = action_space.shape[0]
        self.bn0 = nn.BatchNorm1d(num_inputs)
        self.linear1 = nn.Linear(num_inputs, hidden_size)
        self.linear2 = nn.Linear(hidden_size, hidden_size)
        self.V = nn.Linear(hidden_size, 1)
        self.V.weight.data.mul_(0.1)
        self.V.bias.data.mul_(0.1)
        self.mu = nn.Linear(hidden_size, num_outputs)
        self.mu.weight.data.mul_(0.1)
        self.mu.bias.data.mul_(0.1)
        self.L = nn.Linear(hidden_size, num_outputs ** 2)
        self.L.weight.data.mul_(0.1)
        self.L.bias.data.mul_(0.1)
        self.register_buffer("tril_mask", torch.tril(torch.ones(num_outputs, num_outputs), diagonal=-1).unsqueeze(0))
        self.register_buffer("diag_mask", torch.diag(torch.diag(torch.ones(num_outputs, num_outputs))).unsqueeze(0))

    def forward(self, inputs):
        x, u = inputs
        x = self.bn0(x)
        x = torch.tanh(self.linear1(x))
        x = torch.tanh(self.linear2(x))
        V = self.V(x)
        mu = torch.tanh(self.mu(x))
        Q = None
        if u is not None:
            num_outputs = mu.size(1)
            L = self.L(x).view(-1, num_outputs, num_outputs)
            L = L * self.tril_mask.expand_as(L) + torch.exp(L) * self.diag_mask.expand_as(L)
            P = torch.bmm(L, L.transpose(2, 1))
            u_mu = (u - mu).unsqueeze(2)
            A = -0.5 * torch.bmm(torch.bmm(u_mu.transpose(2, 1), P), u_mu)[:, :, 0]
            Q = A + V
        return mu, Q, V


def _c03_setup(bug: bool):
    torch.manual_seed(0)
    space = SimpleNamespace(shape=(1,))
    model = _NAFPolicy(16, 3, space).train()
    target_model = _NAFPolicy(16, 3, space).train()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    _hard_update(target_model, model)
    gamma, tau = 0.99, 0.001
    seen: dict[str, torch.Tensor] = {}

    def update_parameters() -> torch.Tensor:
        _, _, next_state_values = target_model((_C03_NEXT, None))
        reward_batch = _C03_REWARD.unsqueeze(1)
        mask_batch = _C03_MASK.unsqueeze(1)
        if bug:
            expected = reward_batch + (gamma * mask_batch + next_state_values)
        else:
            expected = reward_batch + (gamma * mask_batch * next_state_values)
        seen["target"], seen["next_v"] = expected.detach(), next_state_values.detach()
        _, state_action_values, _ = model((_C03_STATE, _C03_ACTION))
        loss = torch.sum((state_action_values - expected) ** 2) / state_action_values.nelement()
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1)
        optimizer.step()
        _soft_update(target_model, model, tau)
        return loss

    return model, optimizer, update_parameters, seen


def _c03_build(bug: bool) -> Case:
    model, opt, step, _ = _c03_setup(bug)
    return model, step, _kw(optimizer=opt, inputs=(_C03_STATE, _C03_ACTION))


def _c03_proof(bug: bool) -> bool:
    """Is the Q target of a real update anything but r + gamma * mask * V'(s') (for a terminal step: just r)?"""
    _, _, step, seen = _c03_setup(bug)
    step()
    bellman = _C03_REWARD.unsqueeze(1) + 0.99 * _C03_MASK.unsqueeze(1) * seen["next_v"]
    return not torch.allclose(seen["target"], bellman, atol=1e-6)


# --------------------------------------------------------------------------------------------- case-04
# open-edge-platform/physical-ai-studio PR #873 ("fix(smolvla): apply action padding mask in the training loss"):
# SmolVLA's compute_loss reads the end-of-episode padding mask with `batch.get("actions_id_pad")`, but LeRobot's dataset
# emits it as `action_is_pad`. The .get() silently returns None, the `if actions_is_pad is not None` branch never runs,
# and the action-chunk steps past the end of an episode (LeRobot fills them with copies of the last action) are trained
# as real supervision, teaching the policy to freeze at the end of a trajectory. Silent: the flow-matching loss falls
# as usual. Fix in the merged PR: read the mask under the key the dataset actually provides (`action_is_pad`).
# Reproduced on a tiny flow-matching action-chunk head (state -> velocity field over a 6-step, 2-D action chunk).

_C04_B, _C04_CHUNK, _C04_ADIM, _C04_SDIM = 4, 6, 2, 5
_C04_STATE = torch.randn(_C04_B, _C04_SDIM, generator=_gen(3641))
_C04_VALID = [6, 3, 6, 2]  # frames left in the episode for each sample
_C04_ACTION = torch.randn(_C04_B, _C04_CHUNK, _C04_ADIM, generator=_gen(3642))
_C04_PAD = torch.zeros(_C04_B, _C04_CHUNK, dtype=torch.bool)
for _i, _n in enumerate(_C04_VALID):
    _C04_ACTION[_i, _n:] = _C04_ACTION[_i, _n - 1]  # LeRobot clamps the query index: the last action repeated
    _C04_PAD[_i, _n:] = True


class _FlowActionHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(_C04_SDIM + _C04_CHUNK * _C04_ADIM + 1, 64), nn.GELU(),
                                 nn.Linear(64, _C04_CHUNK * _C04_ADIM))

    def forward(self, state, x_t, time):
        h = torch.cat([state, x_t.flatten(1), time[:, None]], dim=-1)
        return self.net(h).view(-1, _C04_CHUNK, _C04_ADIM)


def _c04_loss(model, batch, bug: bool, noise, time):
    actions = batch["action"]
    actions_is_pad = batch.get("actions_id_pad" if bug else "action_is_pad")
    t = time[:, None, None]
    x_t = t * noise + (1 - t) * actions
    u_t = noise - actions
    v_t = model(batch["observation.state"], x_t, time)
    losses = F.mse_loss(u_t, v_t, reduction="none")
    if actions_is_pad is not None:
        in_episode_bound = ~actions_is_pad
        losses = losses * in_episode_bound.unsqueeze(-1)
    losses = losses[:, :, :_C04_ADIM]
    return losses.mean()


def _c04_batch(action: torch.Tensor = _C04_ACTION) -> dict:
    return {"observation.state": _C04_STATE, "action": action, "action_is_pad": _C04_PAD}


def _c04_model() -> nn.Module:
    torch.manual_seed(0)
    return _FlowActionHead().train()


def _c04_build(bug: bool) -> Case:
    model = _c04_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=1e-10)
    batch = _c04_batch()
    gen = _gen(3643)

    def step() -> torch.Tensor:
        noise = torch.randn(_C04_B, _C04_CHUNK, _C04_ADIM, generator=gen)
        time = torch.rand(_C04_B, generator=gen) * 0.999 + 0.001
        opt.zero_grad()
        loss = _c04_loss(model, batch, bug, noise, time)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 10.0)
        opt.step()
        return loss

    return model, step, _kw(optimizer=opt, inputs=batch)


def _c04_proof(bug: bool) -> bool:
    """After a real backward, does the predicted velocity at padded (past-episode-end) steps get any gradient?"""
    model = _c04_model()
    noise = torch.randn(_C04_B, _C04_CHUNK, _C04_ADIM, generator=_gen(3644))
    time = torch.rand(_C04_B, generator=_gen(3645))
    outs: list[torch.Tensor] = []

    def keep(_m, _a, out):
        out.retain_grad()
        outs.append(out)

    model.register_forward_hook(keep)
    _c04_loss(model, _c04_batch(), bug, noise, time).backward()
    return bool(outs[0].grad[_C04_PAD].abs().max() > 0)


# --------------------------------------------------------------------------------------------- case-05
# atomicarchitects/equiformer_v2 issue #12 ("Large performance gap in MD17/22 dataset"): trained with forces from the
# energy gradient (F = -dE/dx, as on MD17), EquiformerV2 lags far behind other models. The author's answer: with
# gradient forces the `.detach()` on the edge rotation matrices (init_edge_rot_mat returns `edge_rot_mat.detach()`,
# and the Wigner-D matrices built from it) must be removed. With the detach, autograd treats each edge's frame as a
# constant, so -dE/dx misses every term through the frame: the "forces" trained against the labels are not the gradient
# of the model's energy (nor rotation-equivariant). Silent: energy and force losses both fall. Fix (the author's
# answer in the thread; the same change later proposed upstream in fairchem PR #779): return the rotation matrix
# without detaching it.
# Reproduced on a tiny edge-frame energy model: each edge vector is rotated into its own frame (built from the edge
# direction and a fixed helper axis, as init_edge_rot_mat does) and an MLP of the rotated vector and the two atom types
# gives the edge energy.

_C05_B, _C05_N = 4, 5
_C05_POS = torch.randn(_C05_B, _C05_N, 3, generator=_gen(3651)) * 1.5
_C05_Z = torch.tensor([0, 1, 1, 2, 0])
_C05_E = torch.randn(_C05_B, generator=_gen(3652))
_C05_F = torch.randn(_C05_B, _C05_N, 3, generator=_gen(3653))
_C05_I, _C05_J = torch.tensor([[i, j] for i in range(_C05_N) for j in range(_C05_N) if i != j]).T


def _edge_rot_mat(edge_vec: torch.Tensor, detach: bool) -> torch.Tensor:
    e1 = edge_vec / edge_vec.norm(dim=-1, keepdim=True)
    helper = torch.tensor([0.3, 0.5, 0.81], dtype=edge_vec.dtype).expand_as(e1)
    e2 = helper - (helper * e1).sum(-1, keepdim=True) * e1
    e2 = e2 / e2.norm(dim=-1, keepdim=True)
    e3 = torch.cross(e1, e2, dim=-1)
    rot = torch.stack([e1, e2, e3], dim=-2)  # rows: the edge frame, rot @ edge_vec = (|r|, 0, 0)
    return rot.detach() if detach else rot


class _EdgeFrameEnergy(nn.Module):
    def __init__(self, detach_rot: bool):
        super().__init__()
        self.detach_rot = detach_rot
        self.emb = nn.Embedding(3, 8)
        self.mlp = nn.Sequential(nn.Linear(3 + 16, 32), nn.SiLU(), nn.Linear(32, 1))

    def forward(self, pos: torch.Tensor) -> torch.Tensor:
        edge_vec = pos[:, _C05_J] - pos[:, _C05_I]  # (B, E, 3)
        rot = _edge_rot_mat(edge_vec, self.detach_rot)
        local = (rot @ edge_vec.unsqueeze(-1)).squeeze(-1)
        zi = self.emb(_C05_Z[_C05_I]).expand(pos.shape[0], -1, -1)
        zj = self.emb(_C05_Z[_C05_J]).expand(pos.shape[0], -1, -1)
        return self.mlp(torch.cat([local, zi, zj], dim=-1)).squeeze(-1).sum(-1)


def _c05_model(bug: bool) -> nn.Module:
    torch.manual_seed(0)
    return _EdgeFrameEnergy(detach_rot=bug).train()


def _c05_build(bug: bool) -> Case:
    model = _c05_model(bug)
    opt = torch.optim.AdamW(model.parameters(), lr=5e-4, weight_decay=0.0)

    def step() -> torch.Tensor:
        opt.zero_grad()
        pos = _C05_POS.clone().requires_grad_(True)
        energy = model(pos)
        forces = -torch.autograd.grad(energy.sum(), pos, create_graph=True)[0]
        loss = F.l1_loss(energy, _C05_E) + 100.0 * F.l1_loss(forces, _C05_F)
        loss.backward()
        opt.step()
        return loss

    return model, step, _kw(optimizer=opt, inputs=_C05_POS)


def _c05_proof(bug: bool) -> bool:
    """Do the trained forces (-dE/dx by autograd) disagree with a finite difference of the model's own energy?"""
    model = _c05_model(bug).double()
    pos = _C05_POS.double().clone().requires_grad_(True)
    forces = -torch.autograd.grad(model(pos).sum(), pos)[0]
    h = 1e-5
    fd = torch.zeros_like(forces)
    with torch.no_grad():
        for a in range(_C05_N):
            for d in range(3):
                plus, minus = _C05_POS.double().clone(), _C05_POS.double().clone()
                plus[:, a, d] += h
                minus[:, a, d] -= h
                fd[:, a, d] = -(model(plus) - model(minus)) / (2 * h)
    return not torch.allclose(forces, fd, atol=1e-6, rtol=1e-5)


CASES: list[BlindCase] = [
    BlindCase("b36c-01", "https://github.com/rollovd/LookSAM/issues/3", "SAM gradients accumulated, not replaced",
              "LookSAM never clears the first gradient before the backward at the perturbed weights, so the base "
              "optimizer steps with g(w) + g(w + e) instead of the sharpness-aware gradient.", _c01_build, _c01_proof),
    BlindCase("b36c-02", "https://github.com/OpenMined/PySyft/pull/4595", "federated average includes random model",
              "federated_avg starts its sum from a freshly initialised random model, so every round's global model "
              "is (random + sum of clients) / N rather than the clients' mean.", _c02_build, _c02_proof,
              known_miss="a federated average seeded with a fresh random model: the step writes the model's weights from copies, whose arithmetic is not judged"),
    BlindCase("b36c-03", "https://github.com/ikostrikov/pytorch-ddpg-naf/issues/16", "TD target adds instead of multiplies",
              "The NAF Q target is r + (gamma * mask + V') instead of r + gamma * mask * V', so targets are shifted "
              "by gamma and terminal transitions still bootstrap.", _c03_build, _c03_proof,
              known_miss="a TD target that adds the done mask instead of multiplying: the target's arithmetic is outside the model"),
    BlindCase("b36c-04", "https://github.com/open-edge-platform/physical-ai-studio/pull/873",
              "padding mask read under wrong key",
              "The policy loss looks up the action padding mask under a key the dataset never provides, so padded "
              "past-episode-end action steps are trained as real supervision.", _c04_build, _c04_proof,
              known_miss="a padding mask read under a key the model never looks up: which key a config means is not in the step"),
    BlindCase("b36c-05", "https://github.com/atomicarchitects/equiformer_v2/issues/12",
              "detached frame breaks gradient forces",
              "The edge rotation matrices are detached, so forces taken as -dE/dx by autograd miss the terms through "
              "each edge frame and are not the gradient of the model's energy.", _c05_build, _c05_proof,
              known_miss="a detached frame that breaks the force gradient: which terms of an energy model need second-order paths is not judged"),
]
