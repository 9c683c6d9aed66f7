"""Blind batch 33 (part c): silent training-loop bugs across domains from public GitHub threads, each with its twin.

Collected by someone who does not write the audit's checks. Every case builds the user's setup on a tiny model
(a Dreamer-style world model / actor / value trio, a transformers Llama policy from a tiny config in code, a small
transformer forecaster, a bag-of-embeddings document classifier, a GraphSAGE link predictor; nothing is downloaded) and proves the bug without
the audit on real tensors and real steps.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tests._blind import BlindCase, Case
from tests._blind_batch5 import _gen, _kw, _llama_config

# --------------------------------------------------------------------------------------------- case-01
# juliusfrost/dreamer-pytorch PR #79 ("fix algo bug of value optimizer optimizing wrong params"): Dreamer keeps three
# optimizers (world model, actor, value). The value optimizer was built over `get_parameters(self.model_modules)`
# instead of the value modules. The loop does model backward, actor backward, then `value_optimizer.zero_grad()`,
# value backward and the three steps. So the value network is held by no optimizer and never moves, and the value
# optimizer's zero_grad wipes the world model's gradients before `model_optimizer.step()`: losses are computed and
# logged every step, nothing raises, yet neither the value model nor the world model trains. Fix in the PR: build the
# value optimizer over `get_parameters(self.value_modules)`.

_C01_OBS = torch.randn(8, 12, generator=_gen(3301))
_C01_REW = torch.randn(8, 1, generator=_gen(3302))


class _C01Dreamer(nn.Module):
    """World model (encoder, decoder, reward, transition), actor and value heads on a 16-d latent."""

    def __init__(self) -> None:
        super().__init__()
        self.observation_encoder = nn.Linear(12, 16)
        self.observation_decoder = nn.Linear(16, 12)
        self.reward_model = nn.Linear(16, 1)
        self.transition = nn.Linear(16 + 2, 16)
        self.action_decoder = nn.Linear(16, 2)
        self.value_model = nn.Linear(16, 1)


def _c01_params(modules: list[nn.Module]) -> list[nn.Parameter]:
    return [p for m in modules for p in m.parameters()]


def _c01_build(bug: bool) -> Case:
    torch.manual_seed(0)
    model = _C01Dreamer().train()
    model_modules = [model.observation_encoder, model.observation_decoder, model.reward_model, model.transition]
    actor_modules = [model.action_decoder]
    value_modules = [model.value_model]
    model_opt = torch.optim.Adam(_c01_params(model_modules), lr=6e-4)
    actor_opt = torch.optim.Adam(_c01_params(actor_modules), lr=8e-5)
    value_opt = torch.optim.Adam(_c01_params(model_modules if bug else value_modules), lr=8e-5)

    def losses() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        embed = torch.tanh(model.observation_encoder(_C01_OBS))
        model_loss = F.mse_loss(model.observation_decoder(embed), _C01_OBS) + F.mse_loss(
            model.reward_model(embed), _C01_REW)
        feat = embed.detach()
        action = torch.tanh(model.action_decoder(feat))
        imag = torch.tanh(model.transition(torch.cat([feat, action], -1)))
        frozen = _c01_params([model.reward_model, model.value_model])
        for p in frozen:  # FreezeParameters(model_modules + value_modules) around the reward/value heads
            p.requires_grad_(False)
        imag_reward = model.reward_model(imag)
        value = model.value_model(imag)
        for p in frozen:
            p.requires_grad_(True)
        returns = imag_reward + 0.99 * value
        actor_loss = -returns.mean()
        value_loss = F.mse_loss(model.value_model(imag.detach()), returns.detach())
        return model_loss, actor_loss, value_loss

    def step() -> float:
        model_loss, actor_loss, value_loss = losses()
        model_opt.zero_grad()
        model_loss.backward()
        torch.nn.utils.clip_grad_norm_(_c01_params(model_modules), 100.0)
        actor_opt.zero_grad()
        actor_loss.backward()
        torch.nn.utils.clip_grad_norm_(_c01_params(actor_modules), 100.0)
        value_opt.zero_grad()
        value_loss.backward()
        torch.nn.utils.clip_grad_norm_(_c01_params(value_modules), 100.0)
        model_opt.step()
        actor_opt.step()
        value_opt.step()
        return float((model_loss + actor_loss + value_loss).detach())

    return model, step, _kw(optimizer=model_opt, inputs=_C01_OBS)


def _c01_proof(bug: bool) -> bool:
    """After three steps the value head and the encoder have not moved at all."""
    model, step, _ = _c01_build(bug)
    value0 = model.value_model.weight.detach().clone()
    enc0 = model.observation_encoder.weight.detach().clone()
    for _ in range(3):
        step()
    value_frozen = torch.equal(model.value_model.weight, value0)
    enc_frozen = torch.equal(model.observation_encoder.weight, enc0)
    return value_frozen and enc_frozen


# --------------------------------------------------------------------------------------------- case-02
# nvidia-cosmos/cosmos-rl PR #207 ("fix: lr scheduler"): the policy trainer splits each global batch into
# mini-batches and calls `optimizer.step()` and `lr_scheduler.step()` after every mini-batch, while the scheduler's
# warmup/decay horizon (total_steps) counts global batches. The schedule therefore runs several times faster than
# configured: warmup ends early and the lr reaches its floor long before training ends, silently. Fix in the PR:
# `lr_scheduler.step()` only once per global batch.

_C02_TOTAL = 12
_C02_MINI = 4
_C02_IDS = torch.randint(3, 40, (8, 12), generator=_gen(3303))


def _c02_build(bug: bool) -> Case:
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(_llama_config()).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    warm = 3

    def lam(s: int) -> float:
        if s < warm:
            return (s + 1) / warm
        return max(0.0, (_C02_TOTAL - s) / (_C02_TOTAL - warm))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lam)
    batch = {"input_ids": _C02_IDS, "labels": _C02_IDS.clone()}

    def step() -> float:
        total = 0.0
        for chunk in _C02_IDS.chunk(_C02_MINI):
            loss = model(input_ids=chunk, labels=chunk).loss
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            if bug:
                sched.step()
            total += float(loss.detach())
        if not bug:
            sched.step()
        return total / _C02_MINI

    return model, step, _kw(optimizer=opt, inputs=batch, lr_scheduler=sched, total_steps=_C02_TOTAL)


def _c02_proof(bug: bool) -> bool:
    """After 3 of 12 global steps the lr has already decayed to zero (schedule ran 4x fast)."""
    _model, step, kw = _c02_build(bug)
    sched = kw.get("lr_scheduler")
    assert sched is not None
    for _ in range(3):
        step()
    return sched.last_epoch != 3 and sched.get_last_lr()[0] == 0.0


# --------------------------------------------------------------------------------------------- case-03
# awslabs/gluonts PR #2893 ("Mask loss in Transformer"): the PyTorch Transformer forecaster averaged its per-step
# negative log-likelihood over every future step, including steps where `future_observed_values` is 0 (missing
# targets that the data pipeline imputed, here with 0). The model is silently trained to forecast the imputed filler
# values. Fix in the PR: `weighted_average(loss, weights=future_observed_values)`.

_C03_CTX, _C03_PRED = 12, 6
_C03_PAST = torch.randn(8, _C03_CTX, generator=_gen(3304)) + 3.0
_C03_FUT = torch.randn(8, _C03_PRED, generator=_gen(3305)) + 3.0
_C03_OBS = (torch.rand(8, _C03_PRED, generator=_gen(3306)) > 0.35).float()


class _C03Forecaster(nn.Module):
    """Embed past values, one transformer encoder layer, Gaussian head for each future step."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(1, 16)
        layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)
        self.head = nn.Linear(16 * _C03_CTX, 2 * _C03_PRED)

    def forward(self, past: torch.Tensor) -> torch.distributions.Normal:
        h = self.enc(self.inp(past.unsqueeze(-1))).flatten(1)
        loc, scale = self.head(h).chunk(2, -1)
        return torch.distributions.Normal(loc, F.softplus(scale) + 1e-3)


