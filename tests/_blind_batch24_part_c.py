"""Blind batch 24 (part c): silent training bugs from public threads (multi-agent RL, multi-modal contrastive learning,
distillation-style pre-training, GANs, meta-learning), each with its fixed twin.

Collected by someone who does not write the audit's checks. Every case is a tiny hand-written model (or a transformers
model from a tiny config in code) on seeded data; nothing is downloaded. Each proof shows the bug on real steps without
the audit.
"""

from __future__ import annotations

from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from tests._blind import BlindCase, Case
from tests._blind_batch5 import _gen, _kw

# --------------------------------------------------------------------------------------------- case-11
# thesouther/MARL issue #8 (QMIX/policy.py, ``learn``): every ``update_target_params`` training steps the QMIX learner
# syncs its target networks with ``target_drqn_net.load_state_dict(eval_drqn_net.state_dict())`` and
# ``target_qmix_net.load_state_dict(self.target_qmix_net.state_dict())``: the target mixing network is loaded from
# itself, so it keeps its initial weights for the whole run while the TD targets are built from it. The reporter
# pointed out the second line should read ``eval_qmix_net``; the maintainer confirmed and fixed it.

_C11_N_AGENTS, _C11_N_ACT, _C11_OBS, _C11_STATE, _C11_T, _C11_B = 2, 3, 6, 5, 3, 4


