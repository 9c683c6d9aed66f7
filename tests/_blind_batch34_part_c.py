"""Blind batch 34 (part c): silent training-loop bugs across domains from public GitHub threads, each with its fixed twin.

Collected by someone who does not write the audit's checks. Every case builds the user's setup on a tiny plain-torch
model (a REINFORCE policy on a toy control task, a Deep Interest Network click-through model, a GSAT graph explainer
over a GIN, VAME's recurrent VAE on pose time series, a wekws keyword spotter; nothing is downloaded) and proves the
bug without the audit on real tensors and real steps.
"""

from __future__ import annotations

import copy
from collections import deque

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributions import Categorical
from torch.optim.lr_scheduler import StepLR

from tests._blind import BlindCase, Case
from tests._blind_batch5 import _gen, _kw

# --------------------------------------------------------------------------------------------- case-01
# huggingface/deep-rl-class PR #95 (reinforcement learning): the course's REINFORCE hands-on computed one discounted
# return of the whole episode, `R = sum(gamma**i * r_i)`, and weighted every step's log-probability by it
# (`policy_loss.append(-log_prob * R)`), i.e. sum_t G_0 * log pi(a_t|s_t). Every action is credited with rewards that
# were earned before it was taken; the loss still falls and CartPole still learns, only slowly and noisily. Fix in the
# PR: compute the reward-to-go G_t for every step (a deque filled from the last step backwards), standardise the
# returns, and weight each log-probability by its own G_t.

_C01_MAX_T = 16


class _C01Balance:
    """A tiny unstable balancing task (pole-like drift): +1 reward a step until |x| > 2 or max_t steps."""

    def reset(self, x0: float) -> torch.Tensor:
        self.x, self.v, self.t = x0, 0.0, 0
        return self._obs()

    def step(self, action: int) -> tuple[torch.Tensor, float, bool]:
        self.v += (0.3 if action == 1 else -0.3) + 0.25 * self.x
        self.x += 0.5 * self.v
        self.t += 1
        return self._obs(), 1.0, abs(self.x) > 2.0

    def _obs(self) -> torch.Tensor:
        return torch.tensor([self.x, self.v, self.x * self.v, self.t / _C01_MAX_T])


