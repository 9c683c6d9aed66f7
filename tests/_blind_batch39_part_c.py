"""Blind batch 39 (part c): silent training bugs from other domains and the training loop, each with its fixed twin.

Collected by someone who does not write the audit's checks. Every case builds the user's setup on a tiny model
(a DQN on plain torch MLPs, a bf16 GPT-2 from a tiny config in code behind a mixed-precision optimizer with fp32
main weights, a BPR matrix factorisation, a chemprop-style atom-message MPNN on molecules written out in code, a
character RNN; nothing is downloaded) and proves the bug without the audit on real tensors and real steps.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tests._blind import BlindCase, Case
from tests._blind_batch5 import _gen, _kw

# --------------------------------------------------------------------------------------------- case-01
# rail-berkeley/rlkit PR #114: DQNTrainer (and DoubleDQNTrainer) update the target network when
# `self._n_train_steps_total % self.target_update_period == 0`, but `train_from_torch` never incremented
# `_n_train_steps_total`. The counter stays 0, so the condition is true on every step: with a hard update
# (soft_target_tau=1) and target_update_period=1000 the target Q-network is overwritten with the online one after
# every gradient step, and the TD target is bootstrapped from the network being trained. The Q loss still falls and
# nothing fails; the "fixed target" just is not there. Fix in the PR: `self._n_train_steps_total += 1` at the end of
# each training step (as SAC/TD3 trainers already did).

_C01_OBS = torch.randn(32, 4, generator=_gen(3901))
_C01_NEXT_OBS = torch.randn(32, 4, generator=_gen(3902))
_C01_ACTIONS = F.one_hot(torch.randint(0, 2, (32,), generator=_gen(3903)), 2).float()
_C01_REWARDS = torch.randn(32, 1, generator=_gen(3904))
_C01_TERMINALS = (torch.rand(32, 1, generator=_gen(3905)) < 0.1).float()
_C01_BATCH = {"observations": _C01_OBS, "actions": _C01_ACTIONS, "rewards": _C01_REWARDS,
              "terminals": _C01_TERMINALS, "next_observations": _C01_NEXT_OBS}


def _c01_mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 2))


class _C01Networks(nn.Module):
    """The trainer's networks (rlkit's `trainer.networks`): the online and the target Q-function."""

    def __init__(self) -> None:
        super().__init__()
        self.qf = _c01_mlp()
        self.target_qf = _c01_mlp()  # built separately, as in rlkit's examples/dqn_and_double_dqn.py

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return self.qf(obs)


def _c01_soft_update_from_to(source: nn.Module, target: nn.Module, tau: float) -> None:
    for target_param, param in zip(target.parameters(), source.parameters()):
        target_param.data.copy_(target_param.data * (1.0 - tau) + param.data * tau)


class _C01DQNTrainer:
    def __init__(self, nets: _C01Networks, fixed: bool, learning_rate: float = 1e-3, soft_target_tau: float = 1.0,
                 target_update_period: int = 1000, discount: float = 0.99) -> None:
        self.qf, self.target_qf = nets.qf, nets.target_qf
        self.soft_target_tau = soft_target_tau
        self.target_update_period = target_update_period
        self.qf_optimizer = torch.optim.Adam(self.qf.parameters(), lr=learning_rate)
        self.discount = discount
        self.qf_criterion = nn.MSELoss()
        self._n_train_steps_total = 0
        self._fixed = fixed

    def train_from_torch(self, batch: dict) -> torch.Tensor:
        rewards, terminals = batch["rewards"], batch["terminals"]
        obs, actions, next_obs = batch["observations"], batch["actions"], batch["next_observations"]
        target_q_values = self.target_qf(next_obs).detach().max(1, keepdim=True)[0]
        y_target = (rewards + (1.0 - terminals) * self.discount * target_q_values).detach()
        y_pred = torch.sum(self.qf(obs) * actions, dim=1, keepdim=True)
        qf_loss = self.qf_criterion(y_pred, y_target)

        self.qf_optimizer.zero_grad()
        qf_loss.backward()
        self.qf_optimizer.step()

        if self._n_train_steps_total % self.target_update_period == 0:
            _c01_soft_update_from_to(self.qf, self.target_qf, self.soft_target_tau)
        if self._fixed:
            self._n_train_steps_total += 1
        return qf_loss


def _c01_setup(bug: bool):
    torch.manual_seed(0)
    nets = _C01Networks().train()
    trainer = _C01DQNTrainer(nets, fixed=not bug)
    return nets, trainer


def _c01_build(bug: bool) -> Case:
    nets, trainer = _c01_setup(bug)

    def step() -> torch.Tensor:
        return trainer.train_from_torch(_C01_BATCH)

    return nets, step, _kw(optimizer=trainer.qf_optimizer, inputs=_C01_BATCH)


def _c01_proof(bug: bool) -> bool:
    """Three steps with target_update_period=1000: is the target network still a copy of the online one?"""
    nets, trainer = _c01_setup(bug)
    for _ in range(3):
        trainer.train_from_torch(_C01_BATCH)
    return all(torch.equal(t, q) for t, q in zip(nets.target_qf.parameters(), nets.qf.parameters()))


# --------------------------------------------------------------------------------------------- case-02
# databricks/megablocks issue #80 (fix: stanford-futuredata/Megatron-LM PR #5): Megatron builds the model and its
# mixed-precision optimizer first (the optimizer keeps fp32 "main" copies of the half-precision weights) and loads
# the checkpoint afterwards. `load_checkpoint` then re-syncs the main copies with `optimizer.reload_model_params()`,
# but only under `if args.fp16 and optimizer is not None`. With --bf16 the reload is skipped: the main weights stay
# the random initialisation, and the first optimizer step copies them (plus one update) back into the model, so
# "continued training from pretrained weights" silently restarts from scratch. The loss looks like a normal
# from-scratch run. Fix: `if (args.fp16 or args.bf16) and optimizer is not None: optimizer.reload_model_params()`.

_C02_IDS = torch.randint(0, 64, (4, 16), generator=_gen(3911))


def _c02_gpt2(seed: int):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2, bos_token_id=1,
                     eos_token_id=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(cfg).to(torch.bfloat16).train()


class _C02MixedPrecisionAdam(torch.optim.Adam):
    """Megatron's Float16OptimizerWithFloat16Params in one class: Adam on fp32 main copies of the bf16 weights."""

    def __init__(self, model: nn.Module, lr: float) -> None:
        self.model_params = [p for p in model.parameters() if p.requires_grad]
        main = [p.detach().clone().float().requires_grad_(True) for p in self.model_params]
        super().__init__(main, lr=lr)
        self.main_params = main

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.model_params:
            p.grad = None
        super().zero_grad(set_to_none=set_to_none)

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        for main, p in zip(self.main_params, self.model_params):  # copy model grads to main grads
            main.grad = None if p.grad is None else p.grad.float()
        super().step()
        for main, p in zip(self.main_params, self.model_params):  # copy main params back to the model
            p.copy_(main)

    @torch.no_grad()
    def reload_model_params(self) -> None:
        for main, p in zip(self.main_params, self.model_params):
            main.copy_(p)


