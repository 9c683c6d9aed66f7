"""Blind batch 20 (part b): silent training bugs in generative and perception models, each with its fixed twin.

Collected by someone who does not write the audit's checks. Every case is a tiny hand-written model that mirrors the
thread's code (diffusion denoisers, a Tacotron-style decoder, a mean-teacher segmenter, a VAE), built in code and run
on the CPU; nothing is downloaded. Each proof shows the bug without the audit.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tests._blind import BlindCase, Case
from tests._blind_batch5 import _gen, _kw

# --------------------------------------------------------------------------------------------- case-06
# harubaru/waifu-diffusion#64: the diffusers trainer runs fp16 training with a GradScaler and calls
# ``torch.nn.utils.clip_grad_norm_(unet.parameters(), 1.0)`` right after ``scaler.scale(loss).backward()``. The
# gradients are still multiplied by the loss scale at that point, so the clip compares the *scaled* norm with 1.0,
# always fires, and after ``scaler.step`` unscales them the optimizer gets gradients of norm 1/scale. Fix (PyTorch's
# AMP recipe quoted in the thread): call ``scaler.unscale_(optimizer)`` before clipping.


def _betas_alpha_bar(T: int = 50) -> torch.Tensor:
    betas = torch.linspace(1e-4, 0.2, T)
    return torch.cumprod(1.0 - betas, 0)


class _TinyUNet(nn.Module):
    """A two-level conv denoiser conditioned on the timestep (eps-prediction)."""

    def __init__(self, ch: int = 8, T: int = 50) -> None:
        super().__init__()
        self.t_emb = nn.Embedding(T, ch)
        self.inp = nn.Conv2d(3, ch, 3, padding=1)
        self.down = nn.Conv2d(ch, ch, 3, stride=2, padding=1)
        self.mid = nn.Conv2d(ch, ch, 3, padding=1)
        self.up = nn.ConvTranspose2d(ch, ch, 2, stride=2)
        self.norm = nn.GroupNorm(2, ch)
        self.out = nn.Conv2d(2 * ch, 3, 3, padding=1)

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        h0 = F.silu(self.inp(x) + self.t_emb(t)[:, :, None, None])
        h = F.silu(self.down(h0))
        h = F.silu(self.mid(h))
        h = self.norm(self.up(h))
        return self.out(torch.cat([h, h0], 1))


_C06_X0 = torch.rand(4, 3, 8, 8, generator=_gen(601)) * 2 - 1
_C06_NOISE = torch.randn(4, 3, 8, 8, generator=_gen(602))
_C06_T = torch.randint(0, 50, (4,), generator=_gen(603))
_C06_AB = _betas_alpha_bar()
_C06_MAX_NORM = 1.0


def _c06_loss(unet: _TinyUNet) -> torch.Tensor:
    ab = _C06_AB[_C06_T][:, None, None, None]
    noisy = ab.sqrt() * _C06_X0 + (1 - ab).sqrt() * _C06_NOISE
    with torch.autocast("cpu", dtype=torch.bfloat16):
        pred = unet(noisy, _C06_T)
    return F.mse_loss(pred.float(), _C06_NOISE)


def _c06_build(bug: bool) -> Case:
    """Mixed-precision diffusion fine-tune: GradScaler plus clip_grad_norm_ on the still-scaled gradients."""
    torch.manual_seed(0)
    unet = _TinyUNet().train()
    opt = torch.optim.AdamW(unet.parameters(), lr=1e-4, weight_decay=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)

    def step() -> torch.Tensor:
        opt.zero_grad()
        loss = _c06_loss(unet)
        scaler.scale(loss).backward()
        if not bug:
            scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(unet.parameters(), _C06_MAX_NORM)
        scaler.step(opt)
        scaler.update()
        return loss

    return unet, step, _kw(optimizer=opt, inputs=(_C06_X0, _C06_T))


def _c06_proof(bug: bool) -> bool:
    """The gradient the optimizer steps with has norm ~max_norm/scale: >1000x smaller than the true clipped one."""
    unet, step, _ = _c06_build(bug)
    opt_holder: dict[str, Any] = {}
    # the true (unscaled) gradient norm at the same weights
    ref = _TinyUNet()
    ref.load_state_dict(unet.state_dict())
    _c06_loss(ref).backward()
    true_norm = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), float("inf")))

    seen: list[float] = []

    def pre_hook(optimizer: torch.optim.Optimizer, *_: Any) -> None:
        g = [p.grad.flatten() for grp in optimizer.param_groups for p in grp["params"] if p.grad is not None]
        seen.append(float(torch.cat(g).norm()))

    opt = next(o for o in _find_optimizers(step))
    opt_holder["h"] = opt.register_step_pre_hook(pre_hook)
    step()
    opt_holder["h"].remove()
    expected = min(true_norm, _C06_MAX_NORM)
    return bool(seen) and seen[0] < 1e-3 * expected


def _find_optimizers(fn: Callable[..., Any]) -> list[torch.optim.Optimizer]:
    cells = [c.cell_contents for c in (fn.__closure__ or ())]
    return [c for c in cells if isinstance(c, torch.optim.Optimizer)]


# --------------------------------------------------------------------------------------------- case-07
# EDAPINENUT/GNTPP#5: ``GaussianDiffusion.p_losses`` builds ``x_noisy = q_sample(x_start, t, noise)``, gets the
# predicted noise ``x_recon = self.denoise_fn(x_noisy, t, cond=cond)`` and then computes
# ``loss = torch.square(x_noisy - x_recon).sum()``: the denoiser is regressed onto its own noisy input instead of the
# noise. The authors confirmed the wrong version was uploaded and fixed it to ``torch.square(noise - x_recon).sum()``.


class _CondDenoiser(nn.Module):
    """MLP eps-predictor for a conditional diffusion decoder of event embeddings (x_t, t, cond) -> eps."""

    def __init__(self, d: int = 4, c: int = 6, h: int = 64, T: int = 50) -> None:
        super().__init__()
        self.t_emb = nn.Embedding(T, h)
        self.inp = nn.Linear(d + c, h)
        self.mid = nn.Linear(h, h)
        self.out = nn.Linear(h, d)

    def forward(self, x: torch.Tensor, t: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        h = F.silu(self.inp(torch.cat([x, cond], -1)) + self.t_emb(t))
        return self.out(F.silu(self.mid(h)))


class _GaussianDiffusion(nn.Module):
    def __init__(self, bug: bool, T: int = 50) -> None:
        super().__init__()
        self.bug = bug
        self.T = T
        self.denoise_fn = _CondDenoiser(T=T)
        ab = _betas_alpha_bar(T)
        self.register_buffer("sqrt_ab", ab.sqrt())
        self.register_buffer("sqrt_1mab", (1 - ab).sqrt())

    def q_sample(self, x_start: torch.Tensor, t: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        return self.sqrt_ab[t][:, None] * x_start + self.sqrt_1mab[t][:, None] * noise

    def p_losses(self, x_start: torch.Tensor, t: torch.Tensor, cond: torch.Tensor,
                 noise: torch.Tensor) -> torch.Tensor:
        x_noisy = self.q_sample(x_start, t, noise)
        x_recon = self.denoise_fn(x_noisy, t, cond=cond)
        target = x_noisy if self.bug else noise
        return torch.square(target - x_recon).sum()


_C07_COND = torch.randn(32, 6, generator=_gen(701))
_C07_W = torch.randn(6, 4, generator=_gen(702)) * 0.6
_C07_X0 = torch.tanh(_C07_COND @ _C07_W)
_C07_G = _gen(703)
_C07_BATCHES = [(torch.randint(0, 50, (32,), generator=_C07_G), torch.randn(32, 4, generator=_C07_G))
                for _ in range(8)]
_C07_EVAL_T = torch.randint(0, 50, (256,), generator=_gen(704))
_C07_EVAL_N = torch.randn(256, 4, generator=_gen(705))
_C07_EVAL_C = _C07_COND.repeat(8, 1)
_C07_EVAL_X0 = _C07_X0.repeat(8, 1)


def _c07_build(bug: bool) -> Case:
    """Conditional DDPM decoder trained with torch.square(x_noisy - x_recon).sum() as its loss."""
    torch.manual_seed(0)
    model = _GaussianDiffusion(bug).train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    it = {"i": 0}

    def step() -> torch.Tensor:
        t, noise = _C07_BATCHES[it["i"] % len(_C07_BATCHES)]
        it["i"] += 1
        opt.zero_grad()
        loss = model.p_losses(_C07_X0, t, _C07_COND, noise)
        loss.backward()
        opt.step()
        return loss

    return model, step, _kw(optimizer=opt, inputs=(_C07_X0, _C07_BATCHES[0][0], _C07_COND))


def _c07_proof(bug: bool) -> bool:
    """After 150 steps, on the low-noise half of the timesteps (where x_t is mostly the clean sample, not the noise)
    the denoiser predicts the noise hardly better than predicting zero (per-element MSE >= 0.85; the twin's is ~0.7)."""
    model, step, _ = _c07_build(bug)
    for _ in range(150):
        step()
    low = _C07_EVAL_T < 25
    with torch.no_grad():
        xt = model.q_sample(_C07_EVAL_X0, _C07_EVAL_T, _C07_EVAL_N)
        pred = model.denoise_fn(xt, _C07_EVAL_T, _C07_EVAL_C)
        eps_mse = float(F.mse_loss(pred[low], _C07_EVAL_N[low]))
    return eps_mse >= 0.85


# --------------------------------------------------------------------------------------------- case-08
# NVIDIA/tacotron2#244: ``Tacotron2Loss`` is ``nn.MSELoss()(mel_out, mel_target) + nn.MSELoss()(mel_out_postnet,
# mel_target)`` over the whole padded batch. The padded frames of shorter utterances are zeros in the target while
# the decoder keeps predicting there, so the model is trained to output silence past each utterance's end and the
# real frames are down-weighted by the padding fraction. The maintainer agreed; the fix (PR #245, from Mozilla TTS)
# is a masked MSE: sum the squared error over the non-padded frames and divide by their count.


class _TinyTaco(nn.Module):
    """Text encoder + teacher-forced GRU mel decoder + residual postnet + stop-gate head (no output masking)."""

    def __init__(self, vocab: int = 20, d: int = 24, n_mels: int = 8) -> None:
        super().__init__()
        self.n_mels = n_mels
        self.emb = nn.Embedding(vocab, d, padding_idx=0)
        self.enc = nn.GRU(d, d, batch_first=True)
        self.prenet = nn.Linear(n_mels, d)
        self.dec = nn.GRU(2 * d, d, batch_first=True)
        self.mel_proj = nn.Linear(d, n_mels)
        self.gate = nn.Linear(d, 1)
        self.postnet = nn.Sequential(nn.Conv1d(n_mels, d, 5, padding=2), nn.Tanh(), nn.Conv1d(d, n_mels, 5, padding=2))

    def forward(self, text: torch.Tensor, mel: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        enc, _ = self.enc(self.emb(text))
        ctx = enc.mean(1, keepdim=True).expand(-1, mel.shape[1], -1)
        prev = F.pad(mel[:, :-1], (0, 0, 1, 0))  # teacher forcing: previous target frame
        h, _ = self.dec(torch.cat([F.relu(self.prenet(prev)), ctx], -1))
        mel_out = self.mel_proj(h)
        post = mel_out + self.postnet(mel_out.transpose(1, 2)).transpose(1, 2)
        return mel_out, post, self.gate(h).squeeze(-1)


_C08_TEXT = torch.randint(1, 20, (4, 7), generator=_gen(801))
_C08_LENS = torch.tensor([20, 14, 9, 6])
_C08_MASK = torch.arange(20)[None] < _C08_LENS[:, None]  # (B, T) True on real frames
_C08_MEL = torch.randn(4, 20, 8, generator=_gen(802)) * _C08_MASK[..., None]
_C08_GATE = (torch.arange(20)[None] >= (_C08_LENS[:, None] - 1)).float()


def _c08_loss(outputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor], bug: bool) -> torch.Tensor:
    mel_out, post, gate_out = outputs
    if bug:
        mel_loss = nn.MSELoss()(mel_out, _C08_MEL) + nn.MSELoss()(post, _C08_MEL)
    else:
        m = _C08_MASK[..., None].float()
        count = m.sum() * _C08_MEL.shape[-1]
        mel_loss = (((mel_out - _C08_MEL) ** 2) * m).sum() / count + (((post - _C08_MEL) ** 2) * m).sum() / count
    gate_loss = nn.BCEWithLogitsLoss()(gate_out.reshape(-1, 1), _C08_GATE.reshape(-1, 1))
    return mel_loss + gate_loss


def _c08_build(bug: bool) -> Case:
    """Tacotron-style TTS trained with an unmasked MSE over zero-padded mel targets."""
    torch.manual_seed(0)
    model = _TinyTaco().train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, weight_decay=1e-6)

    def step() -> torch.Tensor:
        opt.zero_grad()
        loss = _c08_loss(model(_C08_TEXT, _C08_MEL), bug)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return loss

    return model, step, _kw(optimizer=opt, inputs=(_C08_TEXT, _C08_MEL))