class _C01Policy(nn.Module):
    def __init__(self, s_size: int = 4, a_size: int = 2, h_size: int = 16) -> None:
        super().__init__()
        self.fc1 = nn.Linear(s_size, h_size)
        self.fc2 = nn.Linear(h_size, a_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.softmax(self.fc2(F.relu(self.fc1(x))), dim=1)

    def act(self, state: torch.Tensor, gen: torch.Generator) -> tuple[int, torch.Tensor]:
        probs = self.forward(state.unsqueeze(0))
        m = Categorical(probs)
        action = torch.multinomial(probs.detach(), 1, generator=gen).view(1)  # m.sample(), seeded
        return int(action.item()), m.log_prob(action)


def _c01_rollout(policy: _C01Policy, env: _C01Balance, gen: torch.Generator):
    saved_log_probs, rewards = [], []
    state = env.reset(float(torch.empty(()).uniform_(-0.1, 0.1, generator=gen)))
    for _ in range(_C01_MAX_T):
        action, log_prob = policy.act(state, gen)
        saved_log_probs.append(log_prob)
        state, reward, done = env.step(action)
        rewards.append(reward)
        if done:
            break
    return saved_log_probs, rewards


def _c01_policy_loss(saved_log_probs, rewards, bug: bool, gamma: float = 1.0) -> torch.Tensor:
    policy_loss = []
    if bug:
        discounts = [gamma**i for i in range(len(rewards) + 1)]
        R = sum(a * b for a, b in zip(discounts, rewards))
        for log_prob in saved_log_probs:
            policy_loss.append(-log_prob * R)
    else:
        returns: deque = deque(maxlen=_C01_MAX_T)
        for t in range(len(rewards))[::-1]:
            disc_return_t = returns[0] if len(returns) > 0 else 0
            returns.appendleft(gamma * disc_return_t + rewards[t])
        eps = torch.finfo(torch.float32).eps
        ret = torch.tensor(returns)
        ret = (ret - ret.mean()) / (ret.std() + eps)
        for log_prob, disc_return in zip(saved_log_probs, ret):
            policy_loss.append(-log_prob * disc_return)
    return torch.cat(policy_loss).sum()


def _c01_setup(bug: bool):
    torch.manual_seed(0)
    policy = _C01Policy()
    opt = torch.optim.Adam(policy.parameters(), lr=1e-2)
    env, gen = _C01Balance(), _gen(3401)

    def step() -> torch.Tensor:
        saved_log_probs, rewards = _c01_rollout(policy, env, gen)
        policy_loss = _c01_policy_loss(saved_log_probs, rewards, bug)
        opt.zero_grad()
        policy_loss.backward()
        opt.step()
        return policy_loss

    return policy, opt, env, gen, step


def _c01_build(bug: bool) -> Case:
    policy, opt, _, _, step = _c01_setup(bug)
    return policy, step, _kw(optimizer=opt)


def _c01_proof(bug: bool) -> bool:
    """Is every step's log-probability weighted by the same return, whatever came after it (no reward-to-go)?"""
    policy, _, env, gen, _ = _c01_setup(bug)
    saved_log_probs, rewards = _c01_rollout(policy, env, gen)
    assert len(rewards) >= 3
    loss = _c01_policy_loss(saved_log_probs, rewards, bug)
    grads = torch.autograd.grad(loss, saved_log_probs)
    weights = torch.stack([-g.reshape(()) for g in grads])  # what each action's log-prob is multiplied by
    return bool((weights.max() - weights.min()).abs() < 1e-6)


# --------------------------------------------------------------------------------------------- case-02
# shenweichen/DeepCTR-Torch issue #128 (recommendation): DIN's forward built the behaviour-sequence lengths as
# `keys_length = torch.ones((B, 1))` instead of reading each user's history length. The attention pooling masks every
# key at position >= keys_length, so the target-aware attention only ever sees the FIRST item of the user's history;
# the rest of the behaviour sequence never reaches the prediction, while the click-through loss trains normally. Fix
# (commit 61b5775, "fix bug in #128"): take keys_length from the sequence's length column (`maxlen_lookup`) and pass the
# real lengths to the attention layer. (Sizes shrunk from the example; Dice replaced by sigmoid in the attention MLP.)

_C02_B, _C02_T = 6, 4
_C02_USER = torch.arange(_C02_B) % 3
_C02_GENDER = torch.tensor([0, 1, 0, 1, 1, 0])
_C02_ITEM = torch.randint(1, 8, (_C02_B,), generator=_gen(3411))
_C02_IGENDER = torch.randint(1, 3, (_C02_B,), generator=_gen(3412))
_C02_LEN = torch.tensor([3, 3, 2, 4, 2, 3])
_C02_PAD = torch.arange(_C02_T)[None, :] >= _C02_LEN[:, None]
_C02_HIST = torch.randint(1, 8, (_C02_B, _C02_T), generator=_gen(3413)).masked_fill(_C02_PAD, 0)
_C02_HGENDER = torch.randint(1, 3, (_C02_B, _C02_T), generator=_gen(3414)).masked_fill(_C02_PAD, 0)
_C02_SCORE = torch.rand(_C02_B, 1, generator=_gen(3415))
_C02_Y = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0])