def _c02_setup(bug: bool):
    checkpoint = {k: v.clone() for k, v in _c02_gpt2(1).state_dict().items()}  # the pretrained bf16 checkpoint
    model = _c02_gpt2(0)  # setup_model_and_optimizer: model, then optimizer, then load_checkpoint
    opt = _C02MixedPrecisionAdam(model, lr=1e-4)
    init = {k: v.clone() for k, v in model.state_dict().items()}
    model.load_state_dict(checkpoint)
    fp16, bf16 = False, True
    if (fp16 if bug else (fp16 or bf16)) and opt is not None:
        opt.reload_model_params()
    return model, opt, checkpoint, init


def _c02_build(bug: bool) -> Case:
    model, opt, _, _ = _c02_setup(bug)
    batch = {"input_ids": _C02_IDS, "labels": _C02_IDS}

    def step() -> torch.Tensor:
        opt.zero_grad()
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        return loss

    return model, step, _kw(optimizer=opt, inputs=batch)


def _c02_proof(bug: bool) -> bool:
    """After one step from the loaded checkpoint, is the model nearer its random init than the checkpoint?"""
    model, opt, checkpoint, init = _c02_setup(bug)
    opt.zero_grad()
    model(input_ids=_C02_IDS, labels=_C02_IDS).loss.backward()
    opt.step()
    name = "transformer.h.0.mlp.c_fc.weight"
    w = model.state_dict()[name].float()
    d_ckpt = (w - checkpoint[name].float()).abs().mean()
    d_init = (w - init[name].float()).abs().mean()
    return bool(d_init < d_ckpt)


