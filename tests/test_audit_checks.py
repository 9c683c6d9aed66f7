"""Every core catalog entry: a realistic setup that triggers it and a clean counterpart that does not."""

from __future__ import annotations

import copy
from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from guardtower.preflight import audit
from guardtower.failure_modes import _CORE
from guardtower.severity import Severity

from tests._audit_core_helpers import (
    SmallCNN, VOCAB, Case, bert_mlm, case_registry, gpt2, llama, mlp, regression_batch, token_batch,
)

CASES, case = case_registry()


def _classifier(bug_softmax: bool = False) -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 5)]
    if bug_softmax:
        layers.append(nn.Softmax(dim=-1))
    return nn.Sequential(*layers)


_X, _Y = regression_batch()
_LABELS = torch.arange(16) % 5


# --- loss -----------------------------------------------------------------------------------------------------
@case("LOSS-001")
def _loss_detached(bug: bool) -> Case:
    m = mlp()

    def step() -> torch.Tensor:
        loss = F.mse_loss(m(_X), _Y)
        return torch.tensor(loss.item()) if bug else loss  # "cleaned up" for logging

    return m, step, {}


@case("LOSS-001/rewrapped")
def _loss_rewrapped_as_leaf(bug: bool) -> Case:
    m = mlp()

    def step() -> torch.Tensor:
        loss = F.mse_loss(m(_X), _Y)
        if not bug:
            return loss
        # backward() raised "element 0 of tensors does not require grad", so the loss was rebuilt to require it
        return torch.tensor(loss.item(), requires_grad=True)

    return m, step, {}


@case("LOSS-002")
def _loss_not_scalar(bug: bool) -> Case:
    m = _classifier()
    crit = nn.CrossEntropyLoss(reduction="none" if bug else "mean")
    return m, lambda: crit(m(_X), _LABELS), {}


@case("LOSS-003")
def _loss_nan(bug: bool) -> Case:
    m = mlp()
    # a log-likelihood on raw outputs (no softplus) goes NaN for negative predictions
    return m, lambda: -torch.log(m(_X) if bug else F.softplus(m(_X))).mean(), {}


@case("LOSS-004")
def _double_softmax(bug: bool) -> Case:
    m = _classifier(bug_softmax=bug)
    crit = nn.CrossEntropyLoss()
    return m, lambda: crit(m(_X), _LABELS), {}


@case("LOSS-004/bce")
def _double_sigmoid(bug: bool) -> Case:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3), *( [nn.Sigmoid()] if bug else []))
    targets = (torch.arange(48).reshape(16, 3) % 2).float()
    crit = nn.BCEWithLogitsLoss()
    return m, lambda: crit(m(_X), targets), {}


@case("LOSS-005")
def _broadcast_target(bug: bool) -> Case:
    m = mlp()
    target = _Y.squeeze(-1) if bug else _Y  # (16,) from a dataset of scalars vs (16, 1) predictions
    return m, lambda: nn.MSELoss()(m(_X), target), {}


@case("LOSS-006")
def _step_raises(bug: bool) -> Case:
    m = mlp()
    x = _X[:, :7] if bug else _X  # a feature dropped by the preprocessing
    return m, lambda: F.mse_loss(m(x), _Y), {}


@case("LOSS-007")
def _hf_without_labels(bug: bool) -> Case:
    m = gpt2()
    batch = token_batch()
    kwargs = {k: v for k, v in batch.items() if k != "labels"} if bug else batch
    return m, lambda: m(**kwargs), {}


@case("LOSS-008")
def _nll_on_logits(bug: bool) -> Case:
    m = _classifier()
    return m, lambda: F.nll_loss(m(_X) if bug else F.log_softmax(m(_X), -1), _LABELS), {}