class _C02LocalActivationUnit(nn.Module):
    def __init__(self, hidden_units=(16, 8), embedding_dim: int = 16) -> None:
        super().__init__()
        dims = [4 * embedding_dim, *hidden_units]
        self.dnn = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims[:-1], dims[1:]))
        self.dense = nn.Linear(hidden_units[-1], 1)

    def forward(self, query: torch.Tensor, user_behavior: torch.Tensor) -> torch.Tensor:
        queries = query.expand(-1, user_behavior.size(1), -1)
        x = torch.cat([queries, user_behavior, queries - user_behavior, queries * user_behavior], dim=-1)
        for lin in self.dnn:
            x = torch.sigmoid(lin(x))
        return self.dense(x)  # [B, T, 1]


class _C02AttentionSequencePoolingLayer(nn.Module):
    def __init__(self, embedding_dim: int = 16) -> None:
        super().__init__()
        self.local_att = _C02LocalActivationUnit(embedding_dim=embedding_dim)

    def forward(self, query, keys, keys_length):
        batch_size, max_length, _ = keys.size()
        keys_masks = torch.arange(max_length, dtype=keys_length.dtype).repeat(batch_size, 1)  # [B, T]
        keys_masks = (keys_masks < keys_length.view(-1, 1)).unsqueeze(1)  # [B, 1, T]
        outputs = self.local_att(query, keys).transpose(1, 2)  # [B, 1, T]
        outputs = torch.where(keys_masks, outputs, torch.zeros_like(outputs))  # weight_normalization=False
        return torch.matmul(outputs, keys)  # [B, 1, E]


class _C02DIN(nn.Module):
    def __init__(self, bug: bool) -> None:
        super().__init__()
        self.bug = bug
        self.embedding_dict = nn.ModuleDict({
            "user": nn.Embedding(3, 8), "gender": nn.Embedding(2, 8), "item": nn.Embedding(8, 8),
            "item_gender": nn.Embedding(3, 8), "hist_item": nn.Embedding(8, 8), "hist_item_gender": nn.Embedding(3, 8)})
        for e in self.embedding_dict.values():
            nn.init.normal_(e.weight, std=1e-1)
        self.attention = _C02AttentionSequencePoolingLayer(embedding_dim=16)
        self.dnn = nn.Sequential(nn.Linear(4 * 8 + 16 + 1, 32), nn.ReLU(), nn.Linear(32, 16), nn.ReLU())
        self.dnn_linear = nn.Linear(16, 1, bias=False)
        self.out_bias = nn.Parameter(torch.zeros(1))

    def forward(self, x: dict) -> torch.Tensor:
        e = self.embedding_dict
        query_emb = torch.cat([e["item"](x["item"]), e["item_gender"](x["item_gender"])], -1).unsqueeze(1)  # [B,1,E]
        keys_emb = torch.cat([e["hist_item"](x["hist_item"]), e["hist_item_gender"](x["hist_item_gender"])], -1)
        deep_input_emb = torch.cat([e[n](x[n]) for n in ("user", "gender", "item", "item_gender")], -1).unsqueeze(1)
        if self.bug:
            keys_length = torch.ones((query_emb.size(0), 1))  # [B, 1]
        else:
            keys_length = x["seq_length"].view(-1, 1)  # maxlen_lookup(X, ..., ["seq_length"])
        hist = self.attention(query_emb, keys_emb, keys_length)  # [B, 1, E]
        deep_input_emb = torch.cat((deep_input_emb, hist), dim=-1).view(query_emb.size(0), -1)
        dnn_input = torch.cat([deep_input_emb, x["score"]], dim=-1)
        return torch.sigmoid(self.dnn_linear(self.dnn(dnn_input)) + self.out_bias)


def _c02_inputs(hist: torch.Tensor = _C02_HIST) -> dict:
    return {"user": _C02_USER, "gender": _C02_GENDER, "item": _C02_ITEM, "item_gender": _C02_IGENDER,
            "hist_item": hist, "hist_item_gender": _C02_HGENDER, "score": _C02_SCORE, "seq_length": _C02_LEN}


