"""Blind batch 15 (part a): silent training bugs from public GitHub threads, each with its fixed twin."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tests._blind import BlindCase, Case
from tests._blind_batch5 import _gen, _kw, _sgd_step

# --------------------------------------------------------------------------------------------- case-01

_SOT, _EOT, _LANG, _TASK, _NOTS = 50, 49, 51, 52, 53  # <|startoftranscript|>, <|endoftext|>, <|en|>, <|transcribe|>, <|notimestamps|>


def _c01_model() -> nn.Module:
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    cfg = WhisperConfig(vocab_size=56, num_mel_bins=8, d_model=16, encoder_layers=1, decoder_layers=1,
                        encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
                        decoder_ffn_dim=32, max_source_positions=10, max_target_positions=16,
                        bos_token_id=_EOT, eos_token_id=_EOT, pad_token_id=_EOT, decoder_start_token_id=_SOT,
                        begin_suppress_tokens=None, suppress_tokens=None)
    return WhisperForConditionalGeneration(cfg)


def _c01_tokenize(text_ids: list[int]) -> list[int]:
    """What the Whisper tokenizer (language/task set, no timestamps) returns for a transcript."""
    return [_SOT, _LANG, _TASK, _NOTS, *text_ids, _EOT]


_C01_FEATS = torch.randn(3, 8, 20, generator=_gen(1501))
_C01_TEXTS = [[5, 9, 12, 7], [20, 3, 8], [14, 30, 2, 6, 11]]


def _c01_collate(bug: bool) -> torch.Tensor:
    """DataCollatorSpeechSeq2SeqWithPadding: pad labels with -100, cut the leading start token it will re-add."""
    seqs = [_c01_tokenize(t) for t in _C01_TEXTS]
    n = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), n), _EOT)
    mask = torch.zeros(len(seqs), n, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = torch.tensor(s)
        mask[i, :len(s)] = 1
    labels = ids.masked_fill(mask.ne(1), -100)
    start_id = _EOT if bug else _SOT  # bug: tokenizer.bos_token_id (<|endoftext|>); fix: decoder_start_token_id
    if (labels[:, 0] == start_id).all().cpu().item():
        labels = labels[:, 1:]
    return labels


def _c01_build(bug: bool) -> Case:
    """Whisper fine-tune whose collator looks for bos_token_id to strip the start token the model prepends again."""
    torch.manual_seed(0)
    model = _c01_model().train()
    labels = _c01_collate(bug)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = _sgd_step(model, opt, lambda: model(input_features=_C01_FEATS, labels=labels).loss)
    return model, step, _kw(optimizer=opt, inputs=(_C01_FEATS, labels))


def _c01_proof(bug: bool) -> bool:
    """After a short fine-tune, the model's first token after <|startoftranscript|> is a second start token,
    not the language token that generation forces next."""
    model, step, _ = _c01_build(bug)
    for _ in range(5):
        step()
    model.eval()
    with torch.no_grad():
        logits = model(input_features=_C01_FEATS, decoder_input_ids=torch.full((3, 1), _SOT)).logits
    return bool((logits[:, 0].argmax(-1) == _SOT).all())


# --------------------------------------------------------------------------------------------- case-02


def _c02_selective_scan(u: torch.Tensor, delta: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                        D: torch.Tensor, z: torch.Tensor, delta_bias: torch.Tensor) -> torch.Tensor:
    """selective_scan_ref: u, delta, z (b, d, l); A (d, n); B, C (b, n, l)."""
    delta = F.softplus(delta + delta_bias[..., None])
    dA = torch.exp(torch.einsum("bdl,dn->bdln", delta, A))
    dBu = torch.einsum("bdl,bnl,bdl->bdln", delta, B, u)
    x = u.new_zeros(u.shape[0], u.shape[1], A.shape[1])
    ys = []
    for i in range(u.shape[2]):
        x = dA[:, :, i] * x + dBu[:, :, i]
        ys.append(torch.einsum("bdn,bn->bd", x, C[:, :, i]))
    y = torch.stack(ys, 2) + u * D[:, None]
    return y * F.silu(z)


def _c02_mamba_inner(xz: torch.Tensor, conv_w: torch.Tensor, conv_b: torch.Tensor | None, x_proj_w: torch.Tensor,
                     dt_proj_w: torch.Tensor, out_proj_w: torch.Tensor, out_proj_b: torch.Tensor | None,
                     A: torch.Tensor, D: torch.Tensor, delta_bias: torch.Tensor) -> torch.Tensor:
    """mamba_inner_fn (reference path): the fused kernel is handed the projection *weights*, not the modules."""
    L, dt_rank, n = xz.shape[-1], dt_proj_w.shape[1], A.shape[1]
    x, z = xz.chunk(2, 1)
    x = F.silu(F.conv1d(x, conv_w, conv_b, padding=conv_w.shape[-1] - 1, groups=x.shape[1])[..., :L])
    x_dbl = F.linear(x.transpose(1, 2).reshape(-1, x.shape[1]), x_proj_w)  # ((b l), r + 2n)
    b = xz.shape[0]
    delta = (dt_proj_w @ x_dbl[:, :dt_rank].t()).reshape(-1, b, L).transpose(0, 1)
    Bm = x_dbl[:, dt_rank:dt_rank + n].reshape(b, L, n).transpose(1, 2)
    Cm = x_dbl[:, dt_rank + n:].reshape(b, L, n).transpose(1, 2)
    y = _c02_selective_scan(x, delta, A, Bm, Cm, D, z, delta_bias)
    return F.linear(y.transpose(1, 2), out_proj_w, out_proj_b)


class _C02Mamba(nn.Module):
    """mamba_simple.Mamba: in_proj, depthwise causal conv, x_proj / dt_proj, selective scan, out_proj."""

    def __init__(self, d_model: int, use_fast_path: bool, d_state: int = 4, d_conv: int = 3, expand: int = 2) -> None:
        super().__init__()
        d_inner = expand * d_model
        self.dt_rank = max(1, d_model // 16)
        self.d_state = d_state
        self.use_fast_path = use_fast_path
        self.in_proj = nn.Linear(d_model, 2 * d_inner, bias=False)
        self.conv1d = nn.Conv1d(d_inner, d_inner, d_conv, groups=d_inner, padding=d_conv - 1)
        self.x_proj = nn.Linear(d_inner, self.dt_rank + 2 * d_state, bias=False)
        self.dt_proj = nn.Linear(self.dt_rank, d_inner, bias=True)
        self.A_log = nn.Parameter(torch.log(torch.arange(1, d_state + 1).float().repeat(d_inner, 1)))
        self.D = nn.Parameter(torch.ones(d_inner))
        self.out_proj = nn.Linear(d_inner, d_model, bias=False)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        b, L, _ = hidden_states.shape
        xz = (self.in_proj.weight @ hidden_states.reshape(b * L, -1).t()).reshape(-1, b, L).transpose(0, 1)
        A = -torch.exp(self.A_log.float())
        if self.use_fast_path:
            return _c02_mamba_inner(xz, self.conv1d.weight, self.conv1d.bias, self.x_proj.weight,
                                    self.dt_proj.weight, self.out_proj.weight, self.out_proj.bias, A,
                                    self.D.float(), self.dt_proj.bias.float())
        x, z = xz.chunk(2, 1)
        x = F.silu(self.conv1d(x)[..., :L])
        x_dbl = self.x_proj(x.transpose(1, 2).reshape(b * L, -1))
        dt, Bm, Cm = torch.split(x_dbl, [self.dt_rank, self.d_state, self.d_state], dim=-1)
        dt = (self.dt_proj.weight @ dt.t()).reshape(-1, b, L).transpose(0, 1)
        Bm = Bm.reshape(b, L, -1).transpose(1, 2)
        Cm = Cm.reshape(b, L, -1).transpose(1, 2)
        y = _c02_selective_scan(x, dt, A, Bm, Cm, self.D.float(), z, self.dt_proj.bias.float())
        return self.out_proj(y.transpose(1, 2))


class _C02MambaLM(nn.Module):
    def __init__(self, use_fast_path: bool, vocab: int = 32, d: int = 16, n_layer: int = 2) -> None:
        super().__init__()
        self.embeddings = nn.Embedding(vocab, d)
        self.norms = nn.ModuleList([nn.LayerNorm(d) for _ in range(n_layer)])
        self.mixers = nn.ModuleList([_C02Mamba(d, use_fast_path) for _ in range(n_layer)])
        self.norm_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.embeddings(input_ids)
        for norm, mixer in zip(self.norms, self.mixers):
            h = h + mixer(norm(h))
        return self.lm_head(self.norm_f(h))


_C02_IDS = torch.randint(0, 32, (2, 12), generator=_gen(1502))


def _c02_build(bug: bool) -> Case:
    """PEFT LoRA on a Mamba LM's embeddings, x_proj and out_proj while the block runs its fused fast path (use_fast_path=True)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    base = _C02MambaLM(use_fast_path=bug)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["embeddings", "x_proj", "out_proj"])).train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)

    def loss_fn() -> torch.Tensor:
        logits = model(_C02_IDS)
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), _C02_IDS[:, 1:].reshape(-1))

    step = _sgd_step(model, opt, loss_fn)
    return model, step, _kw(optimizer=opt, inputs=_C02_IDS)


