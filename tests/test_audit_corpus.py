"""A corpus of silent training bugs that real users reported in public threads, each reproduced on a tiny
model with its fixed twin. For every case the test proves the bug is real (weights that real steps do not
move, labels that never hold the target, ...), that the audit catches it at WARN or above with the finding
for that bug, and that the fixed twin gets no WARN or FAIL at all. The table is in docs/audit-corpus.md."""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from guardtower.preflight import audit
from guardtower.severity import Severity

from tests._audit_core_helpers import mlp, token_batch
from tests._dist_launch import run_two_ranks
from tests.test_audit_checks import _X, _Y, CASES, Case

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]


def _unmoved(model: nn.Module, step: Callable[[], Any], opt: torch.optim.Optimizer | None, *,
             full_step: bool = False, steps: int = 2) -> set[str]:
    """Names of trainable tensors that ``steps`` real training steps leave exactly as they were."""
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    for _ in range(steps):
        if full_step:
            step()  # the step runs its own zero_grad/backward/step, in the user's order
            continue
        assert opt is not None
        opt.zero_grad()
        out = step()
        (out if isinstance(out, torch.Tensor) else out.loss).backward()
        opt.step()
    params = dict(model.named_parameters())
    return {n for n, b in before.items() if torch.equal(b, params[n])}


def _weights_stuck(build: Callable[[bool], Case], *, full_step: bool = False) -> Callable[[bool], bool]:
    """Proof for a wiring bug: real steps leave some trainable tensor unmoved that the fixed twin moves."""

    def proof(bug: bool) -> bool:
        model, step, kwargs = build(bug)
        opt = kwargs.get("optimizer") or (
            None if full_step else torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1))
        return bool(_unmoved(model, step, opt, full_step=full_step))

    return proof


@dataclass(frozen=True)
class Entry:
    """One row of the table in docs/audit-corpus.md."""

    key: str
    source: str
    bug_class: str
    caught_by: str


@dataclass(frozen=True)
class Bug(Entry):
    build: Callable[[bool], Case]
    proof: Callable[[bool], bool]
    """True when the bug is present in this setup (must be True for the bug, False for the twin)"""


def _case(key: str) -> Callable[[bool], Case]:
    return CASES[key]


# --- proofs on data and shapes --------------------------------------------------------------------------------
def _no_eos_target(key: str) -> Callable[[bool], bool]:
    def proof(bug: bool) -> bool:
        from tests.test_audit_checks import _EOS, _eos_batch

        return int((_eos_batch(bug)["labels"] == _EOS).sum()) == 0 if key == "DATA-003" else bug

    return proof


def _labels_preshifted(bug: bool) -> bool:
    ids = token_batch(seq=12)["input_ids"]  # the batch CASES["DATA-004"] builds
    labels = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], dim=1) if bug else ids
    return bool((labels[:, :-1] == ids[:, 1:]).all())


def _rows_are_probabilities(bug: bool) -> bool:
    model, _, _ = CASES["LOSS-004"](bug)
    out = model(_X)
    return bool(((out.sum(-1) - 1).abs() < 1e-5).all())


def _broadcasts(bug: bool) -> bool:
    model, _, _ = CASES["LOSS-005"](bug)
    target = _Y.squeeze(-1) if bug else _Y
    return tuple(torch.broadcast_shapes(model(_X).shape, target.shape)) != tuple(model(_X).shape)


def _nll_gets_logits(bug: bool) -> bool:
    model, _, _ = CASES["LOSS-008"](bug)
    out = model(_X) if bug else F.log_softmax(model(_X), -1)
    return bool((out > 0).any())


def _trains_in_eval_mode(bug: bool) -> bool:
    model, _, _ = CASES["MODE-001"](bug)
    return not model.training


def _samples_mix(bug: bool) -> bool:
    model, _, _ = CASES["INPUT-002"](bug)
    x = torch.randn(4, 6, 8, generator=torch.Generator().manual_seed(3))
    other = x.clone()
    other[1:] += 1.0  # change every sample but the first
    return not torch.allclose(model(x)[0], model(other)[0])


def _decayed_norm(bug: bool) -> bool:
    model, _, kwargs = CASES["OPT-007"](bug)
    decayed = {id(p) for g in kwargs["optimizer"].param_groups if g["weight_decay"] > 0 for p in g["params"]}
    return any(id(p) in decayed for n, p in model.named_parameters() if ".ln_" in n or n.startswith("transformer.ln_f"))