def _c02_setup(bug: bool):
    torch.manual_seed(0)
    model = _C02DIN(bug).train()
    optim = torch.optim.Adagrad(model.parameters())  # model.compile('adagrad', 'binary_crossentropy'): lr 0.01
    x = _c02_inputs()

    def step() -> torch.Tensor:
        y_pred = model(x).squeeze()
        optim.zero_grad()
        loss = F.binary_cross_entropy(y_pred, _C02_Y, reduction="sum")
        total_loss = loss  # + reg_loss (0) + aux_loss (0)
        total_loss.backward()
        optim.step()
        return total_loss

    return model, optim, x, step


def _c02_build(bug: bool) -> Case:
    model, optim, x, step = _c02_setup(bug)
    return model, step, _kw(optimizer=optim, inputs=x)


def _c02_proof(bug: bool) -> bool:
    """After a real step: does replacing the history items after the first one (inside each true length) leave every
    prediction unchanged, i.e. is the user's behaviour sequence beyond its first item ignored?"""
    model, _, x, step = _c02_setup(bug)
    step()
    other = _C02_HIST.clone()
    later = (torch.arange(_C02_T)[None, :] >= 1) & ~_C02_PAD
    other[later] = (other[later] % 7) + 1  # a different real item id at every later valid position
    with torch.no_grad():
        a = model(x)
        b = model(_c02_inputs(other))
    return bool((a - b).abs().max() < 1e-7)


# --------------------------------------------------------------------------------------------- case-03
# Graph-COM/GSAT issue #5 (graph networks): with learn_edge_att on an undirected graph, GSAT averages each edge's
# attention with its reverse edge's, `edge_att = (att + transpose(edge_index, att, N, N, coalesced=False)[1]) / 2`.
# torch_sparse's transpose with coalesced=False only swaps the index rows and returns the values in the same order, so
# this is `(att + att) / 2`: the attention on u->v and v->u stays different, the GIN is trained on direction-dependent
# edge weights of an undirected graph and the explanation is asymmetric, while the loss looks normal. Fix (PR #7, then
# reorder_like in PR #8): look up each edge's reverse edge and average with the value at that position.


def _c03_graph():
    und = [(0, 1), (1, 2), (2, 3), (3, 0), (0, 2), (4, 5), (5, 6), (6, 7), (7, 8), (5, 8)]
    src, dst = [], []
    for u, v in und:
        src += [u, v]
        dst += [v, u]
    edge_index = torch.tensor([src, dst])
    x = torch.randn(9, 4, generator=_gen(3421))
    batch = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1, 1])
    y = torch.tensor([0, 1])
    return x, edge_index, batch, y


_C03_X, _C03_EI, _C03_BATCH, _C03_Y = _c03_graph()


def _torch_sparse_transpose(index: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """torch_sparse.transpose(index, value, m, n, coalesced=False): swap row and col; the values are not reordered."""
    row, col = index
    return torch.stack([col, row], dim=0), value


def _c03_reverse_positions(edge_index: torch.Tensor) -> torch.Tensor:
    """For every edge (u, v), the position of (v, u): what the fix's csr lookup / reorder_like computes."""
    pos = {(int(u), int(v)): i for i, (u, v) in enumerate(edge_index.t().tolist())}
    return torch.tensor([pos[(int(v), int(u))] for u, v in edge_index.t().tolist()])


class _C03GIN(nn.Module):
    def __init__(self, x_dim: int = 4, hidden: int = 16, n_layers: int = 2, num_class: int = 2) -> None:
        super().__init__()
        self.node_encoder = nn.Linear(x_dim, hidden)
        self.convs = nn.ModuleList(
            nn.Sequential(nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, hidden)) for _ in range(n_layers))
        self.fc_out = nn.Linear(hidden, num_class)

    def get_emb(self, x, edge_index, edge_atten=None):
        h = self.node_encoder(x)
        for mlp in self.convs:
            msg = h[edge_index[0]]
            if edge_atten is not None:
                msg = msg * edge_atten
            h = F.relu(mlp(h + torch.zeros_like(h).index_add_(0, edge_index[1], msg)))
        return h

    def forward(self, x, edge_index, batch, edge_atten=None):
        h = self.get_emb(x, edge_index, edge_atten)
        return self.fc_out(torch.zeros(int(batch.max()) + 1, h.size(1)).index_add_(0, batch, h))