def _c08_proof(bug: bool) -> bool:
    """The mel loss sends gradient into the final (postnet) predictions at padded frames past each utterance's end."""
    model, _, _ = _c08_build(bug)
    mel_out, post, gate_out = model(_C08_TEXT, _C08_MEL)
    mel_out.retain_grad()
    post.retain_grad()
    _c08_loss((mel_out, post, gate_out), bug).backward()
    pad = ~_C08_MASK
    # post's padded frames feed nothing but the loss, so any gradient there comes from the loss itself
    return float(post.grad[pad].abs().sum()) > 0.0


# --------------------------------------------------------------------------------------------- case-09
# saltoricristiano/cosmix-uda#21: the mean-teacher ``MomentumUpdater.update`` does
# ``for op, mp in zip(online_net.parameters(), momentum_net.parameters()): mp.data.mul_(tau); mp.data.add_(...)``
# only. The teacher runs in eval mode to make pseudo-labels, so its BatchNorm running_mean/var are never updated:
# they stay at their initial values and get more and more misaligned with the EMA weights. Fix from the thread: also
# update the buffers (EMA for float buffers, copy for integer ones such as num_batches_tracked).


class _PointSeg(nn.Module):
    """Per-point segmenter: shared MLP with BatchNorm over points, then a per-point class head."""

    def __init__(self, d_in: int = 4, h: int = 16, n_cls: int = 3) -> None:
        super().__init__()
        self.fc1 = nn.Conv1d(d_in, h, 1)
        self.bn1 = nn.BatchNorm1d(h)
        self.fc2 = nn.Conv1d(h, h, 1)
        self.bn2 = nn.BatchNorm1d(h)
        self.head = nn.Conv1d(h, n_cls, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, C, N)
        h = F.relu(self.bn1(self.fc1(x)))
        h = F.relu(self.bn2(self.fc2(h)))
        return self.head(h)


