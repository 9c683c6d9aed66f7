"""Blind batch 12, part a: silent training bugs from public framework threads, each with its fixed twin.

Collected by someone who does not write the audit's checks. Every case builds the user's setup on a tiny real
model (a plain torch timestep-conditioned conv noise predictor with the diffusers text-to-image example's EMA, a
ResNet-style CNN with a frozen BatchNorm feature extractor as in Lightning's fine-tuning example, and an MLP GAN
with one optimizer per network; transformers Qwen2 causal LM trained with gradient accumulation and a BART
summariser, both from tiny configs in code; nothing is downloaded) and proves the bug without the audit on real
runs and real tensors.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tests._blind import BlindCase, Case
from tests._blind_batch5 import _gen, _kw, _llama_config, _sgd_step  # noqa: F401


# --------------------------------------------------------------------------------------------- case-01
# diffusers train_text_to_image EMAModel.step writes its per-step (1 - decay) back into self.decay

_C01_X = torch.randn(4, 3, 16, 16, generator=_gen(1201))
_C01_NOISE = torch.randn(4, 3, 16, 16, generator=_gen(1202))
_C01_T = torch.randint(0, 1000, (4,), generator=_gen(1203))
_C01_STEPS = 40


class _NoisePredictor(nn.Module):
    """A tiny UNet-like noise predictor with a sinusoidal timestep embedding added after the first conv."""

    def __init__(self) -> None:
        super().__init__()
        self.inc = nn.Conv2d(3, 16, 3, padding=1)
        self.t_proj = nn.Linear(16, 16)
        self.down = nn.Conv2d(16, 32, 3, stride=2, padding=1)
        self.up = nn.ConvTranspose2d(32, 16, 2, stride=2)
        self.out = nn.Conv2d(32, 3, 3, padding=1)
        self.norm = nn.GroupNorm(4, 16)

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        freqs = torch.exp(-torch.arange(8, dtype=torch.float32) * (9.2 / 8))
        ang = t.float()[:, None] * freqs[None]
        emb = self.t_proj(torch.cat([ang.sin(), ang.cos()], -1))
        h1 = F.silu(self.norm(self.inc(x) + emb[:, :, None, None]))
        h2 = F.silu(self.down(h1))
        return self.out(torch.cat([F.silu(self.up(h2)), h1], 1))


class _EMAModel:
    """The example script's EMAModel: warmup decay min(decay, (1 + step) / (10 + step))."""

    def __init__(self, parameters: Any, bug: bool, decay: float = 0.9999) -> None:
        self.shadow_params = [p.detach().clone() for p in parameters]
        self.decay, self.bug, self.optimization_step = decay, bug, 0

    def get_decay(self, optimization_step: int) -> float:
        value = (1 + optimization_step) / (10 + optimization_step)
        return 1 - min(self.decay, value)

    @torch.no_grad()
    def step(self, parameters: Any) -> None:
        parameters = list(parameters)
        self.optimization_step += 1
        if self.bug:  # the report: the per-step 1 - decay overwrites self.decay and feeds the next min()
            self.decay = self.get_decay(self.optimization_step)
            one_minus_decay = self.decay
        else:
            one_minus_decay = self.get_decay(self.optimization_step)
        for s_param, param in zip(self.shadow_params, parameters):
            if param.requires_grad:
                s_param.sub_(one_minus_decay * (s_param - param))
            else:
                s_param.copy_(param)


def _c01_setup(bug: bool) -> tuple[Case, _EMAModel]:
    torch.manual_seed(0)
    unet = _NoisePredictor().train()
    ema = _EMAModel(unet.parameters(), bug)
    opt = torch.optim.AdamW(unet.parameters(), lr=1e-3)
    noisy = 0.7 * _C01_X + 0.7 * _C01_NOISE

    def step() -> torch.Tensor:
        opt.zero_grad()
        loss = F.mse_loss(unet(noisy, _C01_T), _C01_NOISE)
        loss.backward()
        opt.step()
        ema.step(unet.parameters())
        return loss

    return (unet, step, _kw(optimizer=opt, inputs=(noisy, _C01_T))), ema