class _DRQN(nn.Module):
    """Per-agent recurrent Q network: fc, GRU cell, fc to action values."""

    def __init__(self, input_shape: int, hidden: int = 16) -> None:
        super().__init__()
        self.hidden = hidden
        self.fc1 = nn.Linear(input_shape, hidden)
        self.rnn = nn.GRUCell(hidden, hidden)
        self.fc2 = nn.Linear(hidden, _C11_N_ACT)

    def forward(self, obs: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = F.relu(self.fc1(obs))
        h = self.rnn(x, h.reshape(-1, self.hidden))
        return self.fc2(h), h


class _QMixNet(nn.Module):
    """Monotonic mixing network whose weights come from hypernetworks of the global state."""

    def __init__(self, embed: int = 8) -> None:
        super().__init__()
        self.embed = embed
        self.hyper_w1 = nn.Linear(_C11_STATE, _C11_N_AGENTS * embed)
        self.hyper_b1 = nn.Linear(_C11_STATE, embed)
        self.hyper_w2 = nn.Linear(_C11_STATE, embed)
        self.hyper_b2 = nn.Sequential(nn.Linear(_C11_STATE, embed), nn.ReLU(), nn.Linear(embed, 1))

    def forward(self, q_values: torch.Tensor, states: torch.Tensor) -> torch.Tensor:
        episode_num = q_values.size(0)
        q = q_values.reshape(-1, 1, _C11_N_AGENTS)
        s = states.reshape(-1, _C11_STATE)
        w1 = torch.abs(self.hyper_w1(s)).view(-1, _C11_N_AGENTS, self.embed)
        b1 = self.hyper_b1(s).view(-1, 1, self.embed)
        hidden = F.elu(torch.bmm(q, w1) + b1)
        w2 = torch.abs(self.hyper_w2(s)).view(-1, self.embed, 1)
        b2 = self.hyper_b2(s).view(-1, 1, 1)
        return (torch.bmm(hidden, w2) + b2).view(episode_num, -1, 1)


def _c11_batch() -> dict[str, torch.Tensor]:
    g = _gen(1101)
    b, t, n, a = _C11_B, _C11_T, _C11_N_AGENTS, _C11_N_ACT
    u = torch.randint(0, a, (b, t, n, 1), generator=g)
    return {
        "o": torch.randn(b, t, n, _C11_OBS, generator=g), "o_": torch.randn(b, t, n, _C11_OBS, generator=g),
        "s": torch.randn(b, t, _C11_STATE, generator=g), "s_": torch.randn(b, t, _C11_STATE, generator=g),
        "u": u, "u_onehot": F.one_hot(u.squeeze(-1), a).float(),
        "r": torch.randn(b, t, 1, generator=g), "avail_u_": torch.ones(b, t, n, a),
        "terminated": torch.zeros(b, t, 1), "padded": torch.zeros(b, t, 1),
    }


_C11_BATCH = _c11_batch()


class _QMIX(nn.Module):
    """The QMIX learner: eval/target DRQN agents and eval/target mixers, RMSprop on the eval networks."""

    def __init__(self, bug: bool, update_target_params: int = 2) -> None:
        super().__init__()
        self.bug = bug
        self.update_target_params = update_target_params
        input_shape = _C11_OBS + _C11_N_ACT + _C11_N_AGENTS  # last_action and reuse_network
        self.eval_drqn_net = _DRQN(input_shape)
        self.target_drqn_net = _DRQN(input_shape)
        self.eval_qmix_net = _QMixNet()
        self.target_qmix_net = _QMixNet()
        self.target_drqn_net.load_state_dict(self.eval_drqn_net.state_dict())
        self.target_qmix_net.load_state_dict(self.eval_qmix_net.state_dict())
        self.eval_parameters = list(self.eval_qmix_net.parameters()) + list(self.eval_drqn_net.parameters())
        self.optimizer = torch.optim.RMSprop(self.eval_parameters, lr=5e-4)
        self.gamma, self.grad_norm_clip = 0.99, 10.0
        self.train_step = 0

    def _get_inputs(self, batch: dict[str, torch.Tensor], idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        o, o_, u_onehot = batch["o"][:, idx], batch["o_"][:, idx], batch["u_onehot"]
        episode_num = o.shape[0]
        last = torch.zeros_like(u_onehot[:, idx]) if idx == 0 else u_onehot[:, idx - 1]
        eye = torch.eye(_C11_N_AGENTS).unsqueeze(0).expand(episode_num, -1, -1)
        inputs = [o, last, eye]
        inputs_ = [o_, u_onehot[:, idx], eye]
        return (torch.cat([x.reshape(episode_num * _C11_N_AGENTS, -1) for x in inputs], dim=1),
                torch.cat([x.reshape(episode_num * _C11_N_AGENTS, -1) for x in inputs_], dim=1))

    def get_q_values(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        episode_num = batch["o"].shape[0]
        eval_h = torch.zeros(episode_num, _C11_N_AGENTS, self.eval_drqn_net.hidden)
        target_h = torch.zeros(episode_num, _C11_N_AGENTS, self.target_drqn_net.hidden)
        q_evals, q_targets = [], []
        for idx in range(_C11_T):
            inputs, inputs_ = self._get_inputs(batch, idx)
            q_eval, eval_h = self.eval_drqn_net(inputs, eval_h)
            q_target, target_h = self.target_drqn_net(inputs_, target_h)
            q_evals.append(q_eval.view(episode_num, _C11_N_AGENTS, -1))
            q_targets.append(q_target.view(episode_num, _C11_N_AGENTS, -1))
        return torch.stack(q_evals, dim=1), torch.stack(q_targets, dim=1)

    def learn(self, batch: dict[str, torch.Tensor], train_step: int) -> torch.Tensor:
        s, s_, u, r = batch["s"], batch["s_"], batch["u"], batch["r"]
        avail_u_, terminated = batch["avail_u_"], batch["terminated"]
        mask = 1 - batch["padded"].float()
        q_evals, q_targets = self.get_q_values(batch)
        q_evals = torch.gather(q_evals, dim=3, index=u).squeeze(3)
        q_targets[avail_u_ == 0.0] = -9999999
        q_targets = q_targets.max(dim=3)[0]
        q_total_eval = self.eval_qmix_net(q_evals, s)
        q_total_target = self.target_qmix_net(q_targets, s_)
        targets = r + self.gamma * q_total_target * (1 - terminated)
        td_error = q_total_eval - targets.detach()
        loss = ((mask * td_error) ** 2).sum() / mask.sum()
        self.optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.eval_parameters, self.grad_norm_clip)
        self.optimizer.step()
        if train_step > 0 and train_step % self.update_target_params == 0:
            self.target_drqn_net.load_state_dict(self.eval_drqn_net.state_dict())
            source = self.target_qmix_net if self.bug else self.eval_qmix_net
            self.target_qmix_net.load_state_dict(source.state_dict())
        return loss

    def step(self) -> torch.Tensor:
        self.train_step += 1
        return self.learn(_C11_BATCH, self.train_step)


def _c11_build(bug: bool) -> Case:
    """QMIX on one replay batch, target networks synced every 2 steps (the mixer syncs from itself in the bug)."""
    torch.manual_seed(0)
    learner = _QMIX(bug)
    return learner, learner.step, _kw(optimizer=learner.optimizer, inputs=_C11_BATCH["o"])


def _c11_proof(bug: bool) -> bool:
    """Right after the sync step the target mixer should compute the same joint value as the eval mixer; in the bug
    it still gives its initial function while the eval mixer has trained."""
    learner = cast(_QMIX, _c11_build(bug)[0])
    for _ in range(learner.update_target_params):
        learner.step()
    q = torch.randn(_C11_B, _C11_T, _C11_N_AGENTS, generator=_gen(1102))
    with torch.no_grad():
        gap = (learner.target_qmix_net(q, _C11_BATCH["s"]) - learner.eval_qmix_net(q, _C11_BATCH["s"])).abs().max()
    return float(gap) > 1e-6


# --------------------------------------------------------------------------------------------- case-12
# ligerfotis/mvitac issue #2 (model.py, ``MultiModalMoCo.forward``): the vision/tactile MoCo model computes its keys with
# momentum key encoders under ``torch.no_grad()``, but the two ``momentum_update_key_encoder(...)`` calls at the end of
# ``forward`` were commented out, so the key encoders never follow the query encoders and every intra/inter-modal
# InfoNCE loss is taken against keys from the frozen initial encoders. The maintainer answered that the calls were
# commented out by accident and restored them.


def _c12_info_nce(q: torch.Tensor, k: torch.Tensor, temperature: float) -> torch.Tensor:
    features = F.normalize(torch.cat([q, k], dim=0), dim=1)
    n = q.shape[0]
    labels = torch.cat([torch.arange(n), torch.arange(n)])
    labels = (labels[None, :] == labels[:, None]).float()
    sim = features @ features.T
    eye = torch.eye(2 * n, dtype=torch.bool)
    labels = labels[~eye].view(2 * n, -1)
    sim = sim[~eye].view(2 * n, -1)
    positives = sim[labels.bool()].view(2 * n, -1)
    negatives = sim[~labels.bool()].view(2 * n, -1)
    logits = torch.cat([positives, negatives], dim=1) / temperature
    return F.cross_entropy(logits, torch.zeros(2 * n, dtype=torch.long))


@torch.no_grad()
def _c12_momentum_update(base_q: nn.Module, base_k: nn.Module, head_q: nn.Module, head_k: nn.Module, m: float) -> None:
    for param_q, param_k in zip(base_q.parameters(), base_k.parameters()):
        param_k.data = param_k.data * m + param_q.data * (1.0 - m)
    for param_q, param_k in zip(head_q.parameters(), head_k.parameters()):
        param_k.data = param_k.data * m + param_q.data * (1.0 - m)


class _MultiModalMoCo(nn.Module):
    """Vision and tactile query/key encoders (conv base, intra- and inter-modal MLP heads), four InfoNCE terms."""

    def __init__(self, bug: bool, m: float = 0.99, temperature: float = 0.5) -> None:
        super().__init__()
        self.bug, self.m, self.T = bug, m, temperature
        self.vision_base_q, self.vision_head_intra_q, self.vision_head_inter_q = self._encoder()
        self.vision_base_k, self.vision_head_intra_k, self.vision_head_inter_k = self._encoder()
        self.tactile_base_q, self.tactile_head_intra_q, self.tactile_head_inter_q = self._encoder()
        self.tactile_base_k, self.tactile_head_intra_k, self.tactile_head_inter_k = self._encoder()
        _c12_momentum_update(self.vision_base_q, self.vision_base_k, self.vision_head_intra_q,
                             self.vision_head_intra_k, 0.0)
        _c12_momentum_update(self.tactile_base_q, self.tactile_base_k, self.tactile_head_intra_q,
                             self.tactile_head_intra_k, 0.0)

    @staticmethod
    def _encoder() -> tuple[nn.Module, nn.Module, nn.Module]:
        base = nn.Sequential(nn.Conv2d(3, 8, 3, stride=2, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d((1, 1)),
                             nn.Flatten())

        def head() -> nn.Module:
            return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.5), nn.Linear(32, 16))

        return base, head(), head()

    def forward(self, x_vision_q: torch.Tensor, x_vision_k: torch.Tensor, x_tactile_q: torch.Tensor,
                x_tactile_k: torch.Tensor) -> torch.Tensor:
        vision_base_q = self.vision_base_q(x_vision_q)
        vis_queries_intra = self.vision_head_intra_q(vision_base_q)
        vis_queries_inter = self.vision_head_inter_q(vision_base_q)
        with torch.no_grad():
            vision_base_k = self.vision_base_k(x_vision_k)
            vis_keys_intra = self.vision_head_intra_k(vision_base_k)
            vis_keys_inter = self.vision_head_inter_k(vision_base_k)
        tactile_base_q = self.tactile_base_q(x_tactile_q)
        tac_queries_intra = self.tactile_head_intra_q(tactile_base_q)
        tac_queries_inter = self.tactile_head_inter_q(tactile_base_q)
        with torch.no_grad():
            tactile_base_k = self.tactile_base_k(x_tactile_k)
            tac_keys_intra = self.tactile_head_intra_k(tactile_base_k)
            tac_keys_inter = self.tactile_head_inter_k(tactile_base_k)
        loss = (_c12_info_nce(vis_queries_intra, vis_keys_intra, self.T)
                + _c12_info_nce(tac_queries_intra, tac_keys_intra, self.T)
                + _c12_info_nce(vis_queries_inter, tac_keys_inter, self.T)
                + _c12_info_nce(tac_queries_inter, vis_keys_inter, self.T))
        if not self.bug:  # the momentum update the bug left commented out
            _c12_momentum_update(self.vision_base_q, self.vision_base_k, self.vision_head_intra_q,
                                 self.vision_head_intra_k, self.m)
            _c12_momentum_update(self.tactile_base_q, self.tactile_base_k, self.tactile_head_intra_q,
                                 self.tactile_head_intra_k, self.m)
        return loss


def _c12_views(seed: int) -> torch.Tensor:
    return torch.randn(6, 3, 8, 8, generator=_gen(seed))


_C12_VIS_Q, _C12_VIS_K, _C12_TAC_Q, _C12_TAC_K = (_c12_views(s) for s in (1201, 1202, 1203, 1204))


def _c12_build(bug: bool) -> Case:
    """Vision-tactile MoCo trained with Adam on two views per modality (key encoders never momentum-updated in the
    bug)."""
    torch.manual_seed(0)
    model = _MultiModalMoCo(bug).train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)

    def step() -> torch.Tensor:
        loss = model(_C12_VIS_Q, _C12_VIS_K, _C12_TAC_Q, _C12_TAC_K)
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss

    return model, step, _kw(optimizer=opt, inputs=(_C12_VIS_Q, _C12_VIS_K, _C12_TAC_Q, _C12_TAC_K))