# --- inputs ---------------------------------------------------------------------------------------------------
class _StaleFeatures(nn.Module):
    """A head trained on a cached tensor instead of the batch (bug) or on the batch (clean)."""

    def __init__(self, bug: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.bug = bug
        self.encoder = nn.Linear(8, 16)
        self.head = nn.Linear(16, 1)
        self.register_buffer("cached", torch.randn(16, 16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        feats = self.cached if self.bug else torch.relu(self.encoder(x))
        return self.head(feats)


@case("INPUT-001")
def _input_ignored(bug: bool) -> Case:
    m = _StaleFeatures(bug)
    return m, lambda: F.mse_loss(m(_X), _Y), {"checks": ["input_dependency", "loss"]}


@case("INPUT-001/stale-floats")
def _stale_float_batch(bug: bool) -> Case:
    m = mlp()
    stale, fresh = _X, torch.randn(16, 8, generator=torch.Generator().manual_seed(9))
    # the loop fetched a new batch into `fresh` but the step still closes over the first one
    return m, lambda: F.mse_loss(m(stale if bug else fresh), _Y), {"inputs": fresh}


@case("INPUT-001/stale-tokens")
def _stale_token_batch(bug: bool) -> Case:
    m = gpt2()
    stale, fresh = token_batch(), token_batch(seed=7)
    return m, lambda: m(**(stale if bug else fresh)), {"inputs": fresh}


@case("INPUT-001/params-only")
def _loss_from_parameters_only(bug: bool) -> Case:
    m = mlp()
    weights = list(m.parameters())
    # an L2 "regulariser" returned instead of the task loss plus it
    reg = lambda: sum(w.pow(2).sum() for w in weights) * 1e-4  # noqa: E731
    return m, (lambda: reg()) if bug else (lambda: F.mse_loss(m(_X), _Y) + reg()), {"inputs": _X}


def test_input_001_given_inputs_are_put_back_exactly() -> None:
    m, step, kwargs = _stale_token_batch(True)
    batch = kwargs["inputs"]
    before = {k: v.clone() for k, v in batch.items()}
    assert audit(m, step, **kwargs).by_id("INPUT-001")
    assert all(torch.equal(before[k], batch[k]) for k in before)


class _LinearProbe(nn.Module):
    """Frozen backbone under no_grad + trained head: no input gradient, but the loss depends on the input."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.backbone = nn.Linear(8, 16).requires_grad_(False)
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            feats = torch.relu(self.backbone(x))
        return self.head(feats)


def test_input_001_not_fooled_by_no_grad_backbone() -> None:
    m = _LinearProbe()
    report = audit(m, lambda: F.mse_loss(m(_X), _Y))
    assert not report.by_id("INPUT-001")


class _SeqRegressor(nn.Module):
    """GRU over (T, B, D); the bug reorders a (B, T, D) batch with view instead of transpose."""

    def __init__(self, bug: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.bug = bug
        self.rnn = nn.GRU(8, 16)
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        seq = x.view(t, b, d) if self.bug else x.transpose(0, 1)
        out, _ = self.rnn(seq)
        return self.head(out[-1])


def _left_padded(rows: int = 4, seq: int = 8, pad: int = 0, seed: int = 4) -> dict[str, torch.Tensor]:
    """Rows of different lengths padded on the left with ``pad`` (row 0 unpadded), padding labelled -100."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (rows, seq), generator=g)
    mask = torch.ones(rows, seq, dtype=torch.long)
    for r in range(1, rows):
        ids[r, :r], mask[r, :r] = pad, 0
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


@case("INPUT-003")
def _left_padding_absolute_positions(bug: bool) -> Case:
    m = gpt2()
    batch = _left_padded()
    if not bug:
        batch["position_ids"] = (batch["attention_mask"].cumsum(-1) - 1).clamp(min=0)
    return m, lambda: m(**batch), {}


def _bert_classifier(**overrides: Any) -> nn.Module:
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    cfg = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
               max_position_embeddings=32, pad_token_id=0, num_labels=2)
    cfg.update(overrides)
    return BertForSequenceClassification(BertConfig(**cfg))


@case("INPUT-003/cls-pooling")
def _left_padding_cls_pooling(bug: bool) -> Case:
    m = _bert_classifier()
    batch = _left_padded()
    if bug:  # positions are right, but the CLS position of padded rows is padding
        batch["position_ids"] = (batch["attention_mask"].cumsum(-1) - 1).clamp(min=0)
    else:
        batch = token_batch(pad_last=3)
    batch["labels"] = torch.tensor([0, 1, 1, 0])
    return m, lambda: m(**batch), {}


@case("INPUT-004")
def _padding_unmasked(bug: bool) -> Case:
    m = bert_mlm()  # bidirectional: every token attends to the padding
    batch = token_batch(pad_last=3)
    if bug:
        batch["attention_mask"] = torch.ones_like(batch["attention_mask"])  # mask = ids != pad was "simplified"
    return m, lambda: m(**batch), {}


@case("INPUT-004/left-causal")
def _left_padding_unmasked_in_a_causal_lm(bug: bool) -> Case:
    m = llama()  # pad == eos == bos == 0; the real tokens after the padding attend to it
    batch = token_batch(pad_last=0)
    batch["input_ids"][0, -1] = 0  # one real, supervised EOS at the end of a full row
    batch["input_ids"][-1, :3] = 0
    batch["attention_mask"][-1, :3] = 0
    batch["labels"] = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    batch["position_ids"] = (batch["attention_mask"].cumsum(-1) - 1).clamp(min=0)
    if bug:
        batch["attention_mask"] = torch.ones_like(batch["attention_mask"])
    return m, lambda: m(**batch), {}


def test_input_004_leaves_right_padding_of_a_causal_lm_alone() -> None:
    # no real token of a causal LM attends to the padding after it (its labels are -100): unmasked, nothing changes
    m = gpt2()
    batch = token_batch(pad_last=3)
    batch["attention_mask"] = torch.ones_like(batch["attention_mask"])
    assert not audit(m, lambda: m(**batch)).by_id("INPUT-004")


@case("INPUT-004/no-mask")
def _padding_without_mask(bug: bool) -> Case:
    m = _bert_classifier()
    batch = token_batch(pad_last=3)
    batch["labels"] = torch.tensor([0, 1, 1, 0])
    if bug:
        del batch["attention_mask"]
    return m, lambda: m(**batch), {}


def _llama_classifier(pad: int | None) -> nn.Module:
    from transformers import LlamaConfig, LlamaForSequenceClassification

    torch.manual_seed(0)
    return LlamaForSequenceClassification(LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=32, num_labels=2, pad_token_id=pad, bos_token_id=1,
        eos_token_id=2))


@case("INPUT-005")
def _pad_id_mismatch(bug: bool) -> Case:
    m = _llama_classifier(pad=0 if bug else VOCAB - 1)
    batch = token_batch(pad_last=3)
    batch["input_ids"][batch["attention_mask"] == 0] = VOCAB - 1  # the tokenizer's pad id
    batch["labels"] = torch.tensor([0, 1, 1, 0])
    return m, lambda: m(**batch), {}


@case("INPUT-005/no-pad-id")
def _pad_id_missing(bug: bool) -> Case:
    m = _llama_classifier(pad=None if bug else VOCAB - 1)
    batch = token_batch(batch=1, pad_last=3)  # batch size 1: transformers raises only for larger batches
    batch["input_ids"][batch["attention_mask"] == 0] = VOCAB - 1
    batch["labels"] = torch.tensor([1])
    return m, lambda: m(**batch), {}


@case("INPUT-002")
def _batch_mixing(bug: bool) -> Case:
    m = _SeqRegressor(bug)
    x = torch.randn(4, 6, 8, generator=torch.Generator().manual_seed(3))
    y = torch.randn(4, 1)
    return m, lambda: F.mse_loss(m(x), y), {}


def test_input_002_batchnorm_is_info_not_warning() -> None:
    m = SmallCNN()
    x = torch.randn(4, 3, 8, 8)
    y = torch.arange(4) % 5
    report = audit(m, lambda: F.cross_entropy(m(x), y))
    (finding,) = report.by_id("INPUT-002")
    assert finding.severity is Severity.INFO and finding.details["batchnorm"] == ["bn"]
    m.eval()
    assert not audit(m, lambda: F.cross_entropy(m(x), y)).by_id("INPUT-002")


def test_input_002_token_models_are_independent_per_sample() -> None:
    m = gpt2()
    batch = token_batch(pad_last=3)
    report = audit(m, lambda: m(**batch))
    assert not report.by_check("input_dependency")


# --- gradients ------------------------------------------------------------------------------------------------
class _WithAuxHead(nn.Module):
    def __init__(self, bug: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.bug = bug
        self.body = nn.Linear(8, 16)
        self.head = nn.Linear(16, 1)
        self.aux_head = nn.Linear(16, 1)  # meant for an auxiliary loss

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.body(x))
        return self.head(h) if self.bug else self.head(h) + 0.1 * self.aux_head(h)


@case("GRAD-001")
def _unused_param(bug: bool) -> Case:
    m = _WithAuxHead(bug)
    return m, lambda: F.mse_loss(m(_X), _Y), {}


@case("GRAD-002")
def _exploding(bug: bool) -> Case:
    m = mlp()
    scale = 1e4 if bug else 1.0  # raw sensor readings in the thousands, targets likewise
    return m, lambda: F.mse_loss(m(_X * scale), _Y * scale), {}


def test_grad_002_not_raised_by_biases_initialised_near_zero() -> None:
    m = mlp()
    with torch.no_grad():
        for layer in (m[0], m[3]):
            layer.bias.normal_(0.0, 1e-6)  # a common "small bias" initialisation
    report = audit(m, lambda: F.mse_loss(m(_X), _Y), optimizer=torch.optim.SGD(m.parameters(), lr=0.01))
    assert not report.by_id("GRAD-002") and not report.warnings, str(report)


def _deep_sigmoid(depth: int) -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(16, 16), nn.Sigmoid()]
    return nn.Sequential(nn.Linear(8, 16), *layers, nn.Linear(16, 1))


@case("GRAD-003")
def _vanishing(bug: bool) -> Case:
    m = _deep_sigmoid(40 if bug else 3)
    return m, lambda: F.mse_loss(m(_X), _Y), {}


def _dead_bias_mlp(bug: bool, act: nn.Module | None = None) -> nn.Sequential:
    m = mlp(act=act)
    if bug:
        with torch.no_grad():
            m[0].bias.fill_(-50.0)  # an init helper that meant +0.05
    return m


@case("GRAD-004")
def _zero_grad(bug: bool) -> Case:
    m = _dead_bias_mlp(bug)
    return m, lambda: F.mse_loss(m(_X), _Y), {}


@case("GRAD-005")
def _update_too_large(bug: bool) -> Case:
    m = mlp()
    opt = torch.optim.Adam(m.parameters(), lr=1.0 if bug else 1e-3)
    return m, lambda: F.mse_loss(m(_X), _Y), {"optimizer": opt}


@case("GRAD-005/low")
def _update_too_small(bug: bool) -> Case:
    m = mlp()
    opt = torch.optim.SGD(m.parameters(), lr=1e-9 if bug else 1e-2)
    return m, lambda: F.mse_loss(m(_X), _Y), {"optimizer": opt}