# --------------------------------------------------------------------------------------------- case-03
# benfred/implicit PR #103: BPR samples a (user, liked item) pair and a "negative" item j, and raises the liked
# item's score above j's. The negative was drawn without checking that the user had not liked it, so a sizeable
# fraction of triples (18% on MovieLens-100k, per the PR) trains the model to rank one of the user's own liked items
# below another. Training runs and the loss falls; P@10 roughly halves (0.083 vs 0.164 on ML-100k). Fix in the PR:
# verify each sampled negative and skip the sample when the user has liked it (`verify_negative_samples`).

_C03_USERS, _C03_ITEMS = 8, 12
_C03_LIKED = torch.rand(_C03_USERS, _C03_ITEMS, generator=_gen(3921)) < 0.4
_C03_USERIDS, _C03_ITEMIDS = _C03_LIKED.nonzero(as_tuple=True)


def _c03_triples(bug: bool):
    """implicit's sampler: a random liked (u, i), and j = the item of another random liked entry."""
    g = _gen(3922)
    n = _C03_USERIDS.numel()
    liked_index = torch.randint(0, n, (64,), generator=g)
    users, liked = _C03_USERIDS[liked_index], _C03_ITEMIDS[liked_index]
    disliked = _C03_ITEMIDS[torch.randint(0, n, (64,), generator=g)]
    if not bug:  # verify_negative_samples: skip samples whose negative the user has liked
        keep = ~_C03_LIKED[users, disliked]
        users, liked, disliked = users[keep], liked[keep], disliked[keep]
    return users, liked, disliked


class _C03BPR(nn.Module):
    def __init__(self, factors: int = 8) -> None:
        super().__init__()
        self.user_factors = nn.Embedding(_C03_USERS, factors)
        self.item_factors = nn.Embedding(_C03_ITEMS, factors)
        nn.init.normal_(self.user_factors.weight, std=0.1)
        nn.init.normal_(self.item_factors.weight, std=0.1)

    def forward(self, users: torch.Tensor, items: torch.Tensor) -> torch.Tensor:
        return (self.user_factors(users) * self.item_factors(items)).sum(-1)


def _c03_build(bug: bool) -> Case:
    torch.manual_seed(0)
    model = _C03BPR().train()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    users, liked, disliked = _c03_triples(bug)
    reg = 0.01

    def step() -> torch.Tensor:
        opt.zero_grad()
        x_uij = model(users, liked) - model(users, disliked)
        loss = -F.logsigmoid(x_uij).mean() + reg * (model.user_factors(users).pow(2).sum(-1)
                                                    + model.item_factors(liked).pow(2).sum(-1)
                                                    + model.item_factors(disliked).pow(2).sum(-1)).mean()
        loss.backward()
        opt.step()
        return loss

    return model, step, _kw(optimizer=opt, inputs=(users, liked, disliked))


def _c03_proof(bug: bool) -> bool:
    """Does a step push down the score of an item its user liked (one trained as that user's negative)?"""
    model, step, _ = _c03_build(bug)
    users, liked, disliked = _c03_triples(bug)
    bad = _C03_LIKED[users, disliked]
    if not bool(bad.any()):
        return False
    u, j = users[bad], disliked[bad]
    before = model(u, j).detach()
    step()
    after = model(u, j).detach()
    return bool((after < before).any())