def _grads_accumulate(bug: bool) -> bool:
    model, step, _ = CASES["LOOP-003"](bug)
    step()
    return any(p.grad is not None and bool(p.grad.any()) for p in model.parameters())


# --- setups built here (peft save/load, MultiheadAttention, completion-only labels) -------------------------
def _peft_reloaded(bug: bool) -> Case:
    import tempfile

    from peft import PeftModel

    from tests._audit_lora_helpers import lm_batch, lm_step, tiny_gpt2
    from tests.test_audit_lora import gpt2_lora

    directory = tempfile.mkdtemp(prefix="gt-corpus-")
    gpt2_lora().save_pretrained(directory)
    # resuming LoRA training from a saved adapter: from_pretrained loads it for inference unless is_trainable
    model = PeftModel.from_pretrained(tiny_gpt2(), directory, is_trainable=not bug)
    return model, lm_step(model, lm_batch()), {}


def _adapters_frozen(bug: bool) -> bool:
    model, _, _ = _peft_reloaded(bug)
    return not any(p.requires_grad for n, p in model.named_parameters() if "lora_" in n)


class _MhaEncoder(nn.Module):
    """A small encoder on torch's nn.MultiheadAttention, as scGPT/open_clip-style models are built."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(8, 16)
        self.attn = nn.MultiheadAttention(16, 2, batch_first=True)
        self.ff = nn.Linear(16, 16)
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        h = h + self.attn(h, h, h, need_weights=False)[0]
        return self.head(torch.relu(self.ff(h)).mean(1))


def _lora_on_mha_out_proj(bug: bool) -> Case:
    from peft import LoraConfig, get_peft_model

    targets = ["attn.out_proj", "ff"] if bug else ["ff", "embed"]
    model = get_peft_model(_MhaEncoder(), LoraConfig(r=2, lora_alpha=4, target_modules=targets,
                                                     modules_to_save=["head"]))
    x = torch.randn(4, 5, 8, generator=torch.Generator().manual_seed(1))
    y = torch.randn(4, 1, generator=torch.Generator().manual_seed(2))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    return model, lambda: F.mse_loss(model(x), y), {"optimizer": opt}


def _mha_adapter_never_trains(bug: bool) -> bool:
    model, step, kwargs = _lora_on_mha_out_proj(bug)
    return any("out_proj" in n for n in _unmoved(model, step, kwargs["optimizer"], steps=3))


def _completion_batch(bug: bool) -> dict[str, torch.Tensor]:
    from tests.test_audit_checks import _EOS, _sequences_with_eos

    ids, mask = _sequences_with_eos()
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, :3] = -100  # the prompt: only the completion is supervised
    if bug:  # DataCollatorForCompletionOnlyLM with pad = eos: the collator's pad masking also hits the EOS
        labels = labels.masked_fill(ids == _EOS, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _completion_only_masks_eos(bug: bool) -> Case:
    from tests._audit_core_helpers import gpt2

    m = gpt2()
    batch = _completion_batch(bug)
    return m, lambda: m(**batch), {}


def _completion_eos_masked(bug: bool) -> bool:
    from tests.test_audit_checks import _EOS

    return int((_completion_batch(bug)["labels"] == _EOS).sum()) == 0


def _schedule_stuck(bug: bool) -> bool:
    model, step, kwargs = CASES["OPT-004/schedule"](bug)
    opt, sched = kwargs["optimizer"], kwargs["lr_scheduler"]
    before = [p.detach().clone() for p in model.parameters()]
    for _ in range(3):  # the real loop steps the scheduler after every optimizer step
        opt.zero_grad()
        step().backward()
        opt.step()
        sched.step()
    return all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


# --- proofs for cases whose setup lives in test_audit_checks.py --------------------------------------------------
def _never_below_half(bug: bool) -> bool:
    """A sigmoid before BCEWithLogitsLoss: the loss's own sigmoid then never predicts below 0.5 (never "no")."""
    model, _, _ = CASES["LOSS-004/bce"](bug)
    return bool((torch.sigmoid(model(_X)) >= 0.5).all())