def _c01_build(bug: bool) -> Case:
    return _c01_setup(bug)[0]


def _c01_proof(bug: bool) -> bool:
    """After 40 steps the EMA weights differ from the warmup-decay EMA recomputed from the recorded weights
    (the EMA sits much closer to the latest online weights: its per-step decay has collapsed to about 0.5)."""
    (model, step, _), ema = _c01_setup(bug)
    ref = [p.detach().clone() for p in model.parameters()]
    for i in range(1, _C01_STEPS + 1):
        step()
        one_minus = 1 - min(0.9999, (1 + i) / (10 + i))
        ref = [r - one_minus * (r - p.detach()) for r, p in zip(ref, model.parameters())]
    return not all(torch.allclose(s, r, rtol=1e-4, atol=1e-6) for s, r in zip(ema.shadow_params, ref))


# --------------------------------------------------------------------------------------------- case-02
# Lightning fine-tuning: the frozen, eval()-ed backbone is put back in train mode when validation ends

_C02_X = torch.randn(8, 3, 24, 24, generator=_gen(1211)) * 1.5 + 0.5
_C02_Y = torch.randint(0, 4, (8,), generator=_gen(1212))


class _Block(nn.Module):
    def __init__(self, c_in: int, c_out: int) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(c_in, c_out, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(c_out)
        self.conv2, self.bn2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=False), nn.BatchNorm2d(c_out)
        self.skip = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride=2, bias=False), nn.BatchNorm2d(c_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(h)) + self.skip(x))


class _TransferLearningModel(nn.Module):
    """The computer_vision_fine_tuning example's shape: a (pretend pretrained) ResNet-style feature extractor,
    frozen and set to eval(), and a trainable classifier on its pooled features."""

    def __init__(self) -> None:
        super().__init__()
        self.feature_extractor = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16),
                                               nn.ReLU(), _Block(16, 32), _Block(32, 32),
                                               nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.fc = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
        with torch.no_grad():  # "pretrained" running statistics, not the fresh 0 / 1
            for m in self.feature_extractor.modules():
                if isinstance(m, nn.BatchNorm2d) and m.running_mean is not None and m.running_var is not None:
                    m.running_mean.uniform_(-0.2, 0.2)
                    m.running_var.uniform_(0.5, 2.0)
        self.feature_extractor.requires_grad_(False)
        self.feature_extractor.eval()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.feature_extractor(x))


def _c02_build(bug: bool) -> Case:
    torch.manual_seed(0)
    model = _TransferLearningModel()
    model.train()  # what the evaluation loop does when validation (or the sanity check) ends
    if not bug:  # the fix: the module re-freezes its feature extractor's mode in on_train_epoch_start
        model.feature_extractor.eval()
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    return model, _sgd_step(model, opt, lambda: F.cross_entropy(model(_C02_X), _C02_Y)), \
        _kw(optimizer=opt, inputs=_C02_X)


def _c02_proof(bug: bool) -> bool:
    """One training step rewrites the frozen feature extractor's BatchNorm running statistics."""
    model, step, _ = _c02_build(bug)
    assert isinstance(model, _TransferLearningModel)
    before = {k: v.clone() for k, v in model.feature_extractor.state_dict().items() if "running" in k}
    step()
    after = model.feature_extractor.state_dict()
    return any(not torch.equal(v, after[k]) for k, v in before.items())


# --------------------------------------------------------------------------------------------- case-03
# Trainer gradient accumulation: each micro-batch's token-mean loss / accumulation steps, not sum / all tokens