class _C03GSAT(nn.Module):
    def __init__(self, bug: bool, gen: torch.Generator) -> None:
        super().__init__()
        self.bug, self.gen, self.temp, self.r = bug, gen, 1.0, 0.7
        self.clf = _C03GIN()
        self.extractor = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16), nn.ReLU(), nn.Linear(16, 1))

    def sampling(self, att_log_logit, training):
        if training:
            random_noise = torch.empty_like(att_log_logit).uniform_(1e-10, 1 - 1e-10, generator=self.gen)
            random_noise = torch.log(random_noise) - torch.log(1.0 - random_noise)
            return ((att_log_logit + random_noise) / self.temp).sigmoid()
        return att_log_logit.sigmoid()

    def edge_attention(self, x, edge_index, training):
        emb = self.clf.get_emb(x, edge_index)
        col, row = edge_index
        att = self.sampling(self.extractor(torch.cat([emb[col], emb[row]], dim=-1)), training)
        if self.bug:  # is_undirected(edge_index)
            edge_att = (att + _torch_sparse_transpose(edge_index, att)[1]) / 2
        else:
            edge_att = (att + att[_c03_reverse_positions(edge_index)]) / 2
        return att, edge_att

    def forward_pass(self, x, edge_index, batch, y, training):
        att, edge_att = self.edge_attention(x, edge_index, training)
        clf_logits = self.clf(x, edge_index, batch, edge_atten=edge_att)
        pred_loss = F.cross_entropy(clf_logits, y)
        r = self.r
        info_loss = (att * torch.log(att / r + 1e-6) + (1 - att) * torch.log((1 - att) / (1 - r + 1e-6) + 1e-6)).mean()
        return pred_loss + info_loss


def _c03_setup(bug: bool):
    torch.manual_seed(0)
    gsat = _C03GSAT(bug, _gen(3422))
    optimizer = torch.optim.Adam(list(gsat.extractor.parameters()) + list(gsat.clf.parameters()), lr=1e-3,
                                 weight_decay=3e-6)

    def step() -> torch.Tensor:  # train_one_batch
        gsat.extractor.train()
        gsat.clf.train()
        loss = gsat.forward_pass(_C03_X, _C03_EI, _C03_BATCH, _C03_Y, training=True)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        return loss

    return gsat, optimizer, step


def _c03_build(bug: bool) -> Case:
    gsat, optimizer, step = _c03_setup(bug)
    inputs = {"x": _C03_X, "edge_index": _C03_EI, "batch": _C03_BATCH, "y": _C03_Y}
    return gsat, step, _kw(optimizer=optimizer, inputs=inputs)


def _c03_proof(bug: bool) -> bool:
    """After a real step, on this undirected graph: do an edge and its reverse get different edge attention?"""
    gsat, _, step = _c03_setup(bug)
    step()
    with torch.no_grad():
        _, edge_att = gsat.edge_attention(_C03_X, _C03_EI, training=False)
    rev = _c03_reverse_positions(_C03_EI)
    return bool((edge_att - edge_att[rev]).abs().max() > 1e-6)


# --------------------------------------------------------------------------------------------- case-04
# LINCellularNeuroscience/VAME issue #26 (time series): VAME trains a recurrent VAE on windows of pose time series. With
# the `scheduler` option turned off, the script still builds `StepLR(optimizer, step_size=100, gamma=0)` and steps it in
# the training loop, so after 100 scheduler steps the learning rate is multiplied by 0 and stays 0: training "runs" to
# max_epochs with the losses frozen where they were. The maintainer confirmed it; the fix (commit 8ea956f) uses
# gamma=1, a constant learning rate, when the scheduler is off. (Sizes shrunk; noise drawn from a seeded generator.)

