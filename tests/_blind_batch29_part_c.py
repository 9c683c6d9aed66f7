"""Blind batch 29 (part c): silent training-loop bugs from public GitHub threads, each with its fixed twin.

Collected by someone who does not write the audit's checks. Theme: training-loop mechanics across domains
(on-policy distillation, PPO value targets, distributed samplers, gradient accumulation with clipping, a speech
seq2seq loss). Every case builds the user's setup on a tiny model (transformers Llama, GPT-2 and Moonshine models from
tiny configs in code, small hand-written actor-critic and vocoder modules; nothing is downloaded) and proves the bug
without the audit on real tensors and real steps.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tests._blind import BlindCase, Case
from tests._blind_batch5 import _gen, _kw, _llama_config

# --------------------------------------------------------------------------------------------- case-01
# huggingface/trl PR #2058 ("Mask loss in gkd when generating from the student", merged by the maintainers): in the
# GKD (on-policy distillation) trainer the student generates completions, shorter ones are right-padded with the pad
# token, and the generalized JSD between student and teacher token distributions is taken over EVERY position after
# the prompt, `logits[:, prompt_len:, :]`, summed and divided by batch*length. The padding positions are distilled
# like real tokens (the student is pulled towards the teacher's distribution after the end of the answer) and they
# dilute the real tokens' share of the loss; the slice is also one position late (it skips the prediction of the
# first completion token). Nothing errors and the loss goes down. Fix in the PR: labels with -100 at padding, logits
# sliced `[prompt_len-1:-1]`, the JSD masked with `labels != -100` and divided by the number of real tokens.

_C01_P = 5   # prompt length
_C01_T = 7   # completion length (right-padded with pad id 0)
_C01_PROMPTS = torch.randint(3, 40, (4, _C01_P), generator=_gen(2901))
_C01_COMPL = torch.randint(3, 40, (4, _C01_T), generator=_gen(2902))
_C01_COMPL[0, 3:] = 0
_C01_COMPL[1, 5:] = 0
_C01_COMPL[2, 2:] = 0


def _c01_batch() -> dict[str, torch.Tensor]:
    """What `generate_on_policy_outputs` returns: prompt + generated completion, pad masked in attention/labels."""
    ids = torch.cat([_C01_PROMPTS, _C01_COMPL], dim=1)
    attn = (ids != 0).long()
    labels = ids.clone()
    labels[labels == 0] = -100
    return {"input_ids": ids, "attention_mask": attn, "labels": labels, "prompts": _C01_PROMPTS}


def _c01_jsd(student_logits: torch.Tensor, teacher_logits: torch.Tensor, labels: torch.Tensor | None,
             beta: float = 0.5) -> torch.Tensor:
    """trl's generalized_jsd_loss (reduction="batchmean"), with the PR's optional label mask."""
    s = F.log_softmax(student_logits, dim=-1)
    t = F.log_softmax(teacher_logits, dim=-1)
    mix = beta * s + (1 - beta) * t
    kl_t = F.kl_div(mix, t, reduction="none", log_target=True)
    kl_s = F.kl_div(mix, s, reduction="none", log_target=True)
    jsd = beta * kl_t + (1 - beta) * kl_s
    if labels is None:
        return jsd.sum() / (jsd.size(0) * jsd.size(1))
    mask = labels != -100
    return jsd[mask].sum() / mask.sum()


def _c01_loss(student: nn.Module, teacher: nn.Module, inputs: dict[str, torch.Tensor], bug: bool,
              keep: list[torch.Tensor] | None = None) -> torch.Tensor:
    out_s = student(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"])
    if keep is not None:
        out_s.logits.retain_grad()
        keep.append(out_s.logits)
    teacher.eval()
    with torch.no_grad():
        out_t = teacher(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"])
    p = inputs["prompts"].shape[1]
    if bug:
        return _c01_jsd(out_s.logits[:, p:, :], out_t.logits[:, p:, :], None)
    return _c01_jsd(out_s.logits[:, p - 1:-1, :], out_t.logits[:, p - 1:-1, :], inputs["labels"][:, p:])


def _c01_models() -> tuple[nn.Module, nn.Module]:
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    student = LlamaForCausalLM(_llama_config()).train()
    torch.manual_seed(1)
    teacher = LlamaForCausalLM(_llama_config()).eval()
    teacher.requires_grad_(False)
    return student, teacher


def _c01_build(bug: bool) -> Case:
    """Tiny Llama student distilled from a tiny Llama teacher on a padded on-policy batch (GKD compute_loss)."""
    student, teacher = _c01_models()
    opt = torch.optim.AdamW(student.parameters(), lr=1e-3)
    inputs = _c01_batch()

    def step() -> torch.Tensor:
        opt.zero_grad()
        loss = _c01_loss(student, teacher, inputs, bug)
        loss.backward()
        opt.step()
        return loss

    return student, step, _kw(optimizer=opt, inputs=inputs)


def _c01_proof(bug: bool) -> bool:
    """The student's logits at positions whose next token is padding get gradient from the distillation loss."""
    student, teacher = _c01_models()
    inputs = _c01_batch()
    keep: list[torch.Tensor] = []
    _c01_loss(student, teacher, inputs, bug, keep).backward()
    grad = keep[0].grad
    assert grad is not None
    nxt_pad = torch.zeros(inputs["input_ids"].shape, dtype=torch.bool)
    nxt_pad[:, :-1] = inputs["input_ids"][:, 1:] == 0   # the token this position predicts is padding
    nxt_pad[:, -1] = True                                # the last position predicts nothing
    return bool(grad[nxt_pad].abs().sum() > 0)