# --- optimizer ------------------------------------------------------------------------------------------------
class _BackboneHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.backbone = nn.Sequential(nn.Linear(8, 16), nn.ReLU())
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(x))


@case("OPT-001")
def _head_not_in_optimizer(bug: bool) -> Case:
    m = _BackboneHead()
    opt = torch.optim.AdamW(m.backbone.parameters() if bug else m.parameters(), lr=1e-3, weight_decay=0.0)
    return m, lambda: F.mse_loss(m(_X), _Y), {"optimizer": opt}


@case("OPT-002")
def _frozen_in_optimizer(bug: bool) -> Case:
    m = _BackboneHead()
    if bug:
        opt = torch.optim.Adam(m.parameters(), lr=1e-3)
        m.backbone.requires_grad_(False)  # frozen after the optimizer was built
    else:
        m.backbone.requires_grad_(False)
        opt = torch.optim.Adam([p for p in m.parameters() if p.requires_grad], lr=1e-3)
    return m, lambda: F.mse_loss(m(_X), _Y), {"optimizer": opt}


@case("OPT-003")
def _new_head_after_optimizer(bug: bool) -> Case:
    m = _BackboneHead()
    if bug:
        opt = torch.optim.Adam(m.parameters(), lr=1e-3)
        m.head = nn.Linear(16, 1)  # fresh head for the new task, optimizer still holds the old one
    else:
        m.head = nn.Linear(16, 1)
        opt = torch.optim.Adam(m.parameters(), lr=1e-3)
    return m, lambda: F.mse_loss(m(_X), _Y), {"optimizer": opt}


@case("OPT-003/peft")
def _optimizer_before_get_peft_model(bug: bool) -> Case:
    from peft import LoraConfig, get_peft_model

    base = gpt2()
    opt_before = torch.optim.AdamW(base.parameters(), lr=1e-4)
    model = get_peft_model(base, LoraConfig(r=4, target_modules=["c_attn"], fan_in_fan_out=True))
    opt = opt_before if bug else torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    batch = token_batch()
    return model, lambda: model(**batch), {"optimizer": opt}


@case("OPT-004")
def _lr_zero(bug: bool) -> Case:
    m = mlp()
    opt = torch.optim.SGD(m.parameters(), lr=0.0 if bug else 0.01)  # lr read from an unset env var -> 0
    return m, lambda: F.mse_loss(m(_X), _Y), {"optimizer": opt}


def test_opt_004_warmup_scheduler_starting_at_zero_is_fine() -> None:
    m = mlp()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    torch.optim.lr_scheduler.LambdaLR(opt, lambda step: step / 100)  # linear warmup from 0
    assert opt.param_groups[0]["lr"] == 0.0
    assert not audit(m, lambda: F.mse_loss(m(_X), _Y), optimizer=opt).by_id("OPT-004")


@case("OPT-004/schedule")
def _schedule_stuck_at_zero(bug: bool) -> Case:
    from transformers import get_linear_schedule_with_warmup

    m = mlp()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    # num_training_steps computed from len(dataloader) // accumulation = 0: the schedule decays from 0 to 0
    sched = get_linear_schedule_with_warmup(opt, num_warmup_steps=0 if bug else 10, num_training_steps=0 if bug else 100)
    return m, lambda: F.mse_loss(m(_X), _Y), {"optimizer": opt, "lr_scheduler": sched}


def test_opt_004_schedule_look_ahead_leaves_scheduler_and_lr_as_they_were() -> None:
    m, step, kwargs = _schedule_stuck_at_zero(False)
    sched, opt = kwargs["lr_scheduler"], kwargs["optimizer"]
    for _ in range(3):
        opt.step()
        sched.step()
    before = (sched.state_dict(), [g["lr"] for g in opt.param_groups])
    assert not audit(m, step, **kwargs).by_id("OPT-004")
    assert (sched.state_dict(), [g["lr"] for g in opt.param_groups]) == before
    trained = [g["lr"] for g in opt.param_groups]
    sched.step()
    assert [g["lr"] for g in opt.param_groups] != trained  # the scheduler keeps going from where it was


def test_lr_scheduler_must_be_a_scheduler() -> None:
    from guardtower.errors import ConfigError

    m = mlp()
    with pytest.raises(ConfigError, match="lr_scheduler"):
        audit(m, lambda: F.mse_loss(m(_X), _Y), lr_scheduler=0.1)


@case("OPT-005")
def _decay_on_norms(bug: bool) -> Case:
    m = gpt2()
    if bug:
        opt = torch.optim.AdamW(m.parameters(), lr=1e-4, weight_decay=0.1)
    else:
        decay = [p for p in m.parameters() if p.dim() >= 2]
        no_decay = [p for p in m.parameters() if p.dim() < 2]
        opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                                lr=1e-4)
    batch = token_batch()
    return m, lambda: m(**batch), {"optimizer": opt}


@case("OPT-006")
def _frozen_layer(bug: bool) -> Case:
    m = mlp()
    if bug:
        next(m.parameters()).requires_grad_(False)  # a leftover freeze from a feature-extraction phase
    opt = torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.01)
    return m, lambda: F.mse_loss(m(_X), _Y), {"optimizer": opt}


@case("OPT-007")
def _no_decay_filter_misses_a_norm(bug: bool) -> Case:
    m = gpt2()
    # the usual name filter; GPT-2 calls its norms ln_1/ln_2/ln_f, so "LayerNorm.weight" matches none of them
    skip = ("bias", "LayerNorm.weight") if bug else ("bias", "ln_")
    named = list(m.named_parameters())
    decay = [p for n, p in named if not any(k in n for k in skip)]
    no_decay = [p for n, p in named if any(k in n for k in skip)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=1e-4)
    batch = token_batch()
    return m, lambda: m(**batch), {"optimizer": opt}


@case("OPT-007/t5-names")
def _no_decay_filter_catches_no_norm_of_t5(bug: bool) -> Case:
    from transformers import T5Config, T5ForConditionalGeneration

    # T5 has no biases and names its norms layer_norm: the BERT filter's no-decay group holds only the relative
    # attention bias tables (2-D), and every norm is decayed
    torch.manual_seed(0)
    m = T5ForConditionalGeneration(T5Config(vocab_size=40, d_model=16, d_kv=4, d_ff=32, num_layers=1, num_heads=2,
                                            decoder_start_token_id=0, pad_token_id=0, eos_token_id=1))
    skip = ("bias", "LayerNorm.weight") if bug else ("bias", "LayerNorm.weight", "layer_norm.weight")
    named = list(m.named_parameters())
    opt = torch.optim.AdamW([{"params": [p for n, p in named if not any(k in n for k in skip)], "weight_decay": 0.1},
                             {"params": [p for n, p in named if any(k in n for k in skip)], "weight_decay": 0.0}],
                            lr=1e-4)
    g = torch.Generator().manual_seed(1)
    batch = {"input_ids": torch.randint(2, 40, (2, 6), generator=g), "labels": torch.randint(2, 40, (2, 4), generator=g)}
    return m, lambda: m(**batch).loss, {"optimizer": opt, "inputs": batch}


def test_opt_007_is_a_warning_and_plain_decay_everywhere_stays_info() -> None:
    model, step, kwargs = CASES["OPT-007"](True)
    (finding,) = audit(model, step, **kwargs).by_id("OPT-007")
    assert finding.severity is Severity.WARN and any("ln_f" in n for n in finding.details["params"])
    model, step, kwargs = CASES["OPT-005"](True)
    report = audit(model, step, **kwargs)
    assert report.by_id("OPT-005") and not report.by_id("OPT-007")