def _padding_carries_labels(bug: bool) -> bool:
    batch = token_batch(pad_last=3)  # the batch CASES["DATA-002"] builds
    labels = batch["input_ids"].clone() if bug else batch["labels"]
    return bool((labels[batch["attention_mask"] == 0] != -100).any())


def _loss_not_finite(build: Callable[[bool], Case]) -> Callable[[bool], bool]:
    """Proof for a batch that trains on nothing: the model's own loss on it is NaN."""

    def proof(bug: bool) -> bool:
        _, step, _ = build(bug)
        with torch.no_grad():
            return not bool(torch.isfinite(step().loss))

    return proof


# --- setups built here: LoRA/PEFT wiring --------------------------------------------------------------------------
def _lora_trainable_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)


def _lora_base_unfrozen(bug: bool) -> Case:
    from tests._audit_lora_helpers import lm_batch, lm_step
    from tests.test_audit_lora import gpt2_lora

    model = gpt2_lora()
    if bug:  # a "tunable parts" switch re-enables the whole language model after get_peft_model froze it
        model.base_model.model.transformer.requires_grad_(True)
    return model, lm_step(model, lm_batch()), {"optimizer": _lora_trainable_optimizer(model)}


def _base_weights_move(bug: bool) -> bool:
    model, step, kwargs = _lora_base_unfrozen(bug)
    base = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" not in n}
    _unmoved(model, step, kwargs["optimizer"])
    params = dict(model.named_parameters())
    return any(not torch.equal(b, params[n]) for n, b in base.items())


def _lora_classifier(bug: bool) -> Case:
    from tests._audit_lora_helpers import cls_step, lm_batch, lora, tiny_bert_cls

    # without task_type="SEQ_CLS" peft does not know the new head must train (no modules_to_save for it)
    model = lora(tiny_bert_cls(), target_modules=["query", "value"], **({} if bug else {"task_type": "SEQ_CLS"}))
    return model, cls_step(model, lm_batch(), torch.tensor([0, 2])), {"optimizer": _lora_trainable_optimizer(model)}


def _classifier_frozen(bug: bool) -> bool:
    model, _, _ = _lora_classifier(bug)
    return not any(p.requires_grad for n, p in model.named_parameters() if "classifier" in n)


def _lora_checkpointing_without_input_grads(bug: bool) -> Case:
    from tests.test_audit_lora import _checkpointed_llama_cls_ids

    model, step = _checkpointed_llama_cls_ids(input_grads=not bug)
    return model, step, {"optimizer": _lora_trainable_optimizer(model)}


def _adapters_never_train(bug: bool) -> bool:
    model, step, kwargs = _lora_checkpointing_without_input_grads(bug)
    return any("lora_" in n for n in _unmoved(model, step, kwargs["optimizer"]))


def _lora_cast_to_half(bug: bool) -> Case:
    from tests._audit_lora_helpers import lm_batch, lm_step
    from tests.test_audit_lora import gpt2_lora

    model = gpt2_lora()
    if bug:  # "to save memory" after get_peft_model: the trainable adapters become float16 too
        model.half()
    return model, lm_step(model, lm_batch()), {"optimizer": _lora_trainable_optimizer(model)}


def _nonfinite_after_one_step(build: Callable[[bool], Case]) -> Callable[[bool], bool]:
    """Proof for a precision bug: one real optimizer step turns the finite weights NaN/Inf."""

    def proof(bug: bool) -> bool:
        model, step, kwargs = build(bug)
        out = step()
        (out if isinstance(out, torch.Tensor) else out.loss).backward()
        kwargs["optimizer"].step()
        return not all(bool(torch.isfinite(p).all()) for p in model.parameters())

    return proof


# --- setups built here: optimizer wiring ------------------------------------------------------------------------
def _optimizer_for_the_other_copy(bug: bool) -> Case:
    first = mlp()  # e.g. the LoRA variant, with the DoRA variant built next from the same base
    second = copy.deepcopy(first)
    opt = torch.optim.Adam((first if bug else second).parameters(), lr=1e-3)  # one name, the wrong model
    return second, lambda: F.mse_loss(second(_X), _Y), {"optimizer": opt}