def _c03_loss(model: _C03Forecaster, bug: bool, future: torch.Tensor) -> torch.Tensor:
    nll = -model(_C03_PAST).log_prob(future)
    if bug:
        return nll.mean()
    return (nll * _C03_OBS).sum() / _C03_OBS.sum().clamp(min=1.0)


def _c03_future() -> torch.Tensor:
    return _C03_FUT * _C03_OBS  # the pipeline imputes missing targets with 0


def _c03_build(bug: bool) -> Case:
    torch.manual_seed(0)
    model = _C03Forecaster().train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    future = _c03_future()

    def step() -> float:
        opt.zero_grad()
        loss = _c03_loss(model, bug, future)
        loss.backward()
        opt.step()
        return float(loss.detach())

    batch = {"past_target": _C03_PAST, "future_target": future, "future_observed_values": _C03_OBS}
    return model, step, _kw(optimizer=opt, inputs=batch)


def _c03_proof(bug: bool) -> bool:
    """The training loss depends on the (arbitrary) filler values at unobserved future steps."""
    model, _, _ = _c03_build(bug)
    with torch.no_grad():
        a = _c03_loss(model, bug, _c03_future())
        b = _c03_loss(model, bug, _c03_future() + 50.0 * (1 - _C03_OBS))
    return not torch.allclose(a, b)