@case("NAN-004")
def _fp16_weights_under_adamw(bug: bool) -> Case:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    x = _X.clone()
    x[:, 0] = 0.0  # a feature that is always 0 in this batch (padding, a constant column): zero gradient
    if bug:
        m.half()  # "to save memory" the trainable weights themselves are fp16
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
        return m, lambda: F.mse_loss(m(x.half()).float(), _Y.repeat(1, 4)), {"optimizer": opt}
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    return m, lambda: F.mse_loss(m(x), _Y.repeat(1, 4)), {"optimizer": opt}


def test_nan_004_the_bug_is_real() -> None:
    model, step, kwargs = _fp16_weights_under_adamw(True)
    step().backward()
    kwargs["optimizer"].step()
    assert not all(bool(torch.isfinite(p).all()) for p in model.parameters())


# --- reentrant checkpointing called directly ---------------------------------------------------------------------
class _CheckpointedBlocks(nn.Module):
    """A frozen token embedding, trainable blocks each wrapped in a direct torch.utils.checkpoint call."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.reentrant = reentrant
        self.embed = nn.Embedding(VOCAB, 16).requires_grad_(False)  # pretrained, frozen
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(16, 16), nn.GELU()) for _ in range(2)])
        self.head = nn.Linear(16, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        h = self.embed(ids)
        for block in self.blocks:
            h = checkpoint(block, h, use_reentrant=self.reentrant)
        return self.head(h)


def _checkpointed_step(bug: bool) -> tuple[_CheckpointedBlocks, Callable[[], torch.Tensor], torch.optim.Optimizer]:
    m = _CheckpointedBlocks(reentrant=bug)
    ids = token_batch()["input_ids"]
    opt = torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.1)
    # next-token targets: the model sees token t and predicts token t + 1
    return m, lambda: F.cross_entropy(m(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten()), opt


@case("GRAD-006")
def _direct_reentrant_checkpoint(bug: bool) -> Case:
    m, step, opt = _checkpointed_step(bug)
    return m, step, {"optimizer": opt}


def test_grad_006_the_bug_is_real_the_blocks_never_train() -> None:
    for bug in (True, False):
        m, step, opt = _checkpointed_step(bug)
        before = [p.detach().clone() for p in m.blocks.parameters()]
        for _ in range(2):
            opt.zero_grad()
            step().backward()
            opt.step()
        unchanged = all(torch.equal(a, b) for a, b in zip(before, m.blocks.parameters()))
        assert unchanged is bug


def test_grad_006_names_the_starved_parameters() -> None:
    model, step, kwargs = CASES["GRAD-006"](True)
    (finding,) = audit(model, step, **kwargs).by_id("GRAD-006")
    assert finding.details["count"] == 4 and all(p.startswith("blocks.") for p in finding.details["params"])


# --- causal-LM labels ----------------------------------------------------------------------------------------
_EOS = 0  # the tiny GPT-2's eos_token_id; pad_token_id is the same id


def _sequences_with_eos() -> tuple[torch.Tensor, torch.Tensor]:
    """Two real sequences, each ending in EOS, right-padded (with pad = eos) to one length."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(1, VOCAB, (4, 10), generator=g)
    mask = torch.ones_like(ids)
    for row, length in enumerate((10, 8, 7, 9)):
        ids[row, length - 1] = _EOS
        ids[row, length:] = _EOS
        mask[row, length:] = 0
    return ids, mask


def _eos_batch(bug: bool) -> dict[str, torch.Tensor]:
    ids, mask = _sequences_with_eos()
    # DataCollatorForLanguageModeling: labels[labels == pad_token_id] = -100, with pad_token = eos_token
    labels = ids.masked_fill(ids == _EOS, -100) if bug else ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


@case("DATA-003")
def _pad_equals_eos_masks_every_eos(bug: bool) -> Case:
    m = gpt2()
    batch = _eos_batch(bug)
    return m, lambda: m(**batch), {}


def test_data_003_the_bug_is_real_no_target_is_eos() -> None:
    assert int((_eos_batch(True)["labels"] == _EOS).sum()) == 0
    assert int((_eos_batch(False)["labels"] == _EOS).sum()) == 4  # one stop target per sequence


@case("DATA-004")
def _labels_shifted_twice(bug: bool) -> Case:
    m = gpt2()
    batch = token_batch(seq=12)
    if bug:  # "shift for next-token prediction" done by hand, then GPT2LMHeadModel shifts again
        ids = batch["input_ids"]
        batch["labels"] = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], dim=1)
    return m, lambda: m(**batch), {}


@case("LOSS-009")
def _labels_redrawn_every_step(bug: bool) -> Case:
    m = _classifier()
    gen = torch.Generator().manual_seed(6)
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    # bug: a "random crop" augmentation that also re-draws the labels, so they never belong to the inputs
    step = (lambda: F.cross_entropy(m(_X), torch.randint(0, 5, (16,), generator=gen))) if bug else (
        lambda: F.cross_entropy(m(_X), _LABELS))
    return m, step, {"optimizer": opt, "steps": 20}


# --- training-loop order inside step_fn ---------------------------------------------------------------------
def _full_step(order: tuple[str, ...]) -> Case:
    """A step_fn that is the user's whole training step, its calls in the given order."""
    m = mlp()
    opt = torch.optim.SGD(m.parameters(), lr=0.05)

    def set_grads_to_none() -> None:  # the "faster zero_grad" loop of the PyTorch performance guide
        for p in m.parameters():
            p.grad = None

    def step() -> torch.Tensor:
        loss = F.mse_loss(m(_X), _Y)
        calls: dict[str, Callable[[], object]] = {  # looked up now, as a training loop does, not bound up front
            "zero_grad": opt.zero_grad, "backward": loss.backward, "step": opt.step,
            "grads_to_none": set_grads_to_none, "model_zero_grad": lambda: m.zero_grad(set_to_none=True)}
        for call in order:
            calls[call]()
        return loss

    return m, step, {"optimizer": opt}


@case("LOOP-001")
def _zero_grad_between_backward_and_step(bug: bool) -> Case:
    return _full_step(("backward", "zero_grad", "step") if bug else ("zero_grad", "backward", "step"))


@case("LOOP-002")
def _step_before_backward(bug: bool) -> Case:
    return _full_step(("zero_grad", "step", "backward") if bug else ("zero_grad", "backward", "step"))


@case("LOOP-003")
def _zero_grad_never_called(bug: bool) -> Case:
    return _full_step(("backward", "step") if bug else ("backward", "step", "zero_grad"))


@case("LOOP-003/closure")
def _closure_never_zeroes(bug: bool) -> Case:
    # optimizer.step(closure): the closure's zero_grad and backward run inside step, before the update; so a
    # clean closure is not "step before backward", and one without zero_grad accumulates forever
    m = mlp()
    opt = torch.optim.Adam(m.parameters(), lr=1e-3)

    def closure() -> torch.Tensor:
        if not bug:
            opt.zero_grad()
        loss = F.mse_loss(m(_X), _Y)
        loss.backward()
        return loss

    return m, lambda: opt.step(closure), {"optimizer": opt, "inputs": _X}


@case("LOOP-003/grads-set-to-none")
def _grads_set_to_none_before_backward(bug: bool) -> Case:
    return _full_step(("backward", "step") if bug else ("grads_to_none", "backward", "step"))


@case("LOOP-003/grads-set-to-none-after-step")
def _grads_set_to_none_after_step(bug: bool) -> Case:
    return _full_step(("backward", "step") if bug else ("backward", "step", "grads_to_none"))