# --------------------------------------------------------------------------------------------- case-04
# chemprop/chemprop PR #138 (from issue #133): each bond's feature row is concat(atom features of its source atom
# (133), bond features (14)). With `atom_messages=True`, `BatchMolGraph.get_components` cut the bond features out as
# `f_bonds[:, :get_bond_fdim(atom_messages)]`, i.e. the FIRST 14 columns, which are the first slots of the source
# atom's atomic-number one-hot, instead of the last 14. The MPNN trains and predicts normally but never sees bond
# type, conjugation, ring or stereo: Delaney RMSE 1.02 vs 0.82 after the fix. Fix in the PR: `f_bonds[:, -bond_fdim:]`.

_C04_ATOM_FDIM, _C04_BOND_FDIM = 133, 14
# heavy-atom molecules written out: (atomic number, total degree, num Hs, hybridisation index), bonds (a1, a2, type)
_C04_MOLS = [
    ([(6, 4, 3, 2), (6, 4, 2, 2), (8, 2, 1, 2)], [(0, 1, 1), (1, 2, 1)]),  # ethanol
    ([(6, 4, 3, 2), (6, 3, 1, 1), (8, 1, 0, 1)], [(0, 1, 1), (1, 2, 2)]),  # acetaldehyde
    ([(6, 4, 3, 2), (6, 2, 0, 0), (7, 1, 0, 0)], [(0, 1, 1), (1, 2, 3)]),  # acetonitrile
    ([(6, 3, 2, 1), (6, 3, 2, 1)], [(0, 1, 2)]),  # ethylene
]
_C04_Y = torch.randn(len(_C04_MOLS), 1, generator=_gen(3931))
_C04_MASS = {6: 12.011, 7: 14.007, 8: 15.999}


def _c04_onek(value: int, n_choices: int) -> list[float]:
    enc = [0.0] * (n_choices + 1)
    enc[value if 0 <= value < n_choices else -1] = 1.0
    return enc


def _c04_atom_features(z: int, degree: int, n_h: int, hyb: int) -> list[float]:
    return (_c04_onek(z - 1, 100) + _c04_onek(degree, 6) + _c04_onek(4, 5) + _c04_onek(0, 4) + _c04_onek(n_h, 5)
            + _c04_onek(hyb, 5) + [0.0] + [_C04_MASS[z] * 0.01])


def _c04_bond_features(bond_type: int) -> list[float]:
    return [0.0, float(bond_type == 1), float(bond_type == 2), float(bond_type == 3), 0.0,
            float(bond_type > 1), 0.0] + _c04_onek(0, 6)


def _c04_batch_mol_graph() -> dict:
    f_atoms, f_bonds = [[0.0] * _C04_ATOM_FDIM], [[0.0] * (_C04_ATOM_FDIM + _C04_BOND_FDIM)]
    a2b: list[list[int]] = [[]]
    b2a, scope = [0], []
    for atoms, bonds in _C04_MOLS:
        a0, feats = len(f_atoms), [_c04_atom_features(*a) for a in atoms]
        f_atoms.extend(feats)
        a2b.extend([] for _ in atoms)
        for a1, a2, bt in bonds:
            fb = _c04_bond_features(bt)
            for src, dst in ((a1, a2), (a2, a1)):
                a2b[a0 + dst].append(len(f_bonds))
                b2a.append(a0 + src)
                f_bonds.append(feats[src] + fb)
        scope.append((a0, len(atoms)))
    width = max(len(x) for x in a2b)
    return {"f_atoms": torch.tensor(f_atoms), "f_bonds": torch.tensor(f_bonds),
            "a2b": torch.tensor([x + [0] * (width - len(x)) for x in a2b]), "b2a": torch.tensor(b2a),
            "a_scope": torch.tensor(scope)}


_C04_GRAPH = _c04_batch_mol_graph()


