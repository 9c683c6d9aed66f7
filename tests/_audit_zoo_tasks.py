"""Correct training setups of common *tasks* (not architectures), each as a user would write it: distillation
with a frozen teacher in eval mode, BertModel as a bare encoder, padded encoder-decoder batches, contrastive
losses, preference losses, padded causal LMs, LoRA, a frozen BatchNorm backbone, a warmup schedule, class
weights and gradient accumulation. Tiny configs in code, no hub access.

Each ``Task.build()`` returns ``(model, step_fn, audit_kwargs)``; ``audit_kwargs`` holds ``optimizer`` and,
where the setup has one, ``lr_scheduler`` (and ``total_steps`` once ``audit`` accepts it).
"""

from __future__ import annotations

import copy
import inspect
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

V = 64  # vocabulary
PAD, BOS, EOS = 0, 1, 2

Built = tuple[nn.Module, Callable[[], Any], dict[str, Any]]


@dataclass(frozen=True)
class Task:
    name: str
    build: Callable[[], Built]
    unused: tuple[str, ...] = ()
    """name prefixes of trainable tensors this correct setup cannot move: a module it never runs (an unused
    pooler), or a bias the loss is invariant to (a pairwise loss on rewards ignores a shift shared by both)"""
    runs_backward: bool = False
    """step_fn runs backward itself (gradient accumulation); it returns the loss for logging only"""


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _seqs(lengths: list[int], seed: int = 0, eos: bool = False) -> list[list[int]]:
    """Token sequences of the given lengths, ids 4.. (clear of the special ids), ending in EOS if asked."""
    g = _gen(seed)
    out = []
    for n in lengths:
        ids = torch.randint(4, V, (n,), generator=g).tolist()
        out.append(ids[:-1] + [EOS] if eos else ids)
    return out


def _pad(seqs: list[list[int]], pad_id: int = PAD, side: str = "right") -> tuple[torch.Tensor, torch.Tensor]:
    """``input_ids`` and ``attention_mask`` of a batch padded as a tokenizer pads it (``padding_side``)."""
    width = max(len(s) for s in seqs)
    ids, mask = [], []
    for s in seqs:
        fill = [pad_id] * (width - len(s))
        ones, zeros = [1] * len(s), [0] * (width - len(s))
        ids.append(s + fill if side == "right" else fill + s)
        mask.append(ones + zeros if side == "right" else zeros + ones)
    return torch.tensor(ids), torch.tensor(mask)