def _c12_proof(bug: bool) -> bool:
    """After a few steps the vision key encoder maps the key views exactly as it did at initialisation: the keys
    every loss is contrasted against come from an encoder that never moved."""
    built, step, _ = _c12_build(bug)
    model = cast(_MultiModalMoCo, built)

    def keys() -> torch.Tensor:
        with torch.no_grad():
            return model.vision_head_intra_k[0](model.vision_base_k(_C12_VIS_K))

    before = keys()
    for _ in range(4):
        step()
    return float((keys() - before).abs().max()) < 1e-7


# --------------------------------------------------------------------------------------------- case-13
# yxuansu/TaCL issue #11 (pretraining/bert_contrastive.py, train.py): token-aware contrastive pre-training pulls the
# student BERT's token representations of the masked input towards a frozen teacher BERT's representations of the
# original input. The teacher's parameters have ``requires_grad = False``, but ``train.py`` calls ``model.train()`` on
# the whole module and the teacher is never put in eval mode, so its dropout stays on and the contrastive targets are
# re-drawn at random every step. The reporter pointed out ``eval()`` is missing on the teacher; the author agreed it
# should be added to disable the dropout. (The loop's manual warm-up override of the lr is left out here.)


def _c13_config() -> Any:
    from transformers import BertConfig

    return BertConfig(vocab_size=40, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                      intermediate_size=64, max_position_embeddings=32, type_vocab_size=2,
                      hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1, pad_token_id=0)