_C04_F, _C04_WIN, _C04_FUT, _C04_Z, _C04_B = 4, 6, 3, 4, 4
_C04_DATA = [torch.randn(_C04_B, _C04_F, 2 * _C04_WIN, generator=_gen(3430 + i)) for i in range(3)]


class _C04Encoder(nn.Module):
    def __init__(self, n_features: int, h1: int, h2: int) -> None:
        super().__init__()
        self.rnn_1 = nn.GRU(n_features, h1, 1, bias=True, batch_first=True, bidirectional=True)
        self.rnn_2 = nn.GRU(h1 * 2, h2, 1, bias=True, batch_first=True, bidirectional=True)

    def forward(self, inputs):
        outputs_1, hidden_1 = self.rnn_1(inputs)
        _, hidden_2 = self.rnn_2(outputs_1)
        h_n_1 = torch.cat((hidden_1[0, ...], hidden_1[1, ...]), 1)
        h_n_2 = torch.cat((hidden_2[0, ...], hidden_2[1, ...]), 1)
        return torch.cat((h_n_1, h_n_2), 1)


class _C04RNNVAE(nn.Module):
    def __init__(self, gen: torch.Generator, h1: int = 8, h2: int = 8, h_rec: int = 8, h_pred: int = 8) -> None:
        super().__init__()
        self.gen, self.seq_len, self.future_steps = gen, _C04_WIN, _C04_FUT
        self.encoder = _C04Encoder(_C04_F, h1, h2)
        hid = h1 * 2 + h2 * 2
        self.hidden_to_mean = nn.Linear(hid, _C04_Z)
        self.hidden_to_logvar = nn.Linear(hid, _C04_Z)
        self.rnn_rec = nn.GRU(_C04_Z, h_rec, 1, bias=True, batch_first=True)
        self.rec_out = nn.Linear(h_rec, _C04_F)
        self.rnn_pred = nn.GRU(_C04_Z, h_pred, 1, bias=True, batch_first=True, bidirectional=True)
        self.pred_out = nn.Linear(h_pred * 2, _C04_F)

    def forward(self, seq):
        h_n = self.encoder(seq)
        mu = self.hidden_to_mean(h_n)
        logvar = F.softplus(self.hidden_to_logvar(h_n))
        if self.training:
            std = logvar.mul(0.5).exp()
            latent = torch.empty_like(std).normal_(generator=self.gen).mul(std).add(mu)
        else:
            latent = mu
        z = latent.unsqueeze(2).repeat(1, 1, self.seq_len).permute(0, 2, 1)
        prediction = self.rec_out(self.rnn_rec(z)[0])
        future = self.pred_out(self.rnn_pred(z[:, : self.future_steps, :])[0])
        return prediction, future, latent, mu, logvar


def _c04_cluster_loss(H, kloss, lmbda, batch_size):
    gram_matrix = (H.T @ H) / batch_size
    sv_2 = torch.linalg.svdvals(gram_matrix)
    return lmbda * torch.sum(torch.sqrt(sv_2[:kloss]))