@case("LOOP-003/model-zero-grad")
def _model_zero_grad_set_to_none(bug: bool) -> Case:
    return _full_step(("backward", "step") if bug else ("model_zero_grad", "backward", "step"))


@case("LOOP-003/one-optimizer-of-two")
def _discriminator_never_zeroed(bug: bool) -> Case:
    """A GAN step: the discriminator's update, then the generator's; the generator is zeroed every step and the
    discriminator (the bug) never, so its gradients add up across steps, the generator's backward included."""
    torch.manual_seed(0)
    model = nn.ModuleDict({"gen": nn.Sequential(nn.Linear(4, 8), nn.Tanh()),
                           "disc": nn.Sequential(nn.Linear(8, 8), nn.LeakyReLU(0.2), nn.Linear(8, 1))})
    gen, disc = model["gen"], model["disc"]
    opt_g, opt_d = torch.optim.Adam(gen.parameters(), lr=1e-3), torch.optim.Adam(disc.parameters(), lr=1e-3)
    z, real = torch.randn(8, 4), torch.randn(8, 8)

    def step() -> torch.Tensor:
        if not bug:
            disc.zero_grad()
        fake = gen(z)
        d_loss = F.softplus(-disc(real)).mean() + F.softplus(disc(fake.detach())).mean()
        d_loss.backward()
        opt_d.step()
        gen.zero_grad()
        g_loss = F.softplus(-disc(fake)).mean()
        g_loss.backward()
        opt_g.step()
        return d_loss.detach() + g_loss.detach()

    return model, step, {"optimizer": opt_d, "inputs": real}


class _PatchEncoder(nn.Module):
    """Patches plus a learned position table, then a small transformer layer and a mean-pooled head."""

    def __init__(self, sliced: bool) -> None:
        super().__init__()
        self.sliced = sliced
        self.pos_embedding = nn.Parameter(torch.randn(1, 32, 8) * 0.02)
        self.embed = nn.Linear(6, 8)
        self.layer = nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, dropout=0.0, batch_first=True)
        self.head = nn.Linear(8, 3)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        n = patches.shape[1]
        pe = self.pos_embedding[:, :n] if self.sliced else self.pos_embedding[:, n]
        return self.head(self.layer(self.embed(patches) + pe).mean(1))


@case("GRAD-007")
def _position_table_indexed_not_sliced(bug: bool) -> Case:
    torch.manual_seed(0)
    m = _PatchEncoder(sliced=not bug)
    patches, y = torch.randn(4, 9, 6), torch.tensor([0, 1, 2, 1])
    opt = torch.optim.Adam(m.parameters(), lr=1e-3)

    def step() -> torch.Tensor:
        opt.zero_grad()
        loss = F.cross_entropy(m(patches), y)
        loss.backward()
        opt.step()
        return loss

    return m, step, {"optimizer": opt, "inputs": patches}


def test_grad_007_a_batch_of_one_position_reads_row_0_and_is_left_alone() -> None:
    torch.manual_seed(0)
    m = _PatchEncoder(sliced=True)
    patches, y = torch.randn(4, 1, 6), torch.tensor([0, 1, 2, 1])
    F.cross_entropy(m(patches), y).backward()
    assert m.pos_embedding.grad is not None
    assert m.pos_embedding.grad[0].ne(0).any(-1).nonzero().flatten().tolist() == [0]  # one row: the first
    m.zero_grad()
    report = audit(m, lambda: F.cross_entropy(m(patches), y), inputs=patches)
    assert not report.by_id("GRAD-007"), str(report)


class _SAM(torch.optim.Optimizer):
    """Sharpness-aware minimisation as repositories write it: step() perturbs the weights along the gradient, runs
    a second forward and backward there, restores the weights and lets its base optimizer apply that gradient."""

    def __init__(self, params: Any, closure_loss: Callable[[], torch.Tensor], clear: bool, rho: float = 0.05) -> None:
        super().__init__(params, {"rho": rho})
        self.base = torch.optim.SGD(self.param_groups, lr=0.1)
        self.param_groups = self.base.param_groups
        self.closure_loss, self.clear = closure_loss, clear

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        params = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        scale = self.param_groups[0]["rho"] / (torch.norm(torch.stack([p.grad.norm() for p in params])) + 1e-12)
        shifts = [p.grad * scale for p in params]
        for p, e in zip(params, shifts):
            p.add_(e)
        if self.clear:  # the fix: the perturbed gradient replaces the first one
            self.zero_grad()
        with torch.enable_grad():
            self.closure_loss().backward()
        for p, e in zip(params, shifts):
            p.sub_(e)
        self.base.step()


@case("LOOP-003/wrapper-adds-its-second-gradient")
def _sam_second_gradient_added_to_the_first(bug: bool) -> Case:
    m = mlp()
    opt = _SAM(m.parameters(), lambda: F.mse_loss(m(_X), _Y), clear=not bug)

    def step() -> torch.Tensor:
        opt.zero_grad()
        loss = F.mse_loss(m(_X), _Y)
        loss.backward()
        opt.step()
        return loss

    return m, step, {"optimizer": opt, "inputs": _X}


@pytest.mark.parametrize("detached", [True, False], ids=["detached-loss", "clients-graph-loss"])
def test_a_step_that_trains_copies_and_writes_the_model_back_is_not_a_detached_loss(detached: bool) -> None:
    """Federated averaging: each client is a copy of the model trained on its shard; the step writes the clients'
    mean into the model and returns the clients' mean loss (detached, or still holding the clients' graphs, which
    their backward passes freed). Those backward passes reach none of the model's tensors: neither a detached loss
    nor micro-batches of the model, and no backward of the audit's own through the freed graphs."""
    torch.manual_seed(0)
    model = mlp()
    shards = [(_X[:8], _Y[:8]), (_X[8:], _Y[8:])]

    def federated_round() -> torch.Tensor:
        clients, losses = [], []
        for x, y in shards:
            local = copy.deepcopy(model)
            opt = torch.optim.SGD(local.parameters(), lr=0.1)
            loss = F.mse_loss(local(x), y)
            loss.backward()
            opt.step()
            clients.append(local)
            losses.append(loss.detach() if detached else loss)
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(sum(dict(c.named_parameters())[name] for c in clients) / len(clients))
        return torch.stack(losses).mean()

    report = audit(model, federated_round, inputs=_X)
    assert not [f for f in report if f.severity >= Severity.WARN], str(report)


@case("LOOP-003/stepped-again-in-one-call")
def _critic_steps_share_one_zero_grad(bug: bool) -> Case:
    """A WGAN-style step: three critic updates per generator update. The bug zeroes the critic once before the
    loop, so its second and third updates apply the earlier batches' gradients again; the clean loop zeroes
    before each critic backward."""
    torch.manual_seed(0)
    model = nn.ModuleDict({"gen": nn.Sequential(nn.Linear(4, 8), nn.Tanh()),
                           "critic": nn.Sequential(nn.Linear(8, 8), nn.LeakyReLU(0.2), nn.Linear(8, 1))})
    gen, critic = model["gen"], model["critic"]
    opt_g, opt_c = torch.optim.Adam(gen.parameters(), lr=1e-3), torch.optim.Adam(critic.parameters(), lr=1e-3)
    z, real = torch.randn(3, 8, 4), torch.randn(3, 8, 8)

    def step() -> torch.Tensor:
        opt_c.zero_grad()
        for k in range(3):
            if not bug:
                opt_c.zero_grad()
            c_loss = critic(gen(z[k]).detach()).mean() - critic(real[k]).mean()
            c_loss.backward()
            opt_c.step()
        opt_g.zero_grad()
        g_loss = -critic(gen(z[0])).mean()
        g_loss.backward()
        opt_g.step()
        return g_loss

    return model, step, {"optimizer": opt_c, "inputs": real[0]}