def _c04_components(graph: dict, bug: bool):
    """BatchMolGraph.get_components(atom_messages=True)."""
    f_bonds = graph["f_bonds"][:, :_C04_BOND_FDIM] if bug else graph["f_bonds"][:, -_C04_BOND_FDIM:]
    return graph["f_atoms"], f_bonds, graph["a2b"], graph["b2a"], graph["a_scope"]


def _c04_index_select_nd(source: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return source.index_select(0, index.view(-1)).view(index.size() + source.size()[1:])


class _C04MoleculeModel(nn.Module):
    """chemprop MPNEncoder(atom_messages=True) + FFN."""

    def __init__(self, bug: bool, hidden: int = 32, depth: int = 3) -> None:
        super().__init__()
        self.bug, self.depth = bug, depth
        self.W_i = nn.Linear(_C04_ATOM_FDIM, hidden, bias=False)
        self.W_h = nn.Linear(hidden + _C04_BOND_FDIM, hidden, bias=False)
        self.W_o = nn.Linear(_C04_ATOM_FDIM + hidden, hidden)
        self.ffn = nn.Sequential(nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 1))

    def forward(self, graph: dict) -> torch.Tensor:
        f_atoms, f_bonds, a2b, b2a, a_scope = _c04_components(graph, self.bug)
        a2a = b2a[a2b]
        inp = self.W_i(f_atoms)
        message = F.relu(inp)
        for _ in range(self.depth - 1):
            nei_a_message = _c04_index_select_nd(message, a2a)
            nei_f_bonds = _c04_index_select_nd(f_bonds, a2b)
            message = torch.cat((nei_a_message, nei_f_bonds), dim=2).sum(dim=1)
            message = F.relu(inp + self.W_h(message))
        a_message = _c04_index_select_nd(message, a2a).sum(dim=1)
        atom_hiddens = F.relu(self.W_o(torch.cat([f_atoms, a_message], dim=1)))
        mol_vecs = torch.stack([atom_hiddens[int(s):int(s) + int(n)].mean(0) for s, n in a_scope])
        return self.ffn(mol_vecs)


def _c04_build(bug: bool) -> Case:
    torch.manual_seed(0)
    model = _C04MoleculeModel(bug).train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)

    def step() -> torch.Tensor:
        opt.zero_grad()
        loss = F.mse_loss(model(_C04_GRAPH), _C04_Y)
        loss.backward()
        opt.step()
        return loss

    return model, step, _kw(optimizer=opt, inputs=_C04_GRAPH)


def _c04_proof(bug: bool) -> bool:
    """Is the prediction blind to the bond features (zero gradient on every true bond-feature column)?"""
    torch.manual_seed(0)
    model = _C04MoleculeModel(bug).train()
    graph = dict(_C04_GRAPH)
    graph["f_bonds"] = _C04_GRAPH["f_bonds"].clone().requires_grad_(True)
    F.mse_loss(model(graph), _C04_Y).backward()
    return bool(graph["f_bonds"].grad[:, _C04_ATOM_FDIM:].abs().sum() == 0)


# --------------------------------------------------------------------------------------------- case-05
# ShusenTang/Dive-into-DL-PyTorch issue #101: the concise RNN chapter (6.5) calls
# `d2l.grad_clipping(model.parameters(), clipping_theta, device)`. `grad_clipping` loops over `params` twice, once
# to compute the global norm and once to rescale; `model.parameters()` is a generator, exhausted by the first loop,
# so the rescaling loop never runs and the gradients are never clipped (theta=1e-2 in the book). Training goes on
# with raw gradients and no error. Fix in the thread: pass `list(model.parameters())`.

_C05_VOCAB, _C05_STEPS, _C05_BATCH = 16, 8, 4
_C05_CORPUS = torch.randint(0, _C05_VOCAB, (_C05_BATCH, _C05_STEPS + 1), generator=_gen(3941))
_C05_X, _C05_Y = _C05_CORPUS[:, :-1], _C05_CORPUS[:, 1:]
_C05_THETA = 1e-2