def _c04_setup(bug: bool):
    torch.manual_seed(0)
    gen = _gen(3435)
    model = _C04RNNVAE(gen).train()
    optimizer = torch.optim.Adam(model.parameters(), lr=5e-4, amsgrad=True)
    optimizer_scheduler = False  # config: scheduler: 0
    if optimizer_scheduler:
        scheduler = StepLR(optimizer, step_size=100, gamma=0.2, last_epoch=-1)
    else:
        scheduler = StepLR(optimizer, step_size=100, gamma=0 if bug else 1, last_epoch=-1)
    beta, kl_weight, kmeans_lambda = 1.0, 0.25, 0.1
    it = [0]

    def step() -> torch.Tensor:
        data_item = _C04_DATA[it[0] % len(_C04_DATA)].permute(0, 2, 1)
        it[0] += 1
        data = data_item[:, :_C04_WIN, :]
        fut = data_item[:, _C04_WIN:_C04_WIN + _C04_FUT, :]
        emp_std = (data.std(1) * 0.8).unsqueeze(2).repeat(1, 1, _C04_WIN).permute(0, 2, 1)
        data_gaussian = data + torch.empty_like(data).normal_(generator=gen) * emp_std
        data_tilde, future, latent, mu, logvar = model(data_gaussian)
        rec_loss = F.mse_loss(data_tilde, data, reduction="sum")
        fut_rec_loss = F.mse_loss(future, fut, reduction="sum")
        kmeans_loss = _c04_cluster_loss(latent.T, _C04_Z, kmeans_lambda, _C04_B)
        kl_loss = -0.5 * torch.mean(1 + logvar - mu.pow(2) - logvar.exp())
        loss = rec_loss + fut_rec_loss + beta * kl_weight * kl_loss + kl_weight * kmeans_loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=5)
        scheduler.step()
        return loss

    return model, optimizer, scheduler, step


def _c04_build(bug: bool) -> Case:
    model, optimizer, scheduler, step = _c04_setup(bug)
    inputs = _C04_DATA[0].permute(0, 2, 1)[:, :_C04_WIN, :]
    return model, step, _kw(optimizer=optimizer, inputs=inputs, lr_scheduler=scheduler, total_steps=300)


def _c04_proof(bug: bool) -> bool:
    """After 100 real training steps, is the learning rate 0 and does a further step leave every weight where it is?"""
    model, optimizer, _, step = _c04_setup(bug)
    for _ in range(100):
        step()
    before = [p.detach().clone() for p in model.parameters()]
    step()
    frozen = all(torch.equal(b, p.detach()) for b, p in zip(before, model.parameters()))
    return bool(optimizer.param_groups[0]["lr"] == 0.0 and frozen)


# --------------------------------------------------------------------------------------------- case-05
# wenet-e2e/wekws PR #73 (fixes issue #72; speech / keyword spotting): the Executor's training loop did
# `loss.backward(); clip_grad_norm_(...); optimizer.step()` and never called `optimizer.zero_grad()`, so every backward
# added onto all earlier gradients: each Adam step uses the running sum of every batch's gradient since the start. The
# max-pooling KWS loss still goes down and nothing errors. Fix in the PR: `optimizer.zero_grad()` before
# `loss.backward()`.

_C05_B, _C05_T, _C05_D = 4, 20, 40
_C05_BATCHES = []
for _i in range(3):
    _lens = torch.tensor([20, 17, 14, 20]) - _i
    _feats = torch.randn(_C05_B, _C05_T, _C05_D, generator=_gen(3440 + _i))
    _feats = _feats.masked_fill((torch.arange(_C05_T)[None, :] >= _lens[:, None]).unsqueeze(-1), 0.0)
    _C05_BATCHES.append((_feats, torch.tensor([0, -1, 0, -1]), _lens))


class _C05KWSModel(nn.Module):
    """preprocessing (linear) -> GRU backbone -> classifier -> sigmoid, one keyword."""

    def __init__(self, idim: int = _C05_D, hdim: int = 16, num_keywords: int = 1) -> None:
        super().__init__()
        self.preprocessing = nn.Sequential(nn.Linear(idim, hdim), nn.ReLU())
        self.backbone = nn.GRU(hdim, hdim, batch_first=True)
        self.classifier = nn.Linear(hdim, num_keywords)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x, _ = self.backbone(self.preprocessing(x))
        return torch.sigmoid(self.classifier(x))