def test_parts_zeroed_and_clipped_each_before_its_own_backward_then_stepped_together_raise_no_loop_finding() -> None:
    """Dreamer's loop: world model, actor and value each have their optimizer; each is zeroed right before its own
    backward and clipped after it, and the three steps come at the end. Each zero_grad clears another part's
    tensors (no gradient is thrown away) and each clip still stands for its part at that part's step."""
    torch.manual_seed(0)
    model = nn.ModuleDict({"world": nn.Linear(4, 4), "actor": nn.Linear(4, 2), "value": nn.Linear(4, 1)})
    opts = {name: torch.optim.Adam(part.parameters(), lr=1e-3) for name, part in model.items()}
    x = torch.randn(8, 4)

    def step() -> None:
        for name in ("world", "actor", "value"):
            opts[name].zero_grad()
            model[name](x).pow(2).mean().backward()
            nn.utils.clip_grad_norm_(model[name].parameters(), 1.0)
        for opt in opts.values():
            opt.step()

    report = audit(model, step, optimizer=opts["world"], inputs=x)
    assert not [f for f in report if f.catalog_id.startswith("LOOP-")], str(report)


@pytest.mark.parametrize("key", sorted(k for k in CASES if k.startswith("LOOP-")))
def test_loop_correct_orders_raise_no_loop_finding_at_all(key: str) -> None:
    model, step, kwargs = CASES[key](False)
    report = audit(model, step, **kwargs)
    assert not [f for f in report if f.catalog_id.startswith("LOOP-")], str(report)


def test_loop_grads_set_to_none_between_backward_and_step_is_loop_001() -> None:
    model, step, kwargs = _full_step(("backward", "grads_to_none", "step"))
    report = audit(model, step, **kwargs)
    assert report.by_id("LOOP-001") and not report.by_id("LOOP-003"), str(report)


def test_loop_watch_leaves_tensor_grad_as_it_was() -> None:
    model, step, kwargs = CASES["LOOP-003/grads-set-to-none"](False)
    audit(model, step, **kwargs)
    assert "grad" not in torch.Tensor.__dict__  # the audit's property is gone: the C descriptor serves .grad

    def raising_step() -> torch.Tensor:
        step()
        raise RuntimeError("the user's step fails after clearing")

    assert audit(model, raising_step, **kwargs).by_id("LOSS-006")
    assert "grad" not in torch.Tensor.__dict__
    p = nn.Parameter(torch.ones(2))
    p.grad = torch.full((2,), 3.0)
    assert p.grad.tolist() == [3.0, 3.0]
    p.grad = None
    assert p.grad is None