class _C05RNNModel(nn.Module):
    def __init__(self, hidden: int = 32) -> None:
        super().__init__()
        self.rnn = nn.RNN(input_size=_C05_VOCAB, hidden_size=hidden)
        self.dense = nn.Linear(hidden, _C05_VOCAB)

    def forward(self, inputs: torch.Tensor, state=None):
        X = F.one_hot(inputs.T, _C05_VOCAB).float()  # (num_steps, batch, vocab), d2l's to_onehot stacked
        Y, state = self.rnn(X, state)
        return self.dense(Y.reshape(-1, Y.shape[-1])), state


def _c05_grad_clipping(params, theta: float) -> None:
    """d2l.grad_clipping, verbatim in logic."""
    norm = torch.tensor([0.0])
    for param in params:
        norm += (param.grad.data ** 2).sum()
    norm = norm.sqrt().item()
    if norm > theta:
        for param in params:
            param.grad.data *= theta / norm


def _c05_setup(bug: bool):
    torch.manual_seed(0)
    model = _C05RNNModel().train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    loss_fn = nn.CrossEntropyLoss()

    def backward_and_clip() -> torch.Tensor:
        output, _ = model(_C05_X, None)  # state starts at None, as at the start of each epoch
        y = _C05_Y.T.contiguous().view(-1)
        loss = loss_fn(output, y.long())
        opt.zero_grad()
        loss.backward()
        _c05_grad_clipping(model.parameters() if bug else list(model.parameters()), _C05_THETA)
        return loss

    return model, opt, backward_and_clip


def _c05_build(bug: bool) -> Case:
    model, opt, backward_and_clip = _c05_setup(bug)

    def step() -> torch.Tensor:
        loss = backward_and_clip()
        opt.step()
        return loss

    return model, step, _kw(optimizer=opt, inputs=_C05_X)


def _c05_proof(bug: bool) -> bool:
    """After the clipping call, is the global gradient norm still above clipping_theta?"""
    model, _, backward_and_clip = _c05_setup(bug)
    backward_and_clip()
    norm = torch.sqrt(sum((p.grad ** 2).sum() for p in model.parameters()))
    return bool(norm > _C05_THETA * 1.01)


CASES: list[BlindCase] = [
    BlindCase("b39c-01", "https://github.com/rail-berkeley/rlkit/pull/114", "target network copied every step",
              "The DQN trainer never increments its step counter, so the every-1000-steps hard target update fires "
              "on every step and the target Q-network is always a copy of the online one.", _c01_build, _c01_proof,
              known_miss="a target network copied every step: a copy's sync cadence is not seen in one step"),
    BlindCase("b39c-02", "https://github.com/databricks/megablocks/issues/80", "bf16 main weights not reloaded",
              "With bf16 the fp32 main weights are not re-synced after loading the checkpoint, so the first step "
              "writes the random initialisation back into the model and training restarts from scratch.",
              _c02_build, _c02_proof),
    BlindCase("b39c-03", "https://github.com/benfred/implicit/pull/103", "BPR negatives include liked items",
              "BPR draws negatives without checking the user's likes, so some triples train a user's liked item "
              "to score below another liked item.", _c03_build, _c03_proof,
              known_miss="BPR negatives that include liked items: which items are negatives is data semantics"),
    BlindCase("b39c-04", "https://github.com/chemprop/chemprop/pull/138", "wrong bond feature slice",
              "With atom messages the bond features are sliced from the front of the concatenated row, so the MPNN "
              "gets atomic-number one-hot slots instead of bond features and never sees bond type.",
              _c04_build, _c04_proof,
              known_miss="the wrong slice of bond features: which columns a feature is is data semantics"),
    BlindCase("b39c-05", "https://github.com/ShusenTang/Dive-into-DL-PyTorch/issues/101",
              "gradient clipping silently skipped",
              "grad_clipping gets a parameters() generator that its norm loop exhausts, so the rescaling loop never "
              "runs and the RNN trains on unclipped gradients.", _c05_build, _c05_proof,
              known_miss="a hand-written clipping over an exhausted generator: a clip the step never applies is not seen when no clip function of torch is called"),
]