class _MomentumUpdater:
    def __init__(self, tau: float, with_buffers: bool) -> None:
        self.cur_tau = tau
        self.with_buffers = with_buffers

    @torch.no_grad()
    def update(self, online_net: nn.Module, momentum_net: nn.Module) -> None:
        for op, mp in zip(online_net.parameters(), momentum_net.parameters()):
            mp.data.mul_(self.cur_tau)
            mp.data.add_(op.data * (1 - self.cur_tau))
        if self.with_buffers:
            for ob, mb in zip(online_net.buffers(), momentum_net.buffers()):
                if mb.is_floating_point():
                    mb.data.mul_(self.cur_tau)
                    mb.data.add_(ob.data * (1 - self.cur_tau))
                else:
                    mb.data.copy_(ob.data)


class _MeanTeacher(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.student = _PointSeg()
        self.teacher = _PointSeg()
        self.teacher.load_state_dict(self.student.state_dict())
        self.teacher.requires_grad_(False)

    def train(self, mode: bool = True) -> _MeanTeacher:
        super().train(mode)
        self.teacher.eval()  # the teacher only makes pseudo-labels
        return self


_C09_SRC = torch.randn(4, 4, 64, generator=_gen(901)) * 2.0 + 1.5
_C09_SRC_Y = (_C09_SRC[:, 0] > 1.5).long() + (_C09_SRC[:, 1] > 2.5).long()
_C09_TGT = torch.randn(4, 4, 64, generator=_gen(902)) * 2.5 + 2.0


def _c09_build(bug: bool) -> Case:
    """Mean-teacher domain adaptation for point segmentation whose EMA update skips the BatchNorm buffers."""
    torch.manual_seed(0)
    model = _MeanTeacher().train()
    opt = torch.optim.SGD(model.student.parameters(), lr=0.05, momentum=0.9)
    updater = _MomentumUpdater(0.9, with_buffers=not bug)

    def step() -> torch.Tensor:
        with torch.no_grad():
            pseudo = model.teacher(_C09_TGT).argmax(1)
        opt.zero_grad()
        loss = F.cross_entropy(model.student(_C09_SRC), _C09_SRC_Y) + \
            F.cross_entropy(model.student(_C09_TGT), pseudo)
        loss.backward()
        opt.step()
        updater.update(model.student, model.teacher)
        return loss

    return model, step, _kw(optimizer=opt, inputs=_C09_SRC)


def _c09_proof(bug: bool) -> bool:
    """After five steps the teacher's BatchNorm statistics are still exactly the init values (0 mean, 1 var)."""
    model, step, _ = _c09_build(bug)
    for _ in range(5):
        step()
    t = model.teacher
    return all(torch.equal(bn.running_mean, torch.zeros_like(bn.running_mean)) and
               torch.equal(bn.running_var, torch.ones_like(bn.running_var)) for bn in (t.bn1, t.bn2))


# --------------------------------------------------------------------------------------------- case-10
# rachtsingh/ibp_vae#3: ``reparametrize_gaussian(mu, logvar)`` returns ``mu + noise * logvar.exp()``, i.e. it scales
# the noise by the variance, while the KL term treats ``logvar`` as log-variance. The sampled posterior therefore
# is not the one the ELBO's KL is computed for, and results change (the reporter's IWAE differs from the paper).
# Fix from the thread: scale by the standard deviation, ``(0.5 * logvar).exp()``.


class _TinyVAE(nn.Module):
    def __init__(self, bug: bool, d: int = 16, h: int = 32, z: int = 4) -> None:
        super().__init__()
        self.bug = bug
        self.enc = nn.Linear(d, h)
        self.mu = nn.Linear(h, z)
        self.logvar = nn.Linear(h, z)
        self.dec = nn.Sequential(nn.Linear(z, h), nn.ReLU(), nn.Linear(h, d))

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = F.relu(self.enc(x))
        return self.mu(h), self.logvar(h)

    def reparametrize_gaussian(self, mu: torch.Tensor, logvar: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        scale = logvar.exp() if self.bug else (0.5 * logvar).exp()
        return mu + noise * scale

    def forward(self, x: torch.Tensor, noise: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        mu, logvar = self.encode(x)
        return self.dec(self.reparametrize_gaussian(mu, logvar, noise)), mu, logvar


_C10_X = (torch.rand(32, 16, generator=_gen(1001)) > 0.5).float()
_C10_G = _gen(1002)
_C10_NOISE = [torch.randn(32, 4, generator=_C10_G) for _ in range(6)]


def _c10_elbo_loss(model: _TinyVAE, noise: torch.Tensor) -> torch.Tensor:
    logits, mu, logvar = model(_C10_X, noise)
    rec = F.binary_cross_entropy_with_logits(logits, _C10_X, reduction="sum") / _C10_X.shape[0]
    kl = -0.5 * torch.sum(1 + logvar - mu.pow(2) - logvar.exp()) / _C10_X.shape[0]
    return rec + kl


def _c10_build(bug: bool) -> Case:
    """Bernoulli VAE whose reparametrisation multiplies the noise by exp(logvar) while the KL uses logvar."""
    torch.manual_seed(0)
    model = _TinyVAE(bug).train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    it = {"i": 0}

    def step() -> torch.Tensor:
        noise = _C10_NOISE[it["i"] % len(_C10_NOISE)]
        it["i"] += 1
        opt.zero_grad()
        loss = _c10_elbo_loss(model, noise)
        loss.backward()
        opt.step()
        return loss

    return model, step, _kw(optimizer=opt, inputs=(_C10_X, _C10_NOISE[0]))


def _c10_proof(bug: bool) -> bool:
    """After a few steps, the spread of the sampled z is not the posterior std exp(0.5*logvar) the KL assumes."""
    model, step, _ = _c10_build(bug)
    for _ in range(6):
        step()
    with torch.no_grad():
        mu, logvar = model.encode(_C10_X)
        eps = torch.randn(mu.shape, generator=_gen(1003))
        z = model.reparametrize_gaussian(mu, logvar, eps)
        used = (z - mu) / eps
    return float((used - (0.5 * logvar).exp()).abs().max()) > 1e-3


CASES: list[BlindCase] = [
    BlindCase("b20-case-06", "https://github.com/harubaru/waifu-diffusion/issues/64",
              "mixed precision / gradient clipping",
              "Gradients are clipped while still multiplied by the GradScaler's loss scale, so the clip always fires "
              "and the optimizer steps with gradients ~scale times too small.", _c06_build, _c06_proof),
    BlindCase("b20-case-07", "https://github.com/EDAPINENUT/GNTPP/issues/5", "diffusion loss target",
              "The diffusion loss regresses the predicted noise onto the noisy input x_t instead of the noise, so "
              "the denoiser never learns to predict the noise.", _c07_build, _c07_proof,
              known_miss="the denoiser's loss regresses onto x_t instead of the noise: a wrong target inside the loss arithmetic, with a gradient of the usual shape"),
    BlindCase("b20-case-08", "https://github.com/NVIDIA/tacotron2/issues/244", "padding mask / loss masking",
              "The mel MSE is taken over zero-padded frames too, so the decoder is trained to emit silence past each "
              "utterance and real frames are down-weighted by the padding.", _c08_build, _c08_proof,
              known_miss="the mel MSE covers zero-padded frames, but no mask reaches the model (lengths only): the audit does not know which frames are padding"),
    BlindCase("b20-case-09", "https://github.com/saltoricristiano/cosmix-uda/issues/21", "EMA / BatchNorm buffers",
              "The mean-teacher EMA updates only parameters; the eval-mode teacher's BatchNorm running stats never "
              "move from their init values.", _c09_build, _c09_proof),
    BlindCase("b20-case-10", "https://github.com/rachtsingh/ibp_vae/issues/3", "VAE reparameterisation",
              "The reparametrisation scales the noise by exp(logvar) (the variance) while the KL treats logvar as "
              "log-variance, so the sampled posterior is not the one the ELBO regularises.", _c10_build, _c10_proof,
              known_miss="the reparameterisation scales the noise by exp(logvar) instead of exp(logvar / 2): arithmetic inside the model's forward"),
]