def _frozen_after_optimizer(bug: bool) -> Case:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    def step() -> torch.Tensor:
        return F.mse_loss(model(_X), _Y)

    opt.zero_grad()
    step().backward()
    opt.step()  # a first phase trained everything
    model[0].requires_grad_(False)  # then the first layer is frozen...
    if not bug:  # ...and the optimizer rebuilt over what still trains
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.05, momentum=0.9)
    return model, step, {"optimizer": opt}


def _frozen_layer_moves(bug: bool) -> bool:
    model, step, kwargs = _frozen_after_optimizer(bug)
    opt = kwargs["optimizer"]
    before = [p.detach().clone() for p in model[0].parameters()]
    for _ in range(2):
        opt.zero_grad(set_to_none=False)  # the default before PyTorch 2.0: stale gradients become zeros, not None
        step().backward()
        opt.step()
    return any(not torch.equal(b, p) for b, p in zip(before, model[0].parameters()))


# --- setups built here: gradient flow and numerics --------------------------------------------------------------
class _NoGradEncoder(nn.Module):
    """An encoder meant to train, run under torch.no_grad() (copied from a feature-extraction path)."""

    def __init__(self, bug: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.bug = bug
        self.encoder = nn.Sequential(nn.Linear(8, 16), nn.ReLU())
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad() if self.bug else contextlib.nullcontext():
            h = self.encoder(x)
        return self.head(h)


def _encoder_under_no_grad(bug: bool) -> Case:
    model = _NoGradEncoder(bug)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    return model, lambda: F.mse_loss(model(_X), _Y), {"optimizer": opt}


def _encoder_never_trains(bug: bool) -> bool:
    model, step, kwargs = _encoder_under_no_grad(bug)
    return any(n.startswith("encoder.") for n in _unmoved(model, step, kwargs["optimizer"]))


class _PairEncoder(nn.Module):
    """Embeds both sides of a pair; the output projection has no bias (it would cancel in the difference)."""

    def __init__(self, bug: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.bug = bug
        self.body = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16, bias=False))

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        diff = self.body(a) - self.body(b)
        # sqrt(sum(d^2)) has an infinite derivative at d = 0; vector_norm's subgradient there is 0
        return (diff**2).sum(-1).sqrt() if self.bug else torch.linalg.vector_norm(diff, dim=-1)


def _euclidean_distance_of_identical_pair(bug: bool) -> Case:
    model = _PairEncoder(bug)
    a, b = _X, torch.randn(16, 8, generator=torch.Generator().manual_seed(8))
    b[5] = a[5]  # an anchor paired with itself (a duplicate in the dataset)
    target = torch.ones(16)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    return model, lambda: F.mse_loss(model(a, b), target), {"optimizer": opt}