# --------------------------------------------------------------------------------------------- case-04
# facebookresearch/pytext PR #1081 ("Fix label_weights in DocModel"): the document classifier is configured with
# per-label weights for an imbalanced (out-of-domain) label, but DocModel built its loss without passing the
# label_weights to the loss constructor, so training silently used unweighted cross-entropy; the trained model had
# empty label_weights in its loss. Fix in the PR: pass the label weights into the loss when it is built.

_C04_IDS = torch.randint(1, 50, (8, 10), generator=_gen(3307))
_C04_Y = torch.tensor([0, 0, 0, 0, 0, 0, 0, 1])
_C04_LABEL_WEIGHTS = {"in_domain": 1.0, "ood": 7.0}
_C04_LABELS = ["in_domain", "ood"]


class _C04DocModel(nn.Module):
    """Bag-of-embeddings document classifier whose loss is built from the config."""

    def __init__(self, label_weights: dict[str, float] | None) -> None:
        super().__init__()
        self.emb = nn.EmbeddingBag(50, 16, mode="mean")
        self.decoder = nn.Linear(16, 2)
        weight = None
        if label_weights:
            weight = torch.tensor([label_weights.get(lbl, 1.0) for lbl in _C04_LABELS])
        self.loss_fn = nn.CrossEntropyLoss(weight=weight)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.emb(ids))


def _c04_build(bug: bool) -> Case:
    torch.manual_seed(0)
    config_label_weights = _C04_LABEL_WEIGHTS
    model = _C04DocModel(None if bug else config_label_weights).train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)

    def step() -> float:
        opt.zero_grad()
        loss = model.loss_fn(model(_C04_IDS), _C04_Y)
        loss.backward()
        opt.step()
        return float(loss.detach())

    return model, step, _kw(optimizer=opt, inputs={"tokens": _C04_IDS, "labels": _C04_Y})


def _c04_proof(bug: bool) -> bool:
    """The training loss equals plain unweighted cross-entropy although label weights were configured."""
    model, _, _ = _c04_build(bug)
    with torch.no_grad():
        logits = model(_C04_IDS)
        used = model.loss_fn(logits, _C04_Y)
        plain = F.cross_entropy(logits, _C04_Y)
    return torch.allclose(used, plain)


# --------------------------------------------------------------------------------------------- case-05
# dmlc/dgl issue #3586 ("Bug in the Link Prediction Example", fixed on master and 0.7.x): the link-prediction tutorial
# splits positive edges 90/10 into train/test, draws as many negative edges as there are edges, and slices the
# training negatives with `neg_eids[train_size:]` instead of `neg_eids[test_size:]`. Training therefore sees only
# test_size negatives against train_size positives (about 1:9 instead of 1:1); the BCE loss falls nicely while the
# scorer learns to call almost every pair an edge. Fix: `train_neg = neg[neg_eids[test_size:]]`.

_C05_N = 24


def _c05_graph() -> tuple[torch.Tensor, torch.Tensor]:
    g = _gen(3308)
    pairs = torch.randint(0, _C05_N, (200, 2), generator=g)
    pairs = pairs[pairs[:, 0] != pairs[:, 1]]
    pairs = torch.unique(pairs, dim=0)[:60]
    return pairs[:, 0], pairs[:, 1]