@pytest.mark.parametrize("key", ["LOOP-001", "LOOP-002"])
def test_loop_bugs_are_real_the_weights_never_move(key: str) -> None:
    model, step, _ = CASES[key](True)
    before = [p.detach().clone() for p in model.parameters()]
    step()  # the first real step of the run: nothing to apply yet
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    model, step, _ = CASES[key](False)
    before = [p.detach().clone() for p in model.parameters()]
    step()
    assert not any(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_loop_001_is_not_a_crash_of_the_step() -> None:
    model, step, kwargs = CASES["LOOP-001"](True)
    report = audit(model, step, **kwargs)
    assert not report.by_id("LOSS-006") and not report.by_id("GRAD-001"), str(report)  # no second backward


# --- numerics -------------------------------------------------------------------------------------------------
class _PerImageStandardize(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mean = x.mean(dim=(1, 2, 3), keepdim=True)
        return (x - mean) / x.std(dim=(1, 2, 3), keepdim=True)  # 0/0 on a blank image


class _StandardizedCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = _PerImageStandardize()
        self.cnn = SmallCNN()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.cnn(self.norm(x))


@case("NAN-001")
def _forward_nan(bug: bool) -> Case:
    m = _StandardizedCNN()
    x = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(4))
    if bug:
        x[2] = 0.5  # a blank (constant) image in the batch
    y = torch.arange(4) % 5
    return m, lambda: F.cross_entropy(m(x), y), {}


def test_nan_001_names_the_first_module() -> None:
    m, step, kw = CASES["NAN-001"](True)
    (finding,) = audit(m, step, **kw).by_id("NAN-001")
    assert finding.details["module"] == "norm" and finding.details["input_nonfinite"] is False


def test_nan_001_ignores_attention_masks() -> None:
    m = gpt2()
    batch = token_batch(pad_last=4)
    report = audit(m, lambda: m(**batch))
    assert not report.by_check("nonfinite")


class _Siamese(nn.Module):
    def __init__(self, eps: float) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.proj = nn.Linear(8, 16)
        self.eps = eps

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        diff = self.proj(a) - self.proj(b)
        return torch.sqrt((diff**2).sum(-1) + self.eps)  # d/dx sqrt(x) is inf at 0


@case("NAN-002")
def _grad_nan(bug: bool) -> Case:
    m = _Siamese(eps=0.0 if bug else 1e-8)
    a = _X.clone()
    b = torch.randn(16, 8)
    b[3] = a[3]  # a positive pair that is the very same sample
    target = torch.ones(16)
    return m, lambda: F.mse_loss(m(a, b), target), {}


@case("NAN-003")
def _nan_checkpoint(bug: bool) -> Case:
    m = mlp()
    sd = copy.deepcopy(m.state_dict())
    if bug:
        sd["3.bias"][0] = float("nan")  # a checkpoint saved after the run diverged
    m.load_state_dict(sd)
    return m, lambda: F.mse_loss(m(_X), _Y), {"checks": ["nonfinite"]}


@case("RELU-001")
def _dead_relu_module(bug: bool) -> Case:
    m = _dead_bias_mlp(bug)  # nn.ReLU(inplace=True)
    return m, lambda: F.mse_loss(m(_X), _Y), {}


class _FunctionalRelu(nn.Module):
    def __init__(self, bug: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = nn.Linear(8, 32)
        self.fc2 = nn.Linear(32, 1)
        if bug:
            nn.init.constant_(self.fc1.bias, -50.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.relu(self.fc1(x)))


@case("RELU-001/functional")
def _dead_relu_functional(bug: bool) -> Case:
    m = _FunctionalRelu(bug)
    return m, lambda: F.mse_loss(m(_X), _Y), {}


@case("RELU-001/hf-activation")
def _dead_relu_squared(bug: bool) -> Case:
    from transformers.activations import ACT2FN

    m = _dead_bias_mlp(bug, act=ACT2FN["relu2"])  # ReLUSquaredActivation (Primer), calls F.relu inside
    return m, lambda: F.mse_loss(m(_X), _Y), {}


def test_relu_001_ignores_a_hinge_in_the_steps_own_loss() -> None:
    """A margin loss's relu (CapsNet, SVM hinge) is zero where the margin is met: not a dead layer."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 5))
    x, y = torch.randn(8, 8), torch.arange(8) % 5
    onehot = F.one_hot(y, 5).float()

    def loss() -> torch.Tensor:
        lengths = m(x).sigmoid()
        # every length is under the margin 0.95: the non-target hinge is zero everywhere, as it should be
        return (onehot * F.relu(0.95 - lengths) ** 2 + 0.5 * (1 - onehot) * F.relu(lengths - 0.95) ** 2).sum(1).mean()

    assert not audit(m, loss).by_id("RELU-001")


@case("ACT-001")
def _saturated_tanh(bug: bool) -> Case:
    m = mlp(act=nn.Tanh())
    scale = 100.0 if bug else 1.0  # pixel values 0..255 fed without normalisation
    return m, lambda: F.mse_loss(m(_X * scale), _Y), {}


# --- weights, modes ------------------------------------------------------------------------------------------
@case("TIE-001")
def _tied(bug: bool) -> Case:
    m = gpt2(tie_word_embeddings=bug)
    batch = token_batch()
    return m, lambda: m(**batch), {}


@case("TIE-002")
def _untied_by_head_swap(bug: bool) -> Case:
    m = gpt2()
    if bug:
        m.lm_head = nn.Linear(32, VOCAB, bias=False)  # "re-initialise the head" after construction
    batch = token_batch()
    return m, lambda: m(**batch), {}


@case("TIE-002/encoder-decoder")
def _bert2bert_decoder_head_replaced(bug: bool) -> Case:
    """Two BERTs in an EncoderDecoderModel: the decoder ties its head to its own embeddings (not the encoder's);
    the bug replaces the decoder's head after construction."""
    from transformers import BertConfig, BertLMHeadModel, BertModel, EncoderDecoderModel

    torch.manual_seed(0)
    small = {"vocab_size": 48, "hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
             "intermediate_size": 32, "max_position_embeddings": 32}
    decoder = BertLMHeadModel(BertConfig(**small, is_decoder=True, add_cross_attention=True))
    m = EncoderDecoderModel(encoder=BertModel(BertConfig(**small), add_pooling_layer=False), decoder=decoder)
    if bug:  # "re-initialise the head" after construction
        m.decoder.cls.predictions.decoder = nn.Linear(16, 48)
    m.config.decoder_start_token_id, m.config.pad_token_id = 2, 0
    src, tgt = torch.randint(3, 48, (2, 7)), torch.randint(3, 48, (2, 5))
    return m, lambda: m(input_ids=src, labels=tgt).loss, {"inputs": src}


@case("MODE-001")
def _eval_mode(bug: bool) -> Case:
    m = mlp()
    m.eval()  # left over from the validation loop
    if not bug:
        m.train()
    return m, lambda: F.mse_loss(m(_X), _Y), {}


@case("MODE-001/batchnorm")
def _frozen_bn_submodule(bug: bool) -> Case:
    m = SmallCNN()
    if bug:
        m.bn.eval()
    x = torch.randn(4, 3, 8, 8)
    return m, lambda: F.cross_entropy(m(x), torch.arange(4) % 5), {}


class _Distill(nn.Module):
    """A student trained against a frozen teacher held in the same module (knowledge distillation)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.student = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.1), nn.Linear(16, 5))
        self.teacher = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 5))
        self.teacher.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            soft = self.teacher(x).softmax(-1)
        return F.kl_div(self.student(x).log_softmax(-1), soft, reduction="batchmean")


@case("MODE-001/student-eval")
def _student_eval_teacher_frozen(bug: bool) -> Case:
    m = _Distill()
    m.train()
    m.teacher.eval()  # a frozen teacher in eval mode is intended, never a finding
    if bug:
        m.student.eval()  # the part that trains lost its dropout
    return m, lambda: m(_X), {}


def _bert_encoder() -> nn.Module:
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    return BertModel(BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                intermediate_size=64, max_position_embeddings=32, pad_token_id=0),
                     add_pooling_layer=False)


class _FrozenEncoderProbe(nn.Module):
    """A linear probe on a frozen pretrained text encoder (CLS features)."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = _bert_encoder()
        self.encoder.requires_grad_(False)
        self.head = nn.Linear(32, 3)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state[:, 0])


@case("MODE-002")
def _frozen_encoder_dropout(bug: bool) -> Case:
    m = _FrozenEncoderProbe()
    m.train()
    if not bug:
        m.encoder.eval()  # frozen features: no dropout
    batch = token_batch(pad_last=3)
    y = torch.arange(4) % 3
    return m, lambda: F.cross_entropy(m(batch["input_ids"], batch["attention_mask"]), y), {}


class _SoftPromptedEncoder(nn.Module):
    """Prompt tuning: trainable soft-prompt vectors prepended to the token embeddings of a frozen encoder, whose
    dropout stays on as in any fine-tune; the loss gradient runs through the encoder to the prompt."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = _bert_encoder()
        self.encoder.requires_grad_(False)
        self.prompt = nn.Parameter(torch.randn(4, 32) * 0.02)
        self.head = nn.Linear(32, 3)
        self.head.requires_grad_(False)  # the task head is frozen too: only the prompt trains

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        embeds = self.encoder.embeddings.word_embeddings(input_ids)
        embeds = torch.cat([self.prompt.expand(len(input_ids), -1, -1), embeds], dim=1)
        mask = torch.cat([torch.ones(len(input_ids), 4, dtype=attention_mask.dtype), attention_mask], dim=1)
        return self.head(self.encoder(inputs_embeds=embeds, attention_mask=mask).last_hidden_state[:, 0])


def test_mode_002_leaves_a_frozen_encoder_that_a_soft_prompt_trains_through_alone() -> None:
    """The frozen encoder's input is computed from the trained prompt: the gradient runs through it to what
    trains, so its dropout is the fine-tune's own (as in a LoRA base), while the frozen feature extractor of
    MODE-002's own case, whose input trains nothing, is still a finding."""
    m = _SoftPromptedEncoder()
    m.train()
    batch = token_batch(pad_last=3)
    y = torch.arange(4) % 3
    opt = torch.optim.AdamW([m.prompt], lr=1e-3)
    report = audit(m, lambda: F.cross_entropy(m(batch["input_ids"], batch["attention_mask"]), y), optimizer=opt)
    assert not report.by_id("MODE-002") and not [f for f in report if f.severity >= Severity.WARN], str(report)


@case("MODE-002/teacher")
def _teacher_left_in_train_mode(bug: bool) -> Case:
    m = _Distill()
    m.train()
    if not bug:
        m.teacher.eval()
    return m, lambda: m(_X), {}


class _FrozenBackbone(nn.Module):
    def __init__(self, momentum: float | None = 0.1) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.backbone = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8, momentum=momentum), nn.ReLU())
        self.head = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(x).mean(dim=(2, 3)))


@case("MODE-003")
def _frozen_backbone_bn_in_train(bug: bool) -> Case:
    m = _FrozenBackbone()
    m.backbone.requires_grad_(False)
    m.train()
    if not bug:
        m.backbone.eval()
    x = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(3))
    return m, lambda: F.cross_entropy(m(x), torch.arange(4) % 5), {}


@case("MODE-004")
def _keras_momentum(bug: bool) -> Case:
    m = _FrozenBackbone(momentum=0.99 if bug else 0.01)  # Keras' 0.99 is PyTorch's 0.01
    m.train()
    x = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(3))
    return m, lambda: F.cross_entropy(m(x), torch.arange(4) % 5), {}


def test_mode_004_cumulative_and_eval_norms_are_fine() -> None:
    model, step, kwargs = CASES["MODE-004"](True)
    model.backbone[1].momentum = None  # cumulative average
    assert not audit(model, step, **kwargs).by_id("MODE-004")
    model, step, kwargs = CASES["MODE-004"](True)
    model.backbone.requires_grad_(False)
    model.backbone.eval()  # statistics never update, the momentum does not matter
    assert not audit(model, step, **kwargs).by_id("MODE-004")