CORPUS: list[Bug] = [
    Bug("loop-zero-grad-between", "https://velog.io/@rhss10/기본-optimizer.zerograd는-어디에-넣어주어야-할까",
        "training loop", "LOOP-001", _case("LOOP-001"), _weights_stuck(_case("LOOP-001"), full_step=True)),
    Bug("loop-step-before-backward", "https://theneuralbase.com/pytorch/learn/beginner/forward-pass-loss-backward-step/",
        "training loop", "LOOP-002", _case("LOOP-002"), _weights_stuck(_case("LOOP-002"), full_step=True)),
    Bug("loop-no-zero-grad", "https://preproom.ai/learn/model-training-pytorch.html",
        "training loop", "LOOP-003", _case("LOOP-003"), _grads_accumulate),
    Bug("new-head-not-in-optimizer",
        "https://runebook.dev/en/docs/pytorch/generated/torch.optim.adafactor/torch.optim.Adafactor.add_param_group",
        "optimizer wiring", "OPT-001", _case("OPT-001"), _weights_stuck(_case("OPT-001"))),
    Bug("linear-schedule-zero-steps", "https://github.com/huggingface/transformers/pull/5316",
        "optimizer wiring", "OPT-004", _case("OPT-004/schedule"), _schedule_stuck),
    Bug("no-decay-name-filter", "https://github.com/huggingface/transformers/issues/16908",
        "optimizer wiring", "OPT-007", _case("OPT-007"), _decayed_norm),
    Bug("double-softmax", "https://runebook.dev/en/articles/pytorch/generated/torch.nn.softmax",
        "losses", "LOSS-004", _case("LOSS-004"), _rows_are_probabilities),
    Bug("mse-broadcast", "https://blog.gitcode.com/622b5fd6838803808dcfbf68d2df7a66.html",
        "losses", "LOSS-005", _case("LOSS-005"), _broadcasts),
    Bug("nll-on-probabilities", "https://runebook.dev/en/docs/pytorch/generated/torch.nn.softmax",
        "losses", "LOSS-008", _case("LOSS-008"), _nll_gets_logits),
    Bug("pad-eq-eos-masks-eos", "https://github.com/huggingface/transformers/issues/23530",
        "labels", "DATA-003", _case("DATA-003"), _no_eos_target("DATA-003")),
    Bug("completion-only-masks-eos", "https://github.com/huggingface/trl/issues/976",
        "labels", "DATA-003", _completion_only_masks_eos, _completion_eos_masked),
    Bug("labels-shifted-twice", "https://github.com/huggingface/transformers/pull/44642",
        "labels", "DATA-004", _case("DATA-004"), _labels_preshifted),
    Bug("reentrant-checkpoint-frozen-input", "https://github.com/huggingface/transformers/issues/26221",
        "gradient checkpointing", "GRAD-006", _case("GRAD-006"), _weights_stuck(_case("GRAD-006"))),
    Bug("fp16-adamw-nan", "https://github.com/TUDB-Labs/mLoRA/pull/11",
        "precision", "NAN-004", _case("NAN-004"), _nonfinite_after_one_step(_case("NAN-004"))),
    Bug("bf16-weights-no-update", "https://github.com/keras-team/keras-hub/issues/2629",
        "precision", "AMP-002", _case("AMP-002"), _weights_stuck(_case("AMP-002"))),
    Bug("eval-mode-left-on", "https://github.com/shubhamagarwal92/mmd/issues/14",
        "train/eval mode", "MODE-001", _case("MODE-001"), _trains_in_eval_mode),
    Bug("reshape-mixes-batch",
        "https://medium.com/mcgill-artificial-intelligence-review/the-dangers-of-reshaping-and-other-fun-mistakes-ive-learnt-from-pytorch-b6a5bdc1c275",
        "inputs", "INPUT-002", _case("INPUT-002"), _samples_mix),
    Bug("peft-reloaded-frozen", "https://github.com/huggingface/peft/issues/282",
        "LoRA/PEFT", "LORA-002", _peft_reloaded, _adapters_frozen),
    Bug("lora-on-mha-out-proj", "https://github.com/helicalAI/helical/pull/405",
        "LoRA/PEFT", "GRAD-001", _lora_on_mha_out_proj, _mha_adapter_never_trains),
    Bug("optimizer-before-adapters", "https://github.com/adapter-hub/adapters/issues/260",
        "LoRA/PEFT", "LORA-003", _case("OPT-003/peft"), _weights_stuck(_case("OPT-003/peft"))),
    Bug("lora-classifier-frozen", "https://github.com/TNI-playground/Fed_HeLLo/issues/2",
        "LoRA/PEFT", "LORA-008", _lora_classifier, _classifier_frozen),
    Bug("lora-base-unfrozen", "https://github.com/LLaVA-VL/LLaVA-NeXT/issues/508",
        "LoRA/PEFT", "LORA-001", _lora_base_unfrozen, _base_weights_move),
    Bug("lora-checkpointing-frozen-inputs", "https://github.com/kohya-ss/sd-scripts/issues/91",
        "LoRA/PEFT", "LORA-006", _lora_checkpointing_without_input_grads, _adapters_never_train),
    Bug("optimizer-for-the-other-model", "https://github.com/rasbt/dora-from-scratch/pull/1",
        "optimizer wiring", "OPT-003", _optimizer_for_the_other_copy, _weights_stuck(_optimizer_for_the_other_copy)),
    Bug("frozen-after-optimizer",
        "https://discuss.pytorch.org/t/why-there-is-still-a-small-change-in-frozen-layer-parameters/153740",
        "optimizer wiring", "OPT-002", _frozen_after_optimizer, _frozen_layer_moves),
    Bug("loss-rewrapped-requires-grad", "https://github.com/speechbrain/speechbrain/issues/735",
        "losses", "LOSS-001", _case("LOSS-001/rewrapped"), _weights_stuck(_case("LOSS-001/rewrapped"))),
    Bug("sigmoid-before-bce-with-logits", "https://github.com/yudi-mars/daisyRec/pull/15",
        "losses", "LOSS-004", _case("LOSS-004/bce"), _never_below_half),
    Bug("padding-labelled", "https://github.com/meta-llama/llama-cookbook/issues/73",
        "labels", "DATA-002", _case("DATA-002"), _padding_carries_labels),
    Bug("response-template-not-found", "https://github.com/huggingface/trl/issues/1820",
        "labels", "DATA-001", _case("DATA-001"), _loss_not_finite(_case("DATA-001"))),
    Bug("encoder-under-no-grad", "https://github.com/rll-research/cic/issues/5",
        "gradient flow", "GRAD-001", _encoder_under_no_grad, _encoder_never_trains),
    Bug("sqrt-distance-identical-pair", "https://github.com/huggingface/sentence-transformers/pull/4033",
        "numerics", "NAN-002", _euclidean_distance_of_identical_pair,
        _nonfinite_after_one_step(_euclidean_distance_of_identical_pair)),
    Bug("lora-cast-to-half", "https://github.com/huggingface/peft/issues/1522",
        "LoRA/PEFT", "LORA-010", _lora_cast_to_half, _nonfinite_after_one_step(_lora_cast_to_half)),
    Bug("relu-bias-init-dead", "https://github.com/facebookresearch/dlrm/pull/358",
        "numerics", "RELU-001", _case("RELU-001"), _weights_stuck(_case("RELU-001"))),
]