_C03_ACCUM, _C03_LEN = 2, 12
_C03_IDS = torch.randint(3, 40, (_C03_ACCUM, 2, _C03_LEN), generator=_gen(1221))
_C03_KEEP = torch.tensor([[12, 10], [12, 12]])  # real (unpadded) length of each row
_C03_PROMPT = torch.tensor([[1, 2],  # micro-batch 0: short prompts, nearly every token is a trained answer token
                            [9, 10]])  # micro-batch 1: long prompts (masked out), 2-3 answer tokens per row


def _c03_batches() -> list[dict[str, torch.Tensor]]:
    out = []
    pos = torch.arange(_C03_LEN)
    for k in range(_C03_ACCUM):
        ids = _C03_IDS[k].clone()
        attn = (pos[None] < _C03_KEEP[k][:, None]).long()
        ids[attn == 0] = 0
        labels = ids.clone()
        labels[(pos[None] < _C03_PROMPT[k][:, None]) | (attn == 0)] = -100
        out.append({"input_ids": ids, "attention_mask": attn, "labels": labels})
    return out


_C03_BATCHES = _c03_batches()


def _c03_qwen2() -> nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return Qwen2ForCausalLM(Qwen2Config(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                                        pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False))


def _c03_items(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return (batch["labels"][:, 1:] != -100).sum()


def _c03_build(bug: bool) -> Case:
    torch.manual_seed(0)
    model = _c03_qwen2().train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    num_items_in_batch = sum(_c03_items(b) for b in _C03_BATCHES)

    def step() -> torch.Tensor:
        opt.zero_grad()
        total = torch.zeros(())
        for batch in _C03_BATCHES:
            if bug:  # the old compute_loss: the model's own token-mean, then / gradient_accumulation_steps
                loss = model(**batch).loss / _C03_ACCUM
            else:  # the fix: token-sum over this micro-batch / trained tokens in the whole accumulation window
                loss = model(**batch, num_items_in_batch=num_items_in_batch).loss
            loss.backward()
            total = total + loss.detach()
        opt.step()
        return total

    return model, step, _kw(optimizer=opt, inputs=_C03_BATCHES[0])


def _c03_proof(bug: bool) -> bool:
    """The accumulated gradient is not the gradient of the token-mean loss over all trained tokens of the window
    (what the same update without accumulation, one batch of all four rows, would apply)."""
    model, step, _ = _c03_build(bug)
    ref = copy.deepcopy(model)
    logits = [ref(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits for b in _C03_BATCHES]
    tok = torch.cat([F.cross_entropy(lg[:, :-1].reshape(-1, 40), b["labels"][:, 1:].reshape(-1), reduction="none",
                                     ignore_index=-100)[b["labels"][:, 1:].reshape(-1) != -100]
                     for lg, b in zip(logits, _C03_BATCHES)])
    params = [p for p in ref.parameters()]
    g_ref = torch.autograd.grad(tok.mean(), params)
    step()
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]
    num = torch.stack([(g - r).norm() for g, r in zip(grads, g_ref)]).norm()
    den = torch.stack([r.norm() for r in g_ref]).norm()
    return bool(num / den > 0.05)


# --------------------------------------------------------------------------------------------- case-04
# BART seq2seq fine-tuning with Trainer: target padding left as pad_token_id in labels, so the loss trains on pads

_C04_PAD, _C04_LEN = 1, 12
_C04_SRC = torch.randint(4, 40, (4, _C04_LEN), generator=_gen(1231))
_C04_SRC_LEN = torch.tensor([12, 9, 7, 10])
_C04_TGT = torch.randint(4, 40, (4, 8), generator=_gen(1232))
_C04_TGT_LEN = torch.tensor([8, 4, 3, 5])  # summaries of 3-8 tokens (with </s>), padded to 8


def _c04_batch(bug: bool) -> dict[str, torch.Tensor]:
    src = _C04_SRC.clone()
    attn = (torch.arange(_C04_LEN)[None] < _C04_SRC_LEN[:, None]).long()
    src[attn == 0] = _C04_PAD
    tgt = _C04_TGT.clone()
    pos = torch.arange(8)[None]
    tgt[pos == (_C04_TGT_LEN[:, None] - 1)] = 2  # </s>
    tgt[pos >= _C04_TGT_LEN[:, None]] = _C04_PAD  # the tokenizer pads the targets with <pad>
    if not bug:  # the fix: the collator replaces padding in the labels by -100, which CrossEntropyLoss ignores
        tgt[tgt == _C04_PAD] = -100
    return {"input_ids": src, "attention_mask": attn, "labels": tgt}


def _c04_bart() -> nn.Module:
    from transformers import BartConfig, BartForConditionalGeneration

    cfg = BartConfig(vocab_size=40, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
                     decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=32,
                     pad_token_id=_C04_PAD, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2,
                     forced_eos_token_id=2, dropout=0.1)
    return BartForConditionalGeneration(cfg)


def _c04_build(bug: bool) -> Case:
    torch.manual_seed(0)
    model = _c04_bart().train()
    opt = torch.optim.AdamW(model.parameters(), lr=5e-4)
    batch = _c04_batch(bug)
    return model, _sgd_step(model, opt, lambda: model(**batch).loss), _kw(optimizer=opt, inputs=batch)


def _c04_proof(bug: bool) -> bool:
    """The training loss has a gradient at the logits of target positions past each summary's </s>: the model is
    taught to predict <pad> after the end of every summary."""
    model, _, _ = _c04_build(bug)
    batch = _c04_batch(bug)
    torch.manual_seed(0)
    out = model(**batch)
    out.logits.retain_grad()
    out.loss.backward()
    grad = out.logits.grad
    assert grad is not None
    past_end = torch.arange(8)[None] >= _C04_TGT_LEN[:, None]
    return bool(grad[past_end].abs().sum() > 0)


# --------------------------------------------------------------------------------------------- case-05
# Lightning GAN with two optimizers: zero_grad only after each optimizer's step, so D keeps the G-phase gradients

_C05_LATENT, _C05_PIX, _C05_BS = 16, 64, 16
_C05_IMGS = torch.tanh(torch.randn(_C05_BS, _C05_PIX, generator=_gen(1241)))
_C05_Z = torch.randn(_C05_BS, _C05_LATENT, generator=_gen(1242))


class _GAN(nn.Module):
    """The basic-GAN example's generator (latent -> MLP -> tanh image) and discriminator (image -> MLP -> p)."""

    def __init__(self) -> None:
        super().__init__()
        self.generator = nn.Sequential(nn.Linear(_C05_LATENT, 64), nn.LeakyReLU(0.2), nn.Linear(64, 64),
                                       nn.LeakyReLU(0.2), nn.Linear(64, _C05_PIX), nn.Tanh())
        self.discriminator = nn.Sequential(nn.Linear(_C05_PIX, 64), nn.LeakyReLU(0.2), nn.Linear(64, 32),
                                           nn.LeakyReLU(0.2), nn.Linear(32, 1), nn.Sigmoid())

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.generator(z)

    def training_step(self, imgs: torch.Tensor, z: torch.Tensor, optimizer_idx: int) -> torch.Tensor:
        valid, fake = torch.ones(imgs.size(0), 1), torch.zeros(imgs.size(0), 1)
        if optimizer_idx == 0:  # generator: fool the discriminator
            return F.binary_cross_entropy(self.discriminator(self(z)), valid)
        real_loss = F.binary_cross_entropy(self.discriminator(imgs), valid)
        fake_loss = F.binary_cross_entropy(self.discriminator(self(z).detach()), fake)
        return (real_loss + fake_loss) / 2


def _c05_setup(bug: bool) -> tuple[Case, torch.optim.Optimizer]:
    torch.manual_seed(0)
    gan = _GAN().train()
    opt_g = torch.optim.Adam(gan.generator.parameters(), lr=2e-4, betas=(0.5, 0.999))
    opt_d = torch.optim.Adam(gan.discriminator.parameters(), lr=2e-4, betas=(0.5, 0.999))

    def step() -> torch.Tensor:
        # the trainer's loop over optimizers: training_step, backward, step, zero_grad (of that optimizer only)
        losses = []
        for idx, opt in enumerate((opt_g, opt_d)):
            if not bug:  # the fix: gradients the other network's loss left on this optimizer's params are cleared
                opt.zero_grad()
            loss = gan.training_step(_C05_IMGS, _C05_Z, idx)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss)
        return losses[1]

    return (gan, step, _kw(optimizer=opt_d, inputs=_C05_Z)), opt_d