def test_mode_002_003_name_the_parts() -> None:
    model, step, kwargs = CASES["MODE-002"](True)
    (finding,) = audit(model, step, **kwargs).by_id("MODE-002")
    assert finding.details["modules"] == ["encoder"] and ".eval()" in finding.message
    model, step, kwargs = CASES["MODE-003"](True)
    (finding,) = audit(model, step, **kwargs).by_id("MODE-003")
    assert finding.details["modules"] == ["backbone"] and finding.details["layers"] == ["backbone.1"]


# --- mixed precision, devices ---------------------------------------------------------------------------------
@case("AMP-001")
def _fp16_without_scaler(bug: bool) -> Case:
    m = mlp()

    def step() -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.float16):
            return F.mse_loss(m(_X).float(), _Y)

    return m, step, {"scaler": None if bug else torch.amp.GradScaler("cpu")}


def test_amp_001_bf16_needs_no_scaler() -> None:
    m = mlp()

    def step() -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return F.mse_loss(m(_X).float(), _Y)

    assert not audit(m, step).by_check("mixed_precision")


@case("AMP-002")
def _bf16_weights(bug: bool) -> Case:
    m = gpt2()
    if bug:
        m.to(torch.bfloat16)  # "pure bf16" fine-tuning without fp32 master weights
    opt = torch.optim.AdamW(m.parameters(), lr=1e-5, weight_decay=0.0)
    batch = token_batch()
    return m, lambda: m(**batch), {"optimizer": opt}


def test_amp_002_fails_when_most_weights_are_stuck_and_warns_when_only_the_norm_gains_are() -> None:
    model, step, kwargs = CASES["AMP-002"](True)  # lr 1e-5: every bf16 tensor rounds its update away
    (finding,) = audit(model, step, **kwargs).by_id("AMP-002")
    assert finding.severity is Severity.ERROR
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 64), nn.LayerNorm(64), nn.ReLU(), nn.Linear(64, 1)).to(torch.bfloat16)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.0)  # moves weights ~0.1; not gains at 1.0
    (finding,) = audit(m, lambda: F.mse_loss(m(_X.bfloat16()).float(), _Y), optimizer=opt).by_id("AMP-002")
    assert finding.severity is Severity.WARN and "1.weight" in finding.details["params"]


class _WideThenNorm(nn.Module):
    """Linear -> LayerNorm: the LayerNorm hides how large the pre-norm activations are."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(8, 32)
        self.norm = nn.LayerNorm(32)
        self.head = nn.Linear(32, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.fc(x)))


@case("AMP-003")
def _fp16_headroom(bug: bool) -> Case:
    m = _WideThenNorm()
    scale = 1e4 if bug else 1.0  # raw counts fed without normalisation

    def step() -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.float16):
            return F.mse_loss(m(_X * scale).float(), _Y)

    return m, step, {"scaler": torch.amp.GradScaler("cpu")}


@case("DATA-001")
def _no_supervised_token(bug: bool) -> Case:
    m = gpt2()
    batch = token_batch()
    if bug:  # the prompt filled max_length, so completion-only masking left nothing
        batch["labels"] = torch.full_like(batch["input_ids"], -100)
    return m, lambda: m(**batch), {"inputs": batch}


@case("DATA-002")
def _labelled_padding(bug: bool) -> Case:
    m = gpt2()
    batch = token_batch(pad_last=3)
    if bug:
        batch["labels"] = batch["input_ids"].clone()  # labels = input_ids with pad = eos
    return m, lambda: m(**batch), {}


@case("DEV-001")
def _meta_layer(bug: bool) -> Case:
    m = _BackboneHead()
    if bug:
        with torch.device("meta"):
            m.head = nn.Linear(16, 1)  # created with init_empty_weights, never loaded
    return m, lambda: F.mse_loss(m(_X), _Y), {}


@case("DEV-002")
def _float64(bug: bool) -> Case:
    m = mlp()
    dtype = torch.float64 if bug else torch.float32
    m.to(dtype)
    return m, lambda: F.mse_loss(m(_X.to(dtype)), _Y.to(dtype)), {}


# --- data-parallel wrappers recognised by class name -----------------------------------------------------------
class DistributedDataParallel(nn.Module):
    """A wrapper that is not torch's class but carries its name, as apex.parallel.DistributedDataParallel and
    users' own wrappers do: the real model in ``.module``, no ``no_sync()``, no ``find_unused_parameters``."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(x)


class _WithSpare(nn.Module):
    def __init__(self, spare: bool) -> None:
        super().__init__()
        self.body = mlp()
        self.spare = nn.Linear(8, 8) if spare else None  # built for an experiment, never called

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


@case("DDP-001/wrapper-by-name")
def _named_ddp_unused(bug: bool) -> Case:
    m = DistributedDataParallel(_WithSpare(spare=bug))
    return m, lambda: F.mse_loss(m(_X), _Y), {"optimizer": torch.optim.SGD(m.parameters(), lr=0.01)}


@case("DDP-007")
def _data_parallel_summary(bug: bool) -> Case:
    m: nn.Module = DistributedDataParallel(mlp()) if bug else mlp()
    return m, lambda: F.mse_loss(m(_X), _Y), {}


def test_ddp_007_names_the_wrapper_and_its_settings() -> None:
    model, step, kwargs = CASES["DDP-007"](True)
    (summary,) = audit(model, step, **kwargs).by_id("DDP-007")
    assert summary.severity is Severity.INFO and summary.details["wrapper"] == "DistributedDataParallel"
    model.find_unused_parameters = True  # torch's DDP attribute, read when present
    (summary,) = audit(model, step, **kwargs).by_id("DDP-007")
    assert summary.details["find_unused_parameters"] is True and "find_unused_parameters=True" in summary.message
    model, step, kwargs = CASES["DDP-001/wrapper-by-name"](True)
    model.find_unused_parameters = True
    assert not audit(model, step, **kwargs).by_id("DDP-001")  # the wrapper tolerates the unused layer


# --- the parametrised trigger / clean pairs ------------------------------------------------------------------
@pytest.mark.parametrize("key", sorted(CASES))
def test_triggers(key: str) -> None:
    catalog_id = key.split("/")[0]
    model, step, kwargs = CASES[key](True)
    report = audit(model, step, **kwargs)
    assert report.by_id(catalog_id), f"{catalog_id} not emitted:\n{report}"
    for f in report.by_id(catalog_id):
        assert f.check in report.checks_run or f.catalog_id.startswith("LOSS-00")


@pytest.mark.parametrize("key", sorted(CASES))
def test_clean_counterparts(key: str) -> None:
    catalog_id = key.split("/")[0]
    model, step, kwargs = CASES[key](False)
    report = audit(model, step, **kwargs)
    assert not report.by_id(catalog_id), f"{catalog_id} emitted on the clean setup:\n{report}"


def test_every_core_entry_has_a_trigger_case() -> None:
    ids = {m.id for m in _CORE}
    covered = {key.split("/")[0] for key in CASES} | {"AUDIT-001"}  # AUDIT-001: see test_audit_api.py
    assert ids <= covered, sorted(ids - covered)


def test_data_002_encoder_padding_is_not_label_padding() -> None:
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    m = T5ForConditionalGeneration(T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=1,
                                            num_decoder_layers=1, num_heads=2, decoder_start_token_id=0,
                                            pad_token_id=0))
    batch = token_batch(pad_last=3)  # the encoder input is padded, the target sequence is not
    batch["labels"] = torch.randint(1, VOCAB, batch["input_ids"].shape, generator=torch.Generator().manual_seed(5))
    report = audit(m, lambda: m(**batch))
    assert not report.by_id("DATA-002") and not report.errors, str(report)