# --------------------------------------------------------------------------------------------- case-02
# vwxyzjn/cleanrl PR #337 ("bug: incorrect logic in GAE calculation", merged by the maintainer, who wrote "#334
# actually introduced a major bug"): after a refactor the PPO rollout storage holds a zero-initialised `advantages`
# field and the GAE pass returns the advantages separately; the value targets were then built as
# `returns = storage.advantages + storage.values`, i.e. zeros + the old values. The critic is regressed onto its own
# predictions, its loss starts at exactly 0 and it never learns; the policy loss still uses the right advantages,
# so training runs and the policy loss moves. Fix in the PR: `returns = advantages + storage.values`.

_C02_T, _C02_N, _C02_OBS, _C02_ACT = 8, 2, 8, 4


class _C02Agent(nn.Module):
    """Shared trunk with an actor head (categorical policy) and a critic head, as in cleanrl's PPO."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(_C02_OBS, 32), nn.Tanh())
        self.actor = nn.Linear(32, _C02_ACT)
        self.critic = nn.Linear(32, 1)

    def forward(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.trunk(obs)
        return self.actor(h), self.critic(h).squeeze(-1)


@dataclass(frozen=True)
class _C02Storage:
    obs: torch.Tensor
    actions: torch.Tensor
    logprobs: torch.Tensor
    dones: torch.Tensor
    values: torch.Tensor
    rewards: torch.Tensor
    advantages: torch.Tensor
    returns: torch.Tensor


def _c02_rollout(agent: _C02Agent) -> _C02Storage:
    g = _gen(2911)
    obs = torch.randn(_C02_T, _C02_N, _C02_OBS, generator=g)
    rewards = torch.randn(_C02_T, _C02_N, generator=g)
    dones = (torch.rand(_C02_T, _C02_N, generator=g) < 0.15).float()
    with torch.no_grad():
        logits, values = agent(obs)
        dist = torch.distributions.Categorical(logits=logits)
        actions = torch.multinomial(dist.probs.reshape(-1, _C02_ACT), 1, generator=g).reshape(_C02_T, _C02_N)
        logprobs = dist.log_prob(actions)
    zeros = torch.zeros(_C02_T, _C02_N)
    return _C02Storage(obs, actions, logprobs, dones, values, rewards, zeros, zeros)


def _c02_gae(st: _C02Storage, next_value: torch.Tensor, next_done: torch.Tensor,
             gamma: float = 0.99, lam: float = 0.95) -> torch.Tensor:
    advantages = torch.zeros_like(st.rewards)
    lastgaelam = torch.zeros(_C02_N)
    for t in reversed(range(_C02_T)):
        if t == _C02_T - 1:
            nextnonterminal, nextvalues = 1.0 - next_done, next_value
        else:
            nextnonterminal, nextvalues = 1.0 - st.dones[t + 1], st.values[t + 1]
        delta = st.rewards[t] + gamma * nextvalues * nextnonterminal - st.values[t]
        lastgaelam = delta + gamma * lam * nextnonterminal * lastgaelam
        advantages[t] = lastgaelam
    return advantages


def _c02_storage(agent: _C02Agent, bug: bool) -> _C02Storage:
    st = _c02_rollout(agent)
    with torch.no_grad():
        _, next_value = agent(torch.randn(_C02_N, _C02_OBS, generator=_gen(2912)))
    advantages = _c02_gae(st, next_value, torch.zeros(_C02_N))
    returns = (st.advantages + st.values) if bug else (advantages + st.values)
    return replace(st, advantages=advantages, returns=returns)


def _c02_loss(agent: _C02Agent, st: _C02Storage, clip: float = 0.2, vf_coef: float = 0.5,
              ent_coef: float = 0.01) -> torch.Tensor:
    obs = st.obs.reshape(-1, _C02_OBS)
    logits, newvalue = agent(obs)
    dist = torch.distributions.Categorical(logits=logits)
    newlogprob = dist.log_prob(st.actions.reshape(-1))
    ratio = (newlogprob - st.logprobs.reshape(-1)).exp()
    adv = st.advantages.reshape(-1)
    adv = (adv - adv.mean()) / (adv.std() + 1e-8)
    pg_loss = torch.max(-adv * ratio, -adv * ratio.clamp(1 - clip, 1 + clip)).mean()
    v_loss = 0.5 * ((newvalue - st.returns.reshape(-1)) ** 2).mean()
    return pg_loss - ent_coef * dist.entropy().mean() + v_loss * vf_coef


def _c02_build(bug: bool) -> Case:
    """Tiny actor-critic, one PPO update on a fixed 8-step x 2-env rollout whose value targets the bug zeroes out."""
    torch.manual_seed(0)
    agent = _C02Agent()
    opt = torch.optim.Adam(agent.parameters(), lr=2.5e-4, eps=1e-5)
    st = _c02_storage(agent, bug)

    def step() -> torch.Tensor:
        opt.zero_grad()
        loss = _c02_loss(agent, st)
        loss.backward()
        nn.utils.clip_grad_norm_(agent.parameters(), 0.5)
        opt.step()
        return loss

    return agent, step, _kw(optimizer=opt, inputs=st.obs.reshape(-1, _C02_OBS))


def _c02_proof(bug: bool) -> bool:
    """After a real PPO update the critic head has not moved: its regression target is its own prediction."""
    model, step, _ = _c02_build(bug)
    assert isinstance(model, _C02Agent)
    before = model.critic.weight.detach().clone()
    actor_before = model.actor.weight.detach().clone()
    step()
    assert not torch.equal(model.actor.weight, actor_before)  # the policy does train
    return bool(torch.equal(model.critic.weight, before))


# --------------------------------------------------------------------------------------------- case-03
# kan-bayashi/ParallelWaveGAN issue #177 ("set_epoch on DataLoader is needed for distributed training", labelled bug;
# the maintainer fixed it in commit dc592cc "fixed shuffle in ddp training (#177)"): the vocoder trainer builds
# `DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True)` and a DataLoader over it, and loops
# over epochs without ever calling `sampler.set_epoch(epoch)`. The sampler seeds its permutation with the epoch, so
# every epoch replays exactly the same shuffled order on every rank (each rank also keeps the same shard forever).
# Training runs normally; the data is just never reshuffled. Fix: call `sampler["train"].set_epoch(epoch)` when an
# epoch finishes.

_C03_N, _C03_MEL, _C03_FRAMES, _C03_HOP = 16, 8, 8, 4


class _C03Dataset(torch.utils.data.Dataset[Any]):
    """(utterance id, mel, waveform) triples, as the vocoder's audio-mel dataset returns."""

    def __init__(self) -> None:
        g = _gen(2921)
        self.mel = torch.randn(_C03_N, _C03_MEL, _C03_FRAMES, generator=g)
        self.wav = torch.randn(_C03_N, 1, _C03_FRAMES * _C03_HOP, generator=g) * 0.1

    def __len__(self) -> int:
        return _C03_N

    def __getitem__(self, i: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        return i, self.mel[i], self.wav[i]


class _C03Generator(nn.Module):
    """A tiny upsampling conv generator: mel frames to waveform samples."""

    def __init__(self) -> None:
        super().__init__()
        self.pre = nn.Conv1d(_C03_MEL, 16, 3, padding=1)
        self.up = nn.ConvTranspose1d(16, 8, _C03_HOP, stride=_C03_HOP)
        self.post = nn.Conv1d(8, 1, 3, padding=1)

    def forward(self, mel: torch.Tensor) -> torch.Tensor:
        h = F.leaky_relu(self.pre(mel), 0.2)
        return torch.tanh(self.post(F.leaky_relu(self.up(h), 0.2)))


class _C03Trainer:
    """The trainer's loop, one optimizer step per call; at the end of an epoch the fix calls set_epoch."""

    def __init__(self, bug: bool) -> None:
        from torch.utils.data.distributed import DistributedSampler

        torch.manual_seed(0)
        self.bug = bug
        self.model = _C03Generator()
        self.opt = torch.optim.Adam(self.model.parameters(), lr=1e-3)
        self.sampler = DistributedSampler(_C03Dataset(), num_replicas=2, rank=0, shuffle=True)
        self.loader = torch.utils.data.DataLoader(self.sampler.dataset, batch_size=4, sampler=self.sampler)
        self.epochs = 0
        self.it = iter(self.loader)
        self.seen: list[list[int]] = [[]]

    def _next(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        try:
            return next(self.it)
        except StopIteration:
            self.epochs += 1
            if not self.bug:
                self.sampler.set_epoch(self.epochs)  # needed for shuffle in distributed training
            self.it = iter(self.loader)
            self.seen.append([])
            return next(self.it)

    def step(self) -> torch.Tensor:
        ids, mel, wav = self._next()
        self.seen[-1].extend(int(i) for i in ids)
        self.opt.zero_grad()
        y = self.model(mel)
        loss = F.l1_loss(y, wav) + F.mse_loss(y, wav)
        loss.backward()
        self.opt.step()
        return loss


def _c03_build(bug: bool) -> Case:
    """Tiny conv vocoder trained from a DataLoader over a DistributedSampler (rank 0 of 2)."""
    tr = _C03Trainer(bug)
    batch = next(iter(torch.utils.data.DataLoader(tr.sampler.dataset, batch_size=4)))
    return tr.model, tr.step, _kw(optimizer=tr.opt, inputs=batch[1])


def _c03_proof(bug: bool) -> bool:
    """Three real epochs of steps: every epoch feeds the samples in exactly the same order."""
    tr = _C03Trainer(bug)
    for _ in range(3 * 2):          # 8 samples per rank, batch 4: two steps per epoch
        tr.step()
    tr.step()                       # first step of the fourth epoch closes the third
    epochs = tr.seen[:3]
    return all(e == epochs[0] for e in epochs[1:])


# --------------------------------------------------------------------------------------------- case-04
# ApolloResearch/e2e_sae PR #70 ("Divide loss by grad accumulation steps", merged; it reverts #68, which had removed
# the division): the SAE training loop accumulates gradients over `n_gradient_accumulation_steps` micro-batches whose
# losses are MEANS (reconstruction MSE + sparsity coefficient * L1), calls backward on each undivided loss, then
# clips the gradient norm and steps Adam. The accumulated gradient is the SUM of the micro-batch gradients, n times
# the gradient of the configured effective batch, so `clip_grad_norm_` sees an n-times larger norm and clips (or
# clips harder) and the logged grad norm is inflated; nothing errors and the loss curve looks normal. Fix in the PR:
# `loss = loss / n_gradient_accumulation_steps` before backward.

_C04_ACCUM = 4
_C04_TOKENS = torch.randint(0, 48, (_C04_ACCUM, 2, 16), generator=_gen(2931))


class _C04SAE(nn.Module):
    """A sparse autoencoder on a frozen tiny GPT-2's residual stream after block 1 (the trained module)."""

    def __init__(self, d: int = 32, n_dict: int = 64) -> None:
        super().__init__()
        self.encoder = nn.Linear(d, n_dict)
        self.decoder = nn.Linear(n_dict, d)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c = torch.relu(self.encoder(x))
        return self.decoder(c), c


class _C04Wrapper(nn.Module):
    """The frozen transformer with the SAE inserted at one hook point (only the SAE trains)."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel

        torch.manual_seed(0)
        cfg = GPT2Config(vocab_size=48, n_positions=32, n_embd=32, n_layer=2, n_head=2, bos_token_id=1,
                         eos_token_id=2)
        self.tlens = GPT2LMHeadModel(cfg).eval()
        self.tlens.requires_grad_(False)
        self.sae = _C04SAE()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            acts = self.tlens(tokens, output_hidden_states=True).hidden_states[1]
        recon, c = self.sae(acts)
        return F.mse_loss(recon, acts) + 1e-2 * c.abs().sum(-1).mean()


def _c04_micro_backward(model: _C04Wrapper, bug: bool) -> None:
    for tokens in _C04_TOKENS:
        loss = model(tokens)
        if not bug:
            loss = loss / _C04_ACCUM
        loss.backward()


def _c04_build(bug: bool) -> Case:
    """One grad update of the SAE loop: four micro-batches accumulated, then clip_grad_norm_(1.0) and Adam."""
    model = _C04Wrapper()
    opt = torch.optim.Adam(model.sae.parameters(), lr=1e-3)

    def step() -> torch.Tensor:
        _c04_micro_backward(model, bug)
        nn.utils.clip_grad_norm_(model.sae.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        return model(_C04_TOKENS[-1]).detach()

    return model, step, _kw(optimizer=opt, inputs=_C04_TOKENS[0])


def _c04_proof(bug: bool) -> bool:
    """The accumulated gradient is n times the gradient of the effective batch's mean loss."""
    model = _C04Wrapper()
    _c04_micro_backward(model, bug)
    acc = [p.grad.detach().clone() for p in model.sae.parameters() if p.grad is not None]
    model.zero_grad()
    model(_C04_TOKENS.reshape(-1, 16)).backward()   # equal micro-batch sizes: mean of the means
    ref = [p.grad.detach().clone() for p in model.sae.parameters() if p.grad is not None]
    ratio = torch.cat([a.flatten() for a in acc]).norm() / torch.cat([r.flatten() for r in ref]).norm()
    return bool(abs(float(ratio) - 1.0) > 0.5)


# --------------------------------------------------------------------------------------------- case-05
# huggingface/transformers PR #46784 ("Fix Moonshine training-loss double-shift (train against labels, not
# labels[..., 1:])", merged after maintainer review): MoonshineForConditionalGeneration (a Whisper-style speech
# encoder-decoder) builds `decoder_input_ids = shift_tokens_right(labels, pad, decoder_start)` and then computes its
# training loss with `self.loss_function`, which is `ForCausalLMLoss` and shifts the labels a second time. Decoder
# position t, which has seen the transcript up to token t-1, is trained to predict token t+1 instead of token t; the
# last real token of every transcript is never a target. The loss still decreases (skipping a token is partly
# learnable), nothing errors, and the model learns to skip. Fix in the PR: a plain CrossEntropyLoss against the
# already-aligned labels, as Whisper and BART do. Reproduced as the released forward computed it: the step takes the
# logits of the right-shifted decoder inputs and applies the model's loss the released way (bug) or the PR's way.

_C05_WAV = torch.randn(4, 4000, generator=_gen(2941)) * 0.1
_C05_LABELS = torch.randint(3, 40, (4, 8), generator=_gen(2942))
_C05_LABELS[:, -1] = 2                 # eos
_C05_LABELS[1, 5:] = -100              # shorter transcripts padded with -100
_C05_LABELS[3, 4:] = -100


def _c05_model() -> nn.Module:
    from transformers import MoonshineConfig, MoonshineForConditionalGeneration

    torch.manual_seed(0)
    cfg = MoonshineConfig(vocab_size=40, hidden_size=32, intermediate_size=64, encoder_num_hidden_layers=1,
                          decoder_num_hidden_layers=1, encoder_num_attention_heads=2, decoder_num_attention_heads=2,
                          encoder_num_key_value_heads=2, decoder_num_key_value_heads=2, pad_token_id=0,
                          bos_token_id=1, eos_token_id=2, decoder_start_token_id=1)
    return MoonshineForConditionalGeneration(cfg).train()


def _c05_loss(model: Any, bug: bool, keep: list[torch.Tensor] | None = None) -> torch.Tensor:
    from transformers.models.moonshine.modeling_moonshine import shift_tokens_right

    cfg = model.config
    dec_in = shift_tokens_right(_C05_LABELS, cfg.pad_token_id, cfg.decoder_start_token_id)
    logits = model(input_values=_C05_WAV, decoder_input_ids=dec_in).logits
    if keep is not None:
        logits.retain_grad()
        keep.append(logits)
    if bug:   # the released forward: ForCausalLMLoss, which shifts the labels again
        return model.loss_function(logits=logits, labels=_C05_LABELS, vocab_size=cfg.vocab_size)
    return nn.CrossEntropyLoss()(logits.reshape(-1, cfg.vocab_size), _C05_LABELS.reshape(-1))


def _c05_build(bug: bool) -> Case:
    """Tiny Moonshine speech-to-text model, one AdamW step on a padded batch of 4 clips and transcripts."""
    model = _c05_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step() -> torch.Tensor:
        opt.zero_grad()
        loss = _c05_loss(model, bug)
        loss.backward()
        opt.step()
        return loss

    return model, step, _kw(optimizer=opt, inputs=_C05_WAV)


def _c05_proof(bug: bool) -> bool:
    """The token each decoder position is pulled towards (the most negative logit gradient) is not its label."""
    model = _c05_model()
    keep: list[torch.Tensor] = []
    _c05_loss(model, bug, keep).backward()
    grad = keep[0].grad
    assert grad is not None
    valid = _C05_LABELS != -100
    targets = grad.argmin(-1)
    return bool((targets[valid] != _C05_LABELS[valid]).any())


CASES: list[BlindCase] = [
    BlindCase("b29c-01", "https://github.com/huggingface/trl/pull/2058", "distillation loss over padding",
              "On-policy GKD distils the student towards the teacher at every post-prompt position, padding after "
              "the generated answer included and one position late, diluting the real tokens' loss.",
              _c01_build, _c01_proof),
    BlindCase("b29c-02", "https://github.com/vwxyzjn/cleanrl/pull/337", "PPO value target is the old value",
              "PPO value targets are built from the storage's zero-filled advantages plus the old values, so the "
              "critic is regressed onto its own predictions and never learns while the policy trains.",
              _c02_build, _c02_proof),
    BlindCase("b29c-03", "https://github.com/kan-bayashi/ParallelWaveGAN/issues/177",
              "sampler never reshuffled",
              "A DistributedSampler with shuffle=True is never given set_epoch, so every epoch replays the same "
              "sample order (and each rank the same shard) for the whole run.", _c03_build, _c03_proof,
              known_miss="a DistributedSampler never given set_epoch: one audited step cannot see the order repeat across epochs"),
    BlindCase("b29c-04", "https://github.com/ApolloResearch/e2e_sae/pull/70", "gradient accumulation scaling",
              "SAE training back-propagates each micro-batch's mean loss undivided, so the accumulated gradient is "
              "n times the effective batch's and gradient clipping acts on an inflated norm.",
              _c04_build, _c04_proof),
    BlindCase("b29c-05", "https://github.com/huggingface/transformers/pull/46784", "seq2seq labels shifted twice",
              "The speech encoder-decoder right-shifts the labels into decoder inputs and then uses a causal-LM loss "
              "that shifts them again, so each position is trained on the token after its own.",
              _c05_build, _c05_proof),
]