#: cases on real torch.distributed (gloo, two ranks): built, proven and audited by _audit_corpus_dist_worker.py
DIST_CORPUS: list[Entry] = [
    Entry("ddp-batchnorm-per-rank", "https://github.com/LibreYOLO/libreyolo/pull/531", "distributed", "DDP-002"),
    Entry("ddp-same-batch-every-rank", "https://github.com/PatrickHua/SimSiam/issues/16", "distributed", "DDP-006"),
    Entry("ddp-forward-bypasses-wrapper", "https://github.com/jingyaogong/minimind/issues/853", "distributed",
          "DDP-004"),
]


@pytest.mark.parametrize("bug", CORPUS, ids=lambda b: b.key)
def test_the_bug_is_real_and_caught_and_its_twin_is_quiet(bug: Bug) -> None:
    assert bug.proof(True) and not bug.proof(False), "the reproduction does not show the bug"
    model, step, kwargs = bug.build(True)
    report = audit(model, step, **kwargs)
    assert any(f.severity >= Severity.WARN for f in report.by_id(bug.caught_by)), str(report)
    model, step, kwargs = bug.build(False)
    twin = audit(model, step, **kwargs)
    loud = [f"{f.severity.label} {f.catalog_id}: {f.message}" for f in twin if f.severity >= Severity.WARN]
    assert not loud, "\n".join(loud)


@pytest.fixture(scope="module")
def dist_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Both ranks' results for every distributed case, from one two-process launch."""
    return run_two_ranks(ROOT / "tests" / "_audit_corpus_dist_worker.py", tmp_path_factory.mktemp("corpus-dist"))


def test_the_distributed_worker_runs_exactly_the_distributed_cases(dist_ranks: list[dict[str, Any]]) -> None:
    for rank in dist_ranks:
        assert {name.split("/")[0] for name in rank} == {b.key for b in DIST_CORPUS}


@pytest.mark.parametrize("bug", DIST_CORPUS, ids=lambda b: b.key)
def test_the_distributed_bug_is_real_and_caught_and_its_twin_is_quiet(bug: Entry,
                                                                      dist_ranks: list[dict[str, Any]]) -> None:
    for rank in dist_ranks:
        real, twin = rank[f"{bug.key}/bug"], rank[f"{bug.key}/twin"]
        assert "error" not in real and "error" not in twin, real.get("error") or twin.get("error")
        assert real["proof"] and not twin["proof"], "the reproduction does not show the bug"
        assert any(catalog_id == bug.caught_by for catalog_id, _ in real["loud"]), real["loud"]
        assert not twin["loud"], twin["loud"]


def test_the_corpus_table_lists_every_case() -> None:
    table = (ROOT / "docs" / "audit-corpus.md").read_text()
    missing = [b.key for b in [*CORPUS, *DIST_CORPUS] if f"`{b.key}`" not in table or b.source not in table]
    assert not missing, missing