class _BERTContrastivePretraining(nn.Module):
    """Student BertForPreTraining (MLM + NSP) plus a cosine token contrastive loss against a frozen teacher BERT."""

    def __init__(self, temperature: float = 0.01) -> None:
        super().__init__()
        from transformers import BertForPreTraining, BertModel

        config = _c13_config()
        self.model = BertForPreTraining(config)
        self.bert = self.model.bert
        self.cls = self.model.cls
        self.embed_dim, self.vocab_size, self.temperature = config.hidden_size, config.vocab_size, temperature
        self.teacher_bert = BertModel(config)
        self.teacher_bert.load_state_dict(self.bert.state_dict())  # both start from the same checkpoint
        for param in self.teacher_bert.parameters():
            param.requires_grad = False

    def forward(self, truth: torch.Tensor, inp: torch.Tensor, seg: torch.Tensor, msk: torch.Tensor,
                attn_msk: torch.Tensor, contrastive_labels: torch.Tensor, nxt_snt_flag: torch.Tensor) -> torch.Tensor:
        bsz, seqlen = truth.size()
        out = self.bert(input_ids=inp, token_type_ids=seg, attention_mask=attn_msk)
        masked_rep = out[0]
        logits, sen_relation_scores = self.cls(masked_rep, out[1])
        mlm_loss = F.nll_loss(torch.log_softmax(logits[msk.bool()], -1), truth[msk.bool()])
        t_out = self.teacher_bert(input_ids=truth, token_type_ids=seg, attention_mask=attn_msk)
        truth_rep = t_out[0]
        masked_rep = masked_rep / masked_rep.norm(dim=2, keepdim=True)
        truth_rep = truth_rep / truth_rep.norm(dim=2, keepdim=True)
        scores = torch.matmul(masked_rep, truth_rep.transpose(1, 2)) / self.temperature
        logprobs = F.log_softmax(scores.view(-1, seqlen), dim=-1)
        gold = torch.arange(seqlen).expand(bsz, seqlen).reshape(-1)
        c_loss = -logprobs.gather(dim=-1, index=gold.unsqueeze(1)).squeeze(1)
        contrastive_loss = (c_loss.view(bsz, seqlen) * contrastive_labels).sum() / contrastive_labels.sum()
        next_sentence_loss = F.cross_entropy(sen_relation_scores.view(-1, 2), nxt_snt_flag.view(-1))
        return mlm_loss + next_sentence_loss + contrastive_loss