def _c02_proof(bug: bool) -> bool:
    """After a training step no LoRA adapter inside the Mamba mixers has a gradient, so they never move."""
    model, step, _ = _c02_build(bug)
    step()
    grads = [p.grad for n, p in model.named_parameters() if "lora_" in n and "mixers" in n]
    assert grads
    return all(g is None or float(g.abs().sum()) == 0.0 for g in grads)


# --------------------------------------------------------------------------------------------- case-03


class _C03Scheduler:
    """DDPMScheduler(beta_schedule="scaled_linear", prediction_type="v_prediction") as SD 2 (768-v) ships it."""

    prediction_type = "v_prediction"

    def __init__(self, steps: int = 1000) -> None:
        betas = torch.linspace(0.00085 ** 0.5, 0.012 ** 0.5, steps) ** 2
        self.alphas_cumprod = torch.cumprod(1.0 - betas, 0)
        self.num_train_timesteps = steps

    def _coef(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a = self.alphas_cumprod[t].view(-1, 1, 1, 1)
        return a.sqrt(), (1 - a).sqrt()

    def add_noise(self, x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        sa, s1 = self._coef(t)
        return sa * x0 + s1 * noise

    def get_velocity(self, x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        sa, s1 = self._coef(t)
        return sa * noise - s1 * x0

    def pred_original_sample(self, model_output: torch.Tensor, x_t: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """What step() reconstructs from the model output under v-prediction."""
        sa, s1 = self._coef(t)
        return sa * x_t - s1 * model_output


class _C03TinyUNet(nn.Module):
    """A small conditional denoiser: conv down/up with timestep and text-embedding conditioning."""

    def __init__(self, ch: int = 4, hid: int = 16, cond: int = 8) -> None:
        super().__init__()
        self.t_mlp = nn.Sequential(nn.Linear(1, hid), nn.SiLU(), nn.Linear(hid, hid))
        self.c_proj = nn.Linear(cond, hid)
        self.conv_in = nn.Conv2d(ch, hid, 3, padding=1)
        self.down = nn.Conv2d(hid, hid, 3, stride=2, padding=1)
        self.up = nn.ConvTranspose2d(hid, hid, 4, stride=2, padding=1)
        self.conv_out = nn.Conv2d(2 * hid, ch, 3, padding=1)

    def forward(self, x: torch.Tensor, t: torch.Tensor, enc: torch.Tensor) -> torch.Tensor:
        emb = self.t_mlp(t.float().view(-1, 1) / 1000.0) + self.c_proj(enc.mean(1))
        h0 = F.silu(self.conv_in(x) + emb[:, :, None, None])
        h = F.silu(self.up(F.silu(self.down(h0))))
        return self.conv_out(torch.cat([h0, h], 1))


_C03_LATENTS = torch.randn(4, 4, 8, 8, generator=_gen(1503)) * 0.18215
_C03_NOISE = torch.randn(4, 4, 8, 8, generator=_gen(1504))
_C03_T = torch.randint(0, 1000, (4,), generator=_gen(1505))
_C03_ENC = torch.randn(4, 5, 8, generator=_gen(1506))


def _c03_target(sched: _C03Scheduler, bug: bool) -> torch.Tensor:
    if bug:  # train_dreambooth.py before the fix: always regress on the noise
        return _C03_NOISE
    if sched.prediction_type == "epsilon":
        return _C03_NOISE
    return sched.get_velocity(_C03_LATENTS, _C03_NOISE, _C03_T)


def _c03_build(bug: bool) -> Case:
    """DreamBooth on a v-prediction (SD 2.x 768) model with the epsilon-only loss of the original script."""
    torch.manual_seed(0)
    unet = _C03TinyUNet().train()
    sched = _C03Scheduler()
    opt = torch.optim.AdamW(unet.parameters(), lr=5e-6)

    def loss_fn() -> torch.Tensor:
        noisy = sched.add_noise(_C03_LATENTS, _C03_NOISE, _C03_T)
        noise_pred = unet(noisy, _C03_T, _C03_ENC)
        return F.mse_loss(noise_pred.float(), _c03_target(sched, bug).float(), reduction="mean")

    step = _sgd_step(unet, opt, loss_fn)
    return unet, step, _kw(optimizer=opt, inputs=(_C03_LATENTS, _C03_T, _C03_ENC))


def _c03_proof(bug: bool) -> bool:
    """A denoiser that hit the training target exactly would, read as v by the v-prediction sampler, rebuild a
    clean latent far from the true one (for the fixed target the rebuild is exact)."""
    sched = _C03Scheduler()
    noisy = sched.add_noise(_C03_LATENTS, _C03_NOISE, _C03_T)
    x0 = sched.pred_original_sample(_c03_target(sched, bug), noisy, _C03_T)
    err = float((x0 - _C03_LATENTS).pow(2).mean() / _C03_LATENTS.pow(2).mean())
    return err > 0.1


# --------------------------------------------------------------------------------------------- case-04


class _C04DecoderOnlyTransformer(nn.Module):
    """Autoregressive prior over VQ-VAE code indices: token + position embeddings, causal self-attention."""

    def __init__(self, num_tokens: int = 17, max_seq_len: int = 17, d: int = 16, depth: int = 2) -> None:
        super().__init__()
        self.tok = nn.Embedding(num_tokens, d)
        self.pos = nn.Embedding(max_seq_len, d)
        layer = nn.TransformerEncoderLayer(d, 2, 32, dropout=0.0, batch_first=True)
        self.blocks = nn.TransformerEncoder(layer, depth)
        self.to_logits = nn.Linear(d, num_tokens)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        L = x.shape[1]
        h = self.tok(x) + self.pos(torch.arange(L))[None]
        mask = nn.Transformer.generate_square_subsequent_mask(L)
        return self.to_logits(self.blocks(h, mask=mask, is_causal=True))


_C04_BOS = 16  # codebook of 16 entries; BOS is the extra token
_C04_CODES = torch.randint(0, 16, (4, 16), generator=_gen(1507))  # vqvae.index_quantize(images).reshape(B, -1)


def _c04_inputs() -> torch.Tensor:
    return F.pad(_C04_CODES, (1, 0), value=_C04_BOS)  # BOS prepended: (B, 17)


def _c04_loss(model: nn.Module, bug: bool) -> torch.Tensor:
    latent = _c04_inputs()
    logits = model(latent).transpose(1, 2)  # (B, V, L) for CrossEntropyLoss
    if bug:
        return F.cross_entropy(logits, latent)
    return F.cross_entropy(logits[:, :, :-1], latent[:, 1:])


def _c04_build(bug: bool) -> Case:
    """Transformer prior over VQ-VAE latents trained with the logits compared to the unshifted input tokens."""
    torch.manual_seed(0)
    model = _C04DecoderOnlyTransformer().train()
    opt = torch.optim.Adam(model.parameters(), lr=5e-4)
    step = _sgd_step(model, opt, lambda: _c04_loss(model, bug))
    return model, step, _kw(optimizer=opt, inputs=_c04_inputs())


def _c04_proof(bug: bool) -> bool:
    """The token that position 5's logits are scored against is visible to position 5: changing that target
    token changes the very logits it grades (the target leaks into the input)."""
    model, _, _ = _c04_build(bug)
    model.eval()
    x = _c04_inputs()
    pos = 5
    tgt_pos = pos if bug else pos + 1  # which input token is position 5's training target
    alt = x.clone()
    alt[:, tgt_pos] = (alt[:, tgt_pos] + 1) % 16
    with torch.no_grad():
        a, b = model(x)[:, pos], model(alt)[:, pos]
    return float((a - b).abs().max()) > 1e-6


# --------------------------------------------------------------------------------------------- case-05


class _C05FCN32s(nn.Module):
    """FCN-32s in miniature: conv/pool trunk, fc6/fc7 as convs with Dropout2d, score_fr and a 32x-style upscore."""

    def __init__(self, n_class: int = 5) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.pool1 = nn.MaxPool2d(2, stride=2, ceil_mode=True)
        self.conv2 = nn.Conv2d(8, 16, 3, padding=1)
        self.pool2 = nn.MaxPool2d(2, stride=2, ceil_mode=True)
        self.fc6 = nn.Conv2d(16, 32, 3, padding=1)
        self.drop6 = nn.Dropout2d()
        self.fc7 = nn.Conv2d(32, 32, 1)
        self.drop7 = nn.Dropout2d()
        self.score_fr = nn.Conv2d(32, n_class, 1)
        self.upscore = nn.ConvTranspose2d(n_class, n_class, 8, stride=4, padding=2, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.pool1(F.relu(self.conv1(x)))
        h = self.pool2(F.relu(self.conv2(h)))
        h = self.drop6(F.relu(self.fc6(h)))
        h = self.drop7(F.relu(self.fc7(h)))
        return self.upscore(self.score_fr(h))


_C05_X = torch.randn(2, 3, 16, 16, generator=_gen(1508))
_C05_Y = torch.randint(0, 5, (2, 16, 16), generator=_gen(1509))
_C05_VX = torch.randn(2, 3, 16, 16, generator=_gen(1510))
_C05_VY = torch.randint(0, 5, (2, 16, 16), generator=_gen(1511))


class _C05Trainer:
    """torchfcn.Trainer: validates every interval_validate iterations, in the middle of the epoch."""

    def __init__(self, model: nn.Module, optim: torch.optim.Optimizer, bug: bool, interval_validate: int = 4) -> None:
        self.model, self.optim, self.bug = model, optim, bug
        self.interval_validate = interval_validate
        self.iteration = 0

    def validate(self) -> float:
        training = self.model.training
        self.model.eval()
        with torch.no_grad():
            score = self.model(_C05_VX)
            val_loss = float(F.cross_entropy(score, _C05_VY, reduction="sum")) / len(_C05_VX)
        if not self.bug and training:
            self.model.train()
        return val_loss

    def train_iteration(self) -> torch.Tensor:
        if self.iteration % self.interval_validate == 0:
            self.validate()
        self.optim.zero_grad()
        score = self.model(_C05_X)
        loss = F.cross_entropy(score, _C05_Y, reduction="sum") / len(_C05_X)
        loss.backward()
        self.optim.step()
        self.iteration += 1
        return loss


def _c05_build(bug: bool) -> Case:
    """FCN trainer whose mid-epoch validate() switches the model to eval and never switches it back."""
    torch.manual_seed(0)
    model = _C05FCN32s()
    model.train()  # train_epoch() sets train mode once, at the start of the epoch
    optim = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.99, weight_decay=5e-4)
    trainer = _C05Trainer(model, optim, bug)
    return model, trainer.train_iteration, _kw(optimizer=optim, inputs=_C05_X)


def _c05_proof(bug: bool) -> bool:
    """The training forward that follows the validation runs with its dropout layers in eval mode."""
    model, step, _ = _c05_build(bug)
    seen: list[tuple[bool, bool]] = []
    drop6: nn.Module = model.get_submodule("drop6")
    drop6.register_forward_hook(lambda m, i, o: seen.append((torch.is_grad_enabled(), m.training)))
    step()
    train_forwards = [tr for grad, tr in seen if grad]
    assert train_forwards
    return not any(train_forwards)


CASES: list[BlindCase] = [
    BlindCase("b15-case-01", "https://github.com/huggingface/transformers/issues/29973", "label construction",
              "the Whisper collator checks labels for bos_token_id instead of decoder_start_token_id, so the start "
              "token is never stripped and the model is trained on a doubled <|startoftranscript|>",
              _c01_build, _c01_proof,
              known_miss="the labels start with the decoder start token twice; no check compares the label prefix "
                         "with the decoder_start_token_id the model prepends itself"),
    BlindCase("b15-case-02", "https://github.com/state-spaces/mamba/issues/279", "adapter bypassed",
              "the Mamba block's fused fast path reads x_proj.weight / out_proj.weight directly, so PEFT LoRA "
              "adapters wrapped around those layers are never in the graph and get no gradient",
              _c02_build, _c02_proof),
    BlindCase("b15-case-03", "https://github.com/huggingface/diffusers/issues/1429", "wrong regression target",
              "fine-tuning a v-prediction Stable Diffusion 2 model with the script's epsilon loss trains the UNet to "
              "output noise where the scheduler reads velocity",
              _c03_build, _c03_proof,
              known_miss="the regression target (noise instead of velocity) is a choice of loss arithmetic outside "
                         "the model; no measurement sees which target the scheduler expects"),
    BlindCase("b15-case-04", "https://github.com/Project-MONAI/GenerativeModels/issues/314", "target leakage",
              "the latent transformer's logits are scored against the unshifted input tokens, so each position is "
              "trained to copy a token it can already see instead of predicting the next one",
              _c04_build, _c04_proof),
    BlindCase("b15-case-05", "https://github.com/wkentaro/pytorch-fcn/pull/56", "train/eval mode",
              "validation in the middle of an epoch puts the FCN in eval mode and nothing switches it back, so the "
              "rest of the epoch trains with dropout turned off",
              _c05_build, _c05_proof),
]