def _lm_labels(ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Causal-LM labels: the inputs, with -100 on padding (the model shifts them itself)."""
    return ids.masked_fill(mask == 0, -100)


def _hf(cls_name: str, config_name: str, seed: int = 0, **cfg: Any) -> nn.Module:
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(seed)
    return getattr(transformers, cls_name)(getattr(transformers, config_name)(**cfg))


def _gpt2(cls_name: str = "GPT2LMHeadModel", layers: int = 2, width: int = 32, seed: int = 0, **cfg: Any) -> nn.Module:
    return _hf(cls_name, "GPT2Config", seed=seed, vocab_size=V, n_embd=width, n_layer=layers, n_head=4,
               n_positions=64, bos_token_id=BOS, eos_token_id=EOS, **cfg)


def _llama(cls_name: str = "LlamaForCausalLM", **cfg: Any) -> nn.Module:
    return _hf(cls_name, "LlamaConfig", vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, pad_token_id=PAD,
               bos_token_id=BOS, eos_token_id=EOS, **cfg)


def _bert_cfg(layers: int = 2, width: int = 32) -> dict[str, Any]:
    return dict(vocab_size=V, hidden_size=width, intermediate_size=2 * width, num_hidden_layers=layers,
                num_attention_heads=4, max_position_embeddings=64, pad_token_id=PAD)


def _adamw(*modules: nn.Module | nn.Parameter, lr: float = 1e-3) -> torch.optim.Optimizer:
    params: list[nn.Parameter] = []
    for m in modules:
        params += [m] if isinstance(m, nn.Parameter) else [p for p in m.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=lr, weight_decay=0.0)


def _freeze(module: nn.Module) -> nn.Module:
    """A teacher / reference model: no gradients, eval mode on purpose (no dropout, fixed statistics)."""
    module.requires_grad_(False)
    return module.eval()


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over the sequence of ``x`` (B, T, H) counting only real tokens (sentence-transformers' pooling)."""
    m = mask.unsqueeze(-1).to(x.dtype)
    return (x * m).sum(1) / m.sum(1).clamp(min=1e-9)


def _kd_loss(student: torch.Tensor, teacher: torch.Tensor, temperature: float = 2.0) -> torch.Tensor:
    """Hinton's distillation term: KL between softened distributions, scaled by T^2 (rows = predictions)."""
    s = F.log_softmax(student.reshape(-1, student.shape[-1]) / temperature, dim=-1)
    t = F.softmax(teacher.reshape(-1, teacher.shape[-1]) / temperature, dim=-1)
    return F.kl_div(s, t, reduction="batchmean") * temperature**2


# -- (1) distillation ---------------------------------------------------------------------------------------


def distill_gpt2() -> Built:
    """A 2-layer GPT-2 teacher distilled into a 1-layer, narrower student: KL on softened logits + CE."""
    teacher = _freeze(_gpt2(seed=1))
    student = _gpt2(layers=1, width=16, seed=0).train()
    ids, mask = _pad(_seqs([12, 9, 12, 7], eos=True))
    labels = _lm_labels(ids, mask)
    real = mask.bool()

    def step() -> torch.Tensor:
        out = student(input_ids=ids, attention_mask=mask, labels=labels)
        with torch.no_grad():
            t_logits = teacher(input_ids=ids, attention_mask=mask).logits
        kd = _kd_loss(out.logits[real], t_logits[real])
        return 0.5 * out.loss + 0.5 * kd

    return student, step, {"optimizer": _adamw(student)}


class _DistillWrapper(nn.Module):
    """The teacher lives inside the wrapper (as in many KD codebases); ``train()`` keeps it in eval mode."""

    def __init__(self, teacher: nn.Module, student: nn.Module, alpha: float = 0.5, temperature: float = 2.0):
        super().__init__()
        self.teacher = _freeze(teacher)
        self.student = student
        self.alpha, self.temperature = alpha, temperature

    def train(self, mode: bool = True) -> "_DistillWrapper":
        super().train(mode)
        self.teacher.eval()  # frozen on purpose: never dropout, whatever mode the wrapper is in
        return self

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        out = self.student(input_ids=input_ids, attention_mask=attention_mask, labels=labels)
        with torch.no_grad():
            t_logits = self.teacher(input_ids=input_ids, attention_mask=attention_mask).logits
        kd = _kd_loss(out.logits, t_logits, self.temperature)
        return self.alpha * out.loss + (1 - self.alpha) * kd


def distill_bert_teacher_submodule() -> Built:
    """A BERT sequence classifier distilled into a smaller one, the teacher a submodule of the wrapper."""
    teacher = _hf("BertForSequenceClassification", "BertConfig", seed=1, num_labels=3, **_bert_cfg(2, 32))
    student = _hf("BertForSequenceClassification", "BertConfig", seed=0, num_labels=3, **_bert_cfg(1, 16))
    model = _DistillWrapper(teacher, student).train()
    ids, mask = _pad(_seqs([10, 14, 8, 14]))
    labels = torch.tensor([0, 2, 1, 2])
    return model, lambda: model(ids, mask, labels), {"optimizer": _adamw(model)}


# -- (2) encoder-only ---------------------------------------------------------------------------------------


class _EncoderClassifier(nn.Module):
    """``BertModel`` as an encoder with the user's own pooling and linear head."""

    def __init__(self, pooling: str, add_pooling_layer: bool, num_labels: int = 3):
        super().__init__()
        from transformers import BertConfig, BertModel

        torch.manual_seed(0)
        self.encoder = BertModel(BertConfig(**_bert_cfg()), add_pooling_layer=add_pooling_layer)
        self.dropout = nn.Dropout(0.1)
        self.head = nn.Linear(32, num_labels)
        self.pooling = pooling

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        hidden = self.encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        pooled = hidden[:, 0] if self.pooling == "cls" else _masked_mean(hidden, attention_mask)
        return self.head(self.dropout(pooled))


def _encoder_task(pooling: str, add_pooling_layer: bool) -> Built:
    model = _EncoderClassifier(pooling, add_pooling_layer).train()
    ids, mask = _pad(_seqs([10, 14, 6, 12], seed=3))
    labels = torch.tensor([0, 1, 2, 1])
    return model, lambda: F.cross_entropy(model(ids, mask), labels), {"optimizer": _adamw(model)}


def bert_encoder_cls_pooler_unused() -> Built:
    """BertModel(add_pooling_layer=True), the [CLS] hidden state into the user's head: the pooler never runs."""
    return _encoder_task("cls", add_pooling_layer=True)


def bert_encoder_mean_no_pooler() -> Built:
    """BertModel(add_pooling_layer=False), masked mean pooling into the user's head."""
    return _encoder_task("mean", add_pooling_layer=False)


def sentence_embedding_cosine() -> Built:
    """Sentence-transformers style: mean pooling over attention_mask, cosine similarity of pairs against gold
    similarity scores (CosineSimilarityLoss), one encoder for both sides."""
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    encoder = BertModel(BertConfig(**_bert_cfg()), add_pooling_layer=False).train()
    a_ids, a_mask = _pad(_seqs([9, 14, 6, 11], seed=4))
    b_ids, b_mask = _pad(_seqs([12, 7, 13, 5], seed=5))
    gold = torch.tensor([0.9, 0.1, 0.5, 0.3])

    def embed(ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return _masked_mean(encoder(input_ids=ids, attention_mask=mask).last_hidden_state, mask)

    def step() -> torch.Tensor:
        return F.mse_loss(F.cosine_similarity(embed(a_ids, a_mask), embed(b_ids, b_mask)), gold)

    return encoder, step, {"optimizer": _adamw(encoder)}


# -- (3) encoder-decoder ------------------------------------------------------------------------------------


def _t5() -> nn.Module:
    return _hf("T5ForConditionalGeneration", "T5Config", vocab_size=V, d_model=32, d_kv=8, d_ff=64, num_layers=2,
               num_heads=4, decoder_start_token_id=PAD, pad_token_id=PAD, eos_token_id=EOS)


def _s2s_targets(lengths: list[int], seed: int = 7, bos: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Padded labels (-100 on padding) and the ``decoder_attention_mask`` of the decoder inputs the model builds
    from them (labels shifted right behind the start token)."""
    tgt, tgt_mask = _pad([[BOS] * bos + s for s in _seqs(lengths, seed=seed, eos=True)])
    labels = tgt.masked_fill(tgt_mask == 0, -100)
    dec_mask = torch.cat([torch.ones_like(tgt_mask[:, :1]), tgt_mask[:, :-1]], dim=1)
    return labels, dec_mask


def t5_padded_labels() -> Built:
    """T5 with right-padded sources, padded labels set to -100 and the decoder_attention_mask."""
    model = _t5().train()
    ids, mask = _pad(_seqs([12, 8, 12, 5], seed=6, eos=True))
    labels, dec_mask = _s2s_targets([6, 9, 4, 9])
    batch = {"input_ids": ids, "attention_mask": mask, "labels": labels, "decoder_attention_mask": dec_mask}
    return model, lambda: model(**batch).loss, {"optimizer": _adamw(model)}


def t5_left_padded_source() -> Built:
    """T5 fed a left-padded source batch (tokenizer padding_side="left"): relative positions, so it is fine."""
    model = _t5().train()
    ids, mask = _pad(_seqs([12, 8, 12, 5], seed=6, eos=True), side="left")
    labels, dec_mask = _s2s_targets([6, 9, 4, 9])
    batch = {"input_ids": ids, "attention_mask": mask, "labels": labels, "decoder_attention_mask": dec_mask}
    return model, lambda: model(**batch).loss, {"optimizer": _adamw(model)}


def bart_padded_batch() -> Built:
    """BART with a right-padded batch as its tokenizer builds it (<s> ... </s> <pad>), labels -100 on padding."""
    model = _hf("BartForConditionalGeneration", "BartConfig", vocab_size=V, d_model=32, encoder_layers=2,
                decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
                decoder_ffn_dim=64, max_position_embeddings=64, pad_token_id=PAD, bos_token_id=BOS,
                eos_token_id=EOS, decoder_start_token_id=EOS).train()
    src = [[BOS] + s for s in _seqs([11, 7, 13, 9], seed=8, eos=True)]
    ids, mask = _pad(src)
    labels, dec_mask = _s2s_targets([5, 8, 3, 8], seed=9, bos=True)
    batch = {"input_ids": ids, "attention_mask": mask, "labels": labels, "decoder_attention_mask": dec_mask}
    return model, lambda: model(**batch).loss, {"optimizer": _adamw(model)}


# -- (4) contrastive ----------------------------------------------------------------------------------------


class _SimCLR(nn.Module):
    """A small BatchNorm CNN encoder and a projection head (SimCLR)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.encoder = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                                     nn.Conv2d(8, 16, 3, stride=2, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                                     nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.projector = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.projector(self.encoder(x))


def _augment(x: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """A random crop-and-resize, a random horizontal flip and colour jitter, per image."""
    out = []
    for img in x:
        top, left = (int(v) for v in torch.randint(0, 5, (2,), generator=g))
        crop = img[:, top:top + 12, left:left + 12].unsqueeze(0)
        crop = F.interpolate(crop, size=16, mode="bilinear", align_corners=False)[0]
        if torch.rand((), generator=g) < 0.5:
            crop = crop.flip(-1)
        out.append(crop * (0.8 + 0.4 * torch.rand((), generator=g)) + 0.1 * torch.randn(crop.shape, generator=g))
    return torch.stack(out)


def _nt_xent(z1: torch.Tensor, z2: torch.Tensor, temperature: float = 0.5) -> torch.Tensor:
    """InfoNCE over 2N views: each view's positive is its other view, the other 2N-2 are negatives."""
    z = F.normalize(torch.cat([z1, z2]), dim=1)
    sim = z @ z.T / temperature
    sim = sim.masked_fill(torch.eye(len(z), dtype=torch.bool), float("-inf"))
    n = len(z1)
    targets = torch.cat([torch.arange(n, 2 * n), torch.arange(n)])
    return F.cross_entropy(sim, targets)


def simclr_two_views() -> Built:
    """SimCLR: two augmented views of each image through one encoder, NT-Xent loss."""
    model = _SimCLR().train()
    images = torch.rand(8, 3, 16, 16, generator=_gen(10))
    aug = _gen(11)

    def step() -> torch.Tensor:
        return _nt_xent(model(_augment(images, aug)), model(_augment(images, aug)))

    return model, step, {"optimizer": _adamw(model)}


class _DualEncoder(nn.Module):
    """CLIP-style: a BERT text tower and a ViT image tower, linear projections, a learnable temperature."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import BertConfig, BertModel, ViTConfig, ViTModel

        torch.manual_seed(0)
        self.text = BertModel(BertConfig(**_bert_cfg()), add_pooling_layer=False)
        self.image = ViTModel(ViTConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, image_size=16, patch_size=4), add_pooling_layer=False)
        self.text_proj = nn.Linear(32, 16, bias=False)
        self.image_proj = nn.Linear(32, 16, bias=False)
        self.logit_scale = nn.Parameter(torch.tensor(2.6593))  # log(1/0.07), as CLIP

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, pixel_values: torch.Tensor) -> torch.Tensor:
        t = self.text(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        t = F.normalize(self.text_proj(_masked_mean(t, attention_mask)), dim=-1)
        i = F.normalize(self.image_proj(self.image(pixel_values=pixel_values).last_hidden_state[:, 0]), dim=-1)
        logits = self.logit_scale.exp() * t @ i.T  # batch x batch: the diagonal are the true pairs
        targets = torch.arange(len(logits))
        return (F.cross_entropy(logits, targets) + F.cross_entropy(logits.T, targets)) / 2


def clip_dual_encoder() -> Built:
    """A CLIP-style dual encoder with the symmetric cross-entropy on the batch x batch similarity."""
    model = _DualEncoder().train()
    ids, mask = _pad(_seqs([9, 12, 6, 12], seed=12))
    pixels = torch.randn(4, 3, 16, 16, generator=_gen(13))
    return model, lambda: model(ids, mask, pixels), {"optimizer": _adamw(model)}


# -- (5) preference losses ----------------------------------------------------------------------------------


def _pairs(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Prompt + response sequences, right-padded: ids, attention_mask, and a mask of the response tokens."""
    g = _gen(seed)
    seqs, resp = [], []
    for p_len, r_len in [(5, 4), (3, 6), (6, 3), (4, 5)]:
        prompt = torch.randint(4, V, (p_len,), generator=g).tolist()
        response = torch.randint(4, V, (r_len - 1,), generator=g).tolist() + [EOS]
        seqs.append(prompt + response)
        resp.append([0] * p_len + [1] * r_len)
    ids, mask = _pad(seqs)
    response_mask, _ = _pad(resp, pad_id=0)
    return ids, mask, response_mask


def _sequence_logp(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor, response: torch.Tensor) -> torch.Tensor:
    """Sum of the log-probabilities of the response tokens (prompt and padding masked out), per sequence."""
    logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1]
    targets, keep = ids[:, 1:], response[:, 1:].to(logits.dtype)
    logp = torch.gather(logits.log_softmax(-1), 2, targets.unsqueeze(-1)).squeeze(-1)
    return (logp * keep).sum(-1)


def dpo_frozen_reference() -> Built:
    """DPO: the policy against a frozen copy of itself (the reference) kept in eval mode, beta = 0.1."""
    policy = _gpt2().train()
    reference = _freeze(copy.deepcopy(policy))
    chosen, rejected = _pairs(14), _pairs(15)

    def step() -> torch.Tensor:
        pi_c, pi_r = _sequence_logp(policy, *chosen), _sequence_logp(policy, *rejected)
        with torch.no_grad():
            ref_c, ref_r = _sequence_logp(reference, *chosen), _sequence_logp(reference, *rejected)
        return -F.logsigmoid(0.1 * ((pi_c - ref_c) - (pi_r - ref_r))).mean()

    return policy, step, {"optimizer": _adamw(policy)}


def reward_model_bradley_terry() -> Built:
    """A reward model: GPT-2 with a 1-output sequence-classification head, pairwise Bradley-Terry loss."""
    model = _gpt2("GPT2ForSequenceClassification", num_labels=1, pad_token_id=PAD).train()
    c_ids, c_mask, _ = _pairs(16)
    r_ids, r_mask, _ = _pairs(17)

    def step() -> torch.Tensor:
        r_chosen = model(input_ids=c_ids, attention_mask=c_mask).logits.squeeze(-1)
        r_rejected = model(input_ids=r_ids, attention_mask=r_mask).logits.squeeze(-1)
        return -F.logsigmoid(r_chosen - r_rejected).mean()

    return model, step, {"optimizer": _adamw(model)}


# -- (6) the rest -------------------------------------------------------------------------------------------


def _padded_lm_batch(seed: int = 18) -> dict[str, torch.Tensor]:
    ids, mask = _pad(_seqs([14, 9, 14, 6], seed=seed, eos=True))
    return {"input_ids": ids, "attention_mask": mask, "labels": _lm_labels(ids, mask)}


def causal_lm_right_padded() -> Built:
    """A Llama causal LM on a right-padded batch: attention_mask, labels -100 on padding."""
    model = _llama().train()
    batch = _padded_lm_batch()
    return model, lambda: model(**batch).loss, {"optimizer": _adamw(model)}


def gpt2_pad_is_eos() -> Built:
    """GPT-2 with pad_token_id = eos_token_id (the usual fix for its missing pad token): every sequence ends in a
    real, supervised EOS; only the padding after it (same id) is masked and labelled -100."""
    model = _gpt2(pad_token_id=EOS).train()
    ids, mask = _pad(_seqs([14, 9, 14, 6], seed=19, eos=True), pad_id=EOS)
    batch = {"input_ids": ids, "attention_mask": mask, "labels": _lm_labels(ids, mask)}
    return model, lambda: model(**batch).loss, {"optimizer": _adamw(model)}


def lora_padded_causal_lm() -> Built:
    """A peft LoRA fine-tune (q/v projections) of a Llama causal LM on a right-padded batch."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(_llama(), LoraConfig(r=4, lora_alpha=8, lora_dropout=0.05,
                                                target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
    model.train()
    batch = _padded_lm_batch(20)
    return model, lambda: model(**batch).loss, {"optimizer": _adamw(model)}


class _FrozenBackboneCNN(nn.Module):
    """A BatchNorm backbone frozen for linear probing; ``train()`` keeps it in eval so its statistics stay put."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.backbone = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                                      nn.Conv2d(8, 16, 3, stride=2, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                                      nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.backbone.requires_grad_(False)
        self.head = nn.Linear(16, 4)

    def train(self, mode: bool = True) -> "_FrozenBackboneCNN":
        super().train(mode)
        self.backbone.eval()
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(x))


def bn_cnn_frozen_backbone_eval() -> Built:
    """A frozen BatchNorm CNN backbone put in eval mode properly, a trainable linear head."""
    model = _FrozenBackboneCNN().train()
    x = torch.randn(8, 3, 16, 16, generator=_gen(21))
    y = torch.tensor([0, 1, 2, 3, 0, 1, 2, 3])
    return model, lambda: F.cross_entropy(model(x), y), {"optimizer": _adamw(model.head)}


def hf_linear_warmup_schedule() -> Built:
    """A BERT classifier with transformers' linear warmup/decay schedule (10 of 100 steps warm up)."""
    from transformers import get_linear_schedule_with_warmup

    from guardtower.preflight import audit

    model = _hf("BertForSequenceClassification", "BertConfig", num_labels=2, **_bert_cfg()).train()
    ids, mask = _pad(_seqs([10, 14, 8, 14], seed=22))
    batch = {"input_ids": ids, "attention_mask": mask, "labels": torch.tensor([0, 1, 1, 0])}
    opt = torch.optim.AdamW(model.parameters(), lr=5e-4, weight_decay=0.01)
    kwargs: dict[str, Any] = {"optimizer": opt,
                              "lr_scheduler": get_linear_schedule_with_warmup(opt, num_warmup_steps=10,
                                                                              num_training_steps=100)}
    if "total_steps" in inspect.signature(audit).parameters:
        kwargs["total_steps"] = 100
    return model, lambda: model(**batch).loss, kwargs


def class_weighted_ce_imbalanced() -> Built:
    """An MLP classifier on an imbalanced batch (10/4/2 of 3 classes), CE weighted by inverse class frequency."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.1), nn.Linear(32, 3)).train()
    y = torch.tensor([0] * 10 + [1] * 4 + [2] * 2)
    x = torch.randn(len(y), 8, generator=_gen(23)) + y.unsqueeze(1).float()
    counts = torch.bincount(y, minlength=3).float()
    weights = counts.sum() / (len(counts) * counts)  # sklearn's "balanced": n_samples / (n_classes * count)
    loss_fn = nn.CrossEntropyLoss(weight=weights)
    return model, lambda: loss_fn(model(x), y), {"optimizer": _adamw(model)}


def grad_accumulation_two_micro_batches() -> Built:
    """A step_fn that runs backward itself over 2 equal micro-batches, each loss divided by the count."""
    model = _gpt2().train()
    micro = [_padded_lm_batch(24), _padded_lm_batch(25)]
    accumulation = len(micro)

    def step() -> torch.Tensor:
        total = torch.zeros(())
        for batch in micro:
            loss = model(**batch).loss / accumulation
            loss.backward()
            total += loss.detach()
        return total

    return model, step, {"optimizer": _adamw(model)}


TASKS: list[Task] = [
    Task("distill_gpt2", distill_gpt2),
    Task("distill_bert_teacher_submodule", distill_bert_teacher_submodule),
    Task("bert_encoder_cls_pooler_unused", bert_encoder_cls_pooler_unused, unused=("encoder.pooler.",)),
    Task("bert_encoder_mean_no_pooler", bert_encoder_mean_no_pooler),
    Task("sentence_embedding_cosine", sentence_embedding_cosine),
    Task("t5_padded_labels", t5_padded_labels),
    Task("t5_left_padded_source", t5_left_padded_source),
    Task("bart_padded_batch", bart_padded_batch),
    Task("simclr_two_views", simclr_two_views),
    Task("clip_dual_encoder", clip_dual_encoder),
    Task("dpo_frozen_reference", dpo_frozen_reference),
    # ln_f.bias only shifts every reward by the same w.b (the score head has no bias): -logsigmoid(r_c - r_r)
    # cancels it, so its gradient is exactly zero
    Task("reward_model_bradley_terry", reward_model_bradley_terry, unused=("transformer.ln_f.bias",)),
    Task("causal_lm_right_padded", causal_lm_right_padded),
    Task("gpt2_pad_is_eos", gpt2_pad_is_eos),
    Task("lora_padded_causal_lm", lora_padded_causal_lm),
    Task("bn_cnn_frozen_backbone_eval", bn_cnn_frozen_backbone_eval),
    Task("hf_linear_warmup_schedule", hf_linear_warmup_schedule),
    Task("class_weighted_ce_imbalanced", class_weighted_ce_imbalanced),
    Task("grad_accumulation_two_micro_batches", grad_accumulation_two_micro_batches, runs_backward=True),
]