class _C05SAGE(nn.Module):
    """Two GraphSAGE-mean layers on a dense adjacency."""

    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(2 * 8, 16)
        self.l2 = nn.Linear(2 * 16, 16)

    def forward(self, adj: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        deg = adj.sum(1, keepdim=True).clamp(min=1.0)
        h = torch.relu(self.l1(torch.cat([x, adj @ x / deg], -1)))
        return self.l2(torch.cat([h, adj @ h / deg], -1))


def _c05_split(bug: bool) -> dict[str, torch.Tensor]:
    u, v = _c05_graph()
    g = _gen(3309)
    num_edges = len(u)
    eids = torch.randperm(num_edges, generator=g)
    test_size = int(num_edges * 0.1)
    train_size = num_edges - test_size
    adj = torch.zeros(_C05_N, _C05_N)
    adj[u, v] = 1.0
    neg_u, neg_v = torch.nonzero((1 - adj - torch.eye(_C05_N)) != 0, as_tuple=True)
    neg_eids = torch.randint(0, len(neg_u), (num_edges,), generator=g)
    tr = neg_eids[train_size:] if bug else neg_eids[test_size:]
    train_adj = torch.zeros(_C05_N, _C05_N)
    train_adj[u[eids[test_size:]], v[eids[test_size:]]] = 1.0
    return {"train_adj": train_adj, "pos_u": u[eids[test_size:]], "pos_v": v[eids[test_size:]],
            "neg_u": neg_u[tr], "neg_v": neg_v[tr]}


_C05_X = torch.randn(_C05_N, 8, generator=_gen(3310))


def _c05_build(bug: bool) -> Case:
    torch.manual_seed(0)
    split = _c05_split(bug)
    model = _C05SAGE().train()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)

    def step() -> float:
        h = model(split["train_adj"], _C05_X)
        pos = (h[split["pos_u"]] * h[split["pos_v"]]).sum(-1)
        neg = (h[split["neg_u"]] * h[split["neg_v"]]).sum(-1)
        scores = torch.cat([pos, neg])
        labels = torch.cat([torch.ones(pos.shape[0]), torch.zeros(neg.shape[0])])
        loss = F.binary_cross_entropy_with_logits(scores, labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
        return float(loss.detach())

    return model, step, _kw(optimizer=opt, inputs=(split["train_adj"], _C05_X))


def _c05_proof(bug: bool) -> bool:
    """The negative pairs that reach the training loss are fewer than half the positive pairs."""
    split = _c05_split(bug)
    return len(split["neg_u"]) * 2 < len(split["pos_u"])


CASES: list[BlindCase] = [
    BlindCase("b33c-01", "https://github.com/juliusfrost/dreamer-pytorch/pull/79", "optimizer over wrong parameters",
              "The value optimizer holds the world-model parameters, so the value head never updates and its "
              "zero_grad wipes the world model's gradients before the world-model step.", _c01_build, _c01_proof),
    BlindCase("b33c-02", "https://github.com/nvidia-cosmos/cosmos-rl/pull/207", "scheduler stepped per mini-batch",
              "lr_scheduler.step() runs after every mini-batch while total_steps counts global batches, so warmup and "
              "decay run several times too fast.", _c02_build, _c02_proof,
              known_miss="a scheduler stepped per mini-batch inside an epoch of several updates: its planned cadence is not given"),
    BlindCase("b33c-03", "https://github.com/awslabs/gluonts/pull/2893", "loss not masked by observed values",
              "The forecaster's NLL is averaged over unobserved (imputed) future steps too, so the model is trained "
              "to predict the filler values.", _c03_build, _c03_proof,
              known_miss="a forecasting loss not masked by observed values: which targets are observed is data semantics"),
    BlindCase("b33c-04", "https://github.com/facebookresearch/pytext/pull/1081", "class weights not passed to loss",
              "Configured label weights never reach the loss constructor, so the imbalanced classifier trains with "
              "unweighted cross-entropy.", _c04_build, _c04_proof,
              known_miss="class weights computed and not passed to the loss: an absent argument is not measurable"),
    BlindCase("b33c-05", "https://github.com/dmlc/dgl/issues/3586", "wrong negative-sample slice",
              "Training negatives are sliced with train_size instead of test_size, so the link-prediction loss sees "
              "about one negative per nine positives.", _c05_build, _c05_proof,
              known_miss="a wrong slice of negative samples: which rows are negatives is data semantics"),
]