def _c13_batch() -> tuple[torch.Tensor, ...]:
    g = _gen(1301)
    truth = torch.randint(5, 40, (4, 10), generator=g)
    msk = (torch.rand(4, 10, generator=g) < 0.15).long()
    msk[:, 3] = 1
    inp = torch.where(msk.bool(), torch.full_like(truth, 3), truth)
    seg = torch.zeros_like(truth)
    attn = torch.ones_like(truth)
    return truth, inp, seg, msk, attn, attn.float(), torch.randint(0, 2, (4,), generator=g)


_C13_BATCH = _c13_batch()


def _c13_build(bug: bool) -> Case:
    """TaCL pre-training loop: model.train(), AdamW + linear warm-up schedule, clipping (teacher left in train mode
    in the bug)."""
    from transformers import get_linear_schedule_with_warmup

    torch.manual_seed(0)
    model = _BERTContrastivePretraining()
    total_steps = 20
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    scheduler = get_linear_schedule_with_warmup(optimizer, num_warmup_steps=int(0.1 * total_steps),
                                                num_training_steps=total_steps)
    optimizer.zero_grad()
    model.train()
    if not bug:
        model.teacher_bert.eval()

    def step() -> torch.Tensor:
        loss = model(*_C13_BATCH)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        return loss

    return model, step, _kw(optimizer=optimizer, inputs=_C13_BATCH[1], lr_scheduler=scheduler,
                            total_steps=total_steps)


def _c13_proof(bug: bool) -> bool:
    """The teacher is frozen and sees the same batch at every step, so the targets it hands the contrastive loss
    should be identical from step to step; in the bug they change every step."""
    built, step, _ = _c13_build(bug)
    model = cast(_BERTContrastivePretraining, built)
    seen: list[torch.Tensor] = []
    hook = model.teacher_bert.register_forward_hook(lambda _m, _i, out: seen.append(out[0].detach().clone()))
    step()
    step()
    hook.remove()
    return float((seen[0] - seen[1]).abs().max()) > 1e-6


# --------------------------------------------------------------------------------------------- case-14
# nv-tlabs/semanticGAN_code issue #25 (semanticGAN/train_seg_gan.py): each iteration trains the image discriminator,
# then the segmentation discriminator (after ``requires_grad(discriminator_img, False)``), then on ``d_reg_every``
# iterations runs the R1 regularisation of both discriminators without switching ``discriminator_img`` back on. Its
# parameters still have ``requires_grad=False``, so the R1 penalty's backward gives them no gradient and the
# ``d_img_optim.step()`` after it does nothing: the image discriminator is never R1-regularised. The author agreed
# that gradients should be enabled for both discriminators in the regularisation and called it a refactoring mistake.
# (Here the multi-scale segmentation discriminator is one scale, and the feature-matching and path-length terms of
# the generator are left out.)


def _c14_requires_grad(model: nn.Module, flag: bool) -> None:
    for p in model.parameters():
        p.requires_grad = flag