def _c05_build(bug: bool) -> Case:
    return _c05_setup(bug)[0]


def _c05_proof(bug: bool) -> bool:
    """The gradient opt_d applies is not the discriminator loss's gradient: the generator loss's gradient w.r.t. the
    discriminator is still in it (checked just before opt_d.step(), against a fresh autograd.grad of the D loss)."""
    (gan, step, _), opt_d = _c05_setup(bug)
    assert isinstance(gan, _GAN)
    d_params = list(gan.discriminator.parameters())
    differs: list[bool] = []

    def before_d_step(*_: Any) -> None:
        fresh = torch.autograd.grad(gan.training_step(_C05_IMGS, _C05_Z, 1), d_params)
        differs.append(not all(p.grad is not None and torch.allclose(p.grad, g, rtol=1e-4, atol=1e-7)
                               for p, g in zip(d_params, fresh)))

    opt_d.register_step_pre_hook(before_d_step)
    step()
    step()
    return all(differs)


CASES: list[BlindCase] = [
    BlindCase("b12-case-01", "https://github.com/huggingface/diffusers/issues/1864", "EMA / decay schedule",
              "EMAModel.step stores its per-step 1 - decay in self.decay, which the next step's min() reads back: the "
              "EMA decay collapses to about 0.5 within ten steps and the EMA weights just trail the online UNet",
              _c01_build, _c01_proof,
              known_miss="blind batch 12: the EMA copy is updated outside any optimizer; its decay schedule is not walked"),
    BlindCase("b12-case-02", "https://github.com/Lightning-AI/pytorch-lightning/issues/2551",
              "BatchNorm mode / frozen backbone",
              "the evaluation loop ends with model.train(), undoing the eval() of the frozen feature extractor: its "
              "BatchNorm layers normalise with batch statistics and overwrite their pretrained running statistics "
              "while its weights stay frozen", _c02_build, _c02_proof),
    BlindCase("b12-case-03", "https://github.com/huggingface/transformers/pull/34191",
              "gradient accumulation / loss normalisation",
              "with gradient accumulation each micro-batch's loss is the mean over its own trained tokens divided by "
              "the accumulation steps: tokens in micro-batches with few trained tokens weigh many times more, and "
              "the update is not the full-batch token-mean gradient", _c03_build, _c03_proof),
    BlindCase("b12-case-04", "https://github.com/huggingface/transformers/pull/7828", "label masking / padding",
              "the summary targets are padded with pad_token_id in labels and BartForConditionalGeneration's "
              "CrossEntropyLoss only ignores -100: every padded position is a training target, the loss is "
              "dominated by easy <pad> predictions and the model learns to emit padding", _c04_build, _c04_proof),
    BlindCase("b12-case-05", "https://github.com/Lightning-AI/pytorch-lightning/issues/591",
              "stale gradients across optimizers (GAN)",
              "with one optimizer per network, zero_grad runs only on the optimizer that just stepped: the generator "
              "loss's backward leaves gradients on the discriminator, which the discriminator's own backward adds "
              "to, so every discriminator update also follows the generator's objective", _c05_build, _c05_proof),
]