def _c05_max_pooling_loss(logits, target, lengths, min_duration: int = 0):
    mask = torch.arange(logits.size(1))[None, :] >= lengths[:, None]  # padding_mask: True at padded frames
    loss = 0.0
    for i in range(logits.size(0)):
        for j in range(logits.size(2)):
            if target[i] == j:
                prob = logits[i, :, j]
                m = mask[i].clone().detach()
                m[:min_duration] = True
                prob = torch.clamp(prob.masked_fill(m, 0.0), 1e-8, 1.0)
                loss += -torch.log(prob.max())
            else:
                prob = torch.clamp((1 - logits[i, :, j]).masked_fill(mask[i], 1.0), 1e-8, 1.0)
                loss += -torch.log(prob.min())
    return loss / logits.size(0)


def _c05_setup(bug: bool):
    torch.manual_seed(0)
    model = _C05KWSModel().train()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, weight_decay=1e-4)
    it = [0]

    def step() -> torch.Tensor:
        feats, target, feats_lengths = _C05_BATCHES[it[0] % len(_C05_BATCHES)]
        it[0] += 1
        logits = model(feats)
        loss = _c05_max_pooling_loss(logits, target, feats_lengths)
        if not bug:
            optimizer.zero_grad()
        loss.backward()
        grad_norm = nn.utils.clip_grad_norm_(model.parameters(), 50.0)
        if torch.isfinite(grad_norm):
            optimizer.step()
        return loss

    return model, optimizer, step


def _c05_build(bug: bool) -> Case:
    model, optimizer, step = _c05_setup(bug)
    feats, _, _ = _C05_BATCHES[0]
    return model, step, _kw(optimizer=optimizer, inputs=feats)


def _c05_proof(bug: bool) -> bool:
    """Is the gradient the second optimizer step uses different from the second batch's own gradient (stale sum)?"""
    model, _, step = _c05_setup(bug)
    step()
    fresh_model = copy.deepcopy(model)
    step()
    used = [p.grad.detach().clone() for p in model.parameters()]
    feats, target, lengths = _C05_BATCHES[1]
    loss = _c05_max_pooling_loss(fresh_model(feats), target, lengths)
    fresh = torch.autograd.grad(loss, list(fresh_model.parameters()))
    return not all(torch.allclose(u, f, rtol=1e-4, atol=1e-7) for u, f in zip(used, fresh))


CASES: list[BlindCase] = [
    BlindCase("b34c-01", "https://github.com/huggingface/deep-rl-class/pull/95", "REINFORCE without reward-to-go",
              "Every step's log-probability is weighted by the whole-episode return G_0, so actions are credited with "
              "rewards earned before they were taken.", _c01_build, _c01_proof,
              known_miss="the whole-episode return weights every log-probability: the estimator's arithmetic (which rewards credit an action) is outside the model"),
    BlindCase("b34c-02", "https://github.com/shenweichen/DeepCTR-Torch/issues/128", "behaviour sequence length hardcoded",
              "DIN passes keys_length = 1 to its attention pooling, so only the first item of each user's history "
              "reaches the prediction.", _c02_build, _c02_proof),
    BlindCase("b34c-03", "https://github.com/Graph-COM/GSAT/issues/5", "reverse-edge attention not aligned",
              "The undirected-graph edge attention is averaged with an un-permuted transpose, i.e. with itself, so "
              "u->v and v->u keep different weights.", _c03_build, _c03_proof,
              known_miss="the reverse-edge attention averaged with itself: arithmetic inside the model's forward (which entry pairs with which)"),
    BlindCase("b34c-04", "https://github.com/LINCellularNeuroscience/VAME/issues/26", "StepLR gamma 0 zeroes lr",
              "With the scheduler option off the script still steps StepLR(step_size=100, gamma=0), so the learning "
              "rate becomes 0 after 100 steps and training stops moving.", _c04_build, _c04_proof,
              known_alarm=("LOOP-013",)),
    BlindCase("b34c-05", "https://github.com/wenet-e2e/wekws/pull/73", "missing optimizer.zero_grad",
              "The keyword-spotting loop never zeroes gradients, so every Adam step uses the running sum of all "
              "batches' gradients so far.", _c05_build, _c05_proof),
]