class _SegGenerator(nn.Module):
    """Latent to an image and a soft segmentation mask."""

    def __init__(self, latent: int = 8, seg_dim: int = 2) -> None:
        super().__init__()
        self.latent, self.seg_dim = latent, seg_dim
        self.net = nn.Sequential(nn.Linear(latent, 64), nn.LeakyReLU(0.2), nn.Linear(64, (3 + seg_dim) * 64))

    def forward(self, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.net(z).view(-1, 3 + self.seg_dim, 8, 8)
        return torch.tanh(out[:, :3]), torch.softmax(out[:, 3:], dim=1)


def _c14_disc(in_ch: int) -> nn.Module:
    return nn.Sequential(nn.Conv2d(in_ch, 8, 3, stride=2, padding=1), nn.LeakyReLU(0.2), nn.Flatten(),
                         nn.Linear(8 * 4 * 4, 1))


def _c14_d_logistic_loss(real_pred: torch.Tensor, fake_pred: torch.Tensor) -> torch.Tensor:
    return F.softplus(-real_pred).mean() + F.softplus(fake_pred).mean()


def _c14_d_r1_loss(real_pred: torch.Tensor, real_img: torch.Tensor) -> torch.Tensor:
    (grad_real,) = torch.autograd.grad(outputs=real_pred.sum(), inputs=real_img, create_graph=True)
    return grad_real.pow(2).reshape(grad_real.shape[0], -1).sum(1).mean()


_C14_REAL = torch.tanh(torch.randn(4, 3, 8, 8, generator=_gen(1401)))
_C14_SEG_IMG = torch.tanh(torch.randn(4, 3, 8, 8, generator=_gen(1402)))
_C14_SEG_MASK = F.one_hot(torch.randint(0, 2, (4, 8, 8), generator=_gen(1403)), 2).permute(0, 3, 1, 2).float()


def _c14_build(bug: bool) -> Case:
    """SemanticGAN iteration: D_img step, D_seg step, R1 on both every 2 iterations, G step (D_img's gradients left
    switched off during its R1 step in the bug)."""
    torch.manual_seed(0)
    generator, discriminator_img, discriminator_seg = _SegGenerator(), _c14_disc(3), _c14_disc(3 + 2)
    model = nn.ModuleDict({"generator": generator, "discriminator_img": discriminator_img,
                           "discriminator_seg": discriminator_seg})
    lr, r1, d_reg_every, g_reg_every = 0.002, 10.0, 2, 4
    g_ratio, d_ratio = g_reg_every / (g_reg_every + 1), d_reg_every / (d_reg_every + 1)
    g_optim = torch.optim.Adam(generator.parameters(), lr=lr * g_ratio, betas=(0 ** g_ratio, 0.99 ** g_ratio))
    d_img_optim = torch.optim.Adam(discriminator_img.parameters(), lr=lr * d_ratio,
                                   betas=(0 ** d_ratio, 0.99 ** d_ratio))
    d_seg_optim = torch.optim.Adam(discriminator_seg.parameters(), lr=lr * d_ratio,
                                   betas=(0 ** d_ratio, 0.99 ** d_ratio))
    noise_gen = _gen(1404)
    it = [0]

    def noise() -> torch.Tensor:
        return torch.randn(4, generator.latent, generator=noise_gen)

    def step() -> torch.Tensor:
        i = it[0]
        it[0] += 1
        # step 1: the image discriminator
        _c14_requires_grad(generator, False)
        _c14_requires_grad(discriminator_img, True)
        _c14_requires_grad(discriminator_seg, False)
        fake_img, fake_seg = generator(noise())
        d_img_loss = _c14_d_logistic_loss(discriminator_img(_C14_REAL), discriminator_img(fake_img))
        discriminator_img.zero_grad()
        d_img_loss.backward()
        d_img_optim.step()
        # step 2: the segmentation discriminator
        _c14_requires_grad(generator, False)
        _c14_requires_grad(discriminator_img, False)
        _c14_requires_grad(discriminator_seg, True)
        fake_img, fake_seg = generator(noise())
        fake_seg_pred = discriminator_seg(torch.cat([fake_img, fake_seg], 1))
        real_seg_pred = discriminator_seg(torch.cat([_C14_SEG_IMG, _C14_SEG_MASK], 1))
        d_seg_loss = (F.mse_loss(fake_seg_pred, torch.zeros_like(fake_seg_pred))
                      + F.mse_loss(real_seg_pred, torch.ones_like(real_seg_pred))) / 2.0
        discriminator_seg.zero_grad()
        d_seg_loss.backward()
        d_seg_optim.step()
        # R1 regularisation of both discriminators
        if i % d_reg_every == 0:
            if not bug:
                _c14_requires_grad(discriminator_img, True)
                _c14_requires_grad(discriminator_seg, True)
            real_img = _C14_REAL.detach().clone().requires_grad_(True)
            real_pred = discriminator_img(real_img)
            r1_img_loss = _c14_d_r1_loss(real_pred, real_img)
            discriminator_img.zero_grad()
            (r1 / 2 * r1_img_loss * d_reg_every + 0 * real_pred[0]).sum().backward()
            d_img_optim.step()
            real_img_seg = torch.cat([_C14_SEG_IMG, _C14_SEG_MASK], 1).requires_grad_(True)
            real_pred = discriminator_seg(real_img_seg)
            r1_seg_loss = _c14_d_r1_loss(real_pred, real_img_seg)
            discriminator_seg.zero_grad()
            (r1 / 2 * r1_seg_loss * d_reg_every + 0 * real_pred[0]).sum().backward()
            d_seg_optim.step()
        # step 3: the generator
        _c14_requires_grad(generator, True)
        _c14_requires_grad(discriminator_img, False)
        _c14_requires_grad(discriminator_seg, False)
        fake_img, fake_seg = generator(noise())
        g_img_loss = F.softplus(-discriminator_img(fake_img)).mean()
        fake_seg_pred = discriminator_seg(torch.cat([fake_img.detach(), fake_seg], 1))
        g_seg_adv_loss = F.mse_loss(fake_seg_pred, torch.ones_like(fake_seg_pred))
        g_loss = g_img_loss + g_seg_adv_loss
        generator.zero_grad()
        g_loss.backward()
        g_optim.step()
        return g_loss

    model.d_img_optim = d_img_optim  # type: ignore[assignment]
    return model, step, _kw(optimizer=g_optim, inputs=torch.randn(4, generator.latent, generator=_gen(1405)))


def _c14_proof(bug: bool) -> bool:
    """Every ``d_img_optim.step()`` should have a gradient to apply; in the bug the one after the R1 penalty finds no
    gradient on any image-discriminator parameter, so the regularisation never reaches it."""
    model, step, _ = _c14_build(bug)
    d_img = cast(nn.Module, model["discriminator_img"])
    opt = cast(torch.optim.Optimizer, model.d_img_optim)
    had_grad: list[bool] = []

    def pre_hook(_opt: Any, _args: Any, _kwargs: Any) -> None:
        had_grad.append(any(p.grad is not None and bool(p.grad.abs().sum() > 0) for p in d_img.parameters()))

    handle = opt.register_step_pre_hook(pre_hook)
    step()
    handle.remove()
    return len(had_grad) == 2 and not all(had_grad)


# --------------------------------------------------------------------------------------------- case-15
# uvm-neurobotics-lab/ANML issue #3 (model/meta_learner.py, ``inner_update``): ANML meta-learns a neuromodulatory
# network that gates a prediction network, adapting the prediction network in an inner loop of SGD steps and taking
# the meta step on the loss after adaptation. The inner gradients are taken with
# ``torch.autograd.grad(loss, fast_weights, allow_unused=False)`` without ``create_graph=True``, so the meta-gradient
# silently drops every term that flows through the inner updates (a first-order approximation the method does not
# intend); the neuromodulation, which only acts on the outer loss through how it shapes the inner learning, gets an
# incomplete gradient. The thread names the fix: pass ``create_graph=True`` (the same bug fixed upstream in OML
# raised performance and sped up convergence).


class _ANMLLearner(nn.Module):
    """Functional net: a neuromodulatory sigmoid gate (fixed in the inner loop) times a ReLU prediction layer, then a
    linear classifier (both adapted in the inner loop)."""

    def __init__(self, d_in: int = 10, hidden: int = 16, n_cls: int = 5) -> None:
        super().__init__()
        g = _gen(1501)
        shapes = [(hidden, d_in), (hidden,), (hidden, d_in), (hidden,), (n_cls, hidden), (n_cls,)]
        self.vars = nn.ParameterList([nn.Parameter(torch.randn(*sh, generator=g) * 0.3) for sh in shapes])
        self.learn = [False, False, True, True, True, True]

    def forward(self, x: torch.Tensor, weights: list[torch.Tensor] | None = None) -> torch.Tensor:
        nm_w, nm_b, pn_w, pn_b, fc_w, fc_b = list(self.vars) if weights is None else weights
        gate = torch.sigmoid(F.linear(x, nm_w, nm_b))
        return F.linear(F.relu(F.linear(x, pn_w, pn_b)) * gate, fc_w, fc_b)


class _MetaLearningClassification(nn.Module):
    """Inner SGD steps over a class-by-class trajectory, meta-loss on a random batch after adaptation, Adam meta-step."""

    def __init__(self, bug: bool, update_lr: float = 0.1, meta_lr: float = 1e-3, update_step: int = 3) -> None:
        super().__init__()
        self.bug, self.update_lr, self.update_step = bug, update_lr, update_step
        self.net = _ANMLLearner()
        self.optimizer = torch.optim.Adam(self.net.parameters(), lr=meta_lr)

    def inner_update(self, x: torch.Tensor, fast_weights: list[torch.Tensor] | None, y: torch.Tensor,
                     create_graph: bool) -> list[torch.Tensor]:
        loss = F.cross_entropy(self.net(x, fast_weights), y)
        weights = list(self.net.vars) if fast_weights is None else fast_weights
        grad = torch.autograd.grad(loss, weights, allow_unused=False, create_graph=create_graph)
        return [w - self.update_lr * g if learn else w for g, w, learn in zip(grad, weights, self.net.learn)]

    def meta_loss(self, x_traj: torch.Tensor, y_traj: torch.Tensor, x_rand: torch.Tensor, y_rand: torch.Tensor,
                  create_graph: bool) -> torch.Tensor:
        fast_weights = self.inner_update(x_traj[0], None, y_traj[0], create_graph)
        for k in range(1, self.update_step):
            fast_weights = self.inner_update(x_traj[k], fast_weights, y_traj[k], create_graph)
        return F.cross_entropy(self.net(x_rand[0], fast_weights), y_rand[0])

    def forward(self, x_traj: torch.Tensor, y_traj: torch.Tensor, x_rand: torch.Tensor,
                y_rand: torch.Tensor) -> torch.Tensor:
        meta_loss = self.meta_loss(x_traj, y_traj, x_rand, y_rand, create_graph=not self.bug)
        self.net.zero_grad()
        meta_loss.backward()
        self.optimizer.step()
        return meta_loss


def _c15_data() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = _gen(1502)
    classes = torch.tensor([0, 1, 2])
    x_traj = torch.randn(3, 4, 10, generator=g) + classes.view(3, 1, 1).float()
    y_traj = classes.view(3, 1).expand(3, 4).clone()
    y_rand = torch.randint(0, 5, (1, 12), generator=g)
    x_rand = torch.randn(1, 12, 10, generator=g) + y_rand.unsqueeze(-1).float()
    return x_traj, y_traj, x_rand, y_rand


_C15_DATA = _c15_data()


def _c15_build(bug: bool) -> Case:
    """ANML meta-training step on one trajectory and random batch (inner gradients without a graph in the bug)."""
    torch.manual_seed(0)
    learner = _MetaLearningClassification(bug)

    def step() -> torch.Tensor:
        return learner(*_C15_DATA)

    return learner, step, _kw(optimizer=learner.optimizer, inputs=_C15_DATA[0])


def _c15_proof(bug: bool) -> bool:
    """The gradient Adam applies to the neuromodulation weights differs from the true gradient of the meta-loss
    (differentiated through the inner updates) in the bug, and matches it in the fix."""
    built, step, _ = _c15_build(bug)
    learner = cast(_MetaLearningClassification, built)
    params = list(learner.net.vars)
    true_grads = torch.autograd.grad(learner.meta_loss(*_C15_DATA, create_graph=True), params)
    applied: list[torch.Tensor] = []
    handle = learner.optimizer.register_step_pre_hook(
        lambda _o, _a, _k: applied.extend(p.grad.detach().clone() for p in params if p.grad is not None))
    step()
    handle.remove()
    nm_gap = max(float((a - t).abs().max()) for a, t in zip(applied[:2], true_grads[:2]))
    scale = max(float(t.abs().max()) for t in true_grads[:2])
    return len(applied) == len(params) and nm_gap > 1e-3 * scale


CASES: list[BlindCase] = [
    BlindCase("b24-case-11", "https://github.com/thesouther/MARL/issues/8", "rl-target-network",
              "the QMIX target mixing network is synced from itself, so it never follows the trained mixer and every "
              "TD target comes from the random initial mixer",
              _c11_build, _c11_proof,
              known_miss="the target mixer is loaded from itself every N steps: a target-network sync outside the audited step"),
    BlindCase("b24-case-12", "https://github.com/ligerfotis/mvitac/issues/2", "ema-target-not-updated",
              "the momentum update of the vision and tactile key encoders is commented out, so every contrastive "
              "loss is taken against keys from the frozen initial encoders",
              _c12_build, _c12_proof,
              known_miss="GRAD-001 FAILs on both sides: on the bug all 20 key-encoder tensors (none follows), on the twin "
                         "the 8 of the inter-modal key heads, which the repository's fix never momentum-updates either "
                         "(true of the twin; the copies it updates are INFO)",
              known_alarm=("GRAD-001",)),
    BlindCase("b24-case-13", "https://github.com/yxuansu/TaCL/issues/11", "teacher-train-mode",
              "the frozen teacher BERT is left in train mode with the student, so dropout re-draws the contrastive "
              "targets every step",
              _c13_build, _c13_proof),
    BlindCase("b24-case-14", "https://github.com/nv-tlabs/semanticGAN_code/issues/25", "gan-regulariser-no-grad",
              "the image discriminator's R1 step runs while its parameters still have requires_grad off, so the R1 "
              "penalty never reaches it and that optimizer step does nothing",
              _c14_build, _c14_proof,
              known_miss="the R1 backward runs with the discriminator's requires_grad off, so its optimizer step has no gradient: an optimizer step whose tensors got no gradient from the backward before it is not judged"),
    BlindCase("b24-case-15", "https://github.com/uvm-neurobotics-lab/ANML/issues/3", "meta-gradient-first-order",
              "the inner-loop gradients are taken without create_graph, so the meta-gradient of the neuromodulation "
              "network silently drops every term through the inner updates",
              _c15_build, _c15_proof,
              known_miss="inner-loop gradients without create_graph give a first-order meta-gradient: the order of the meta-gradient is not measured"),
]
