"""Families 4 and 5 on correct setups that look like their bugs: frozen parts kept as intended (a teacher, a LoRA
base, partially frozen layers) and padding that the model handles (right padding, pad == eos, rotary or
mask-derived positions, encoder-decoders). None of them may raise a MODE- or INPUT-003/4/5 finding."""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from guardtower.preflight import audit

from tests._audit_core_helpers import VOCAB, gpt2, llama, quiet_transformers, token_batch
from tests.test_audit_checks import _bert_classifier, _bert_encoder, _left_padded

NEW_IDS = ("MODE-001", "MODE-002", "MODE-003", "MODE-004", "INPUT-003", "INPUT-004", "INPUT-005")
Setup = tuple[nn.Module, Callable[[], Any]]
SETUPS: dict[str, Callable[[], Setup]] = {}


def setup(fn: Callable[[], Setup]) -> Callable[[], Setup]:
    SETUPS[fn.__name__.lstrip("_")] = fn
    return fn


class _GPT2Distill(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.student = gpt2(n_layer=1)
        self.teacher = gpt2(n_layer=2, resid_pdrop=0.2)
        self.teacher.requires_grad_(False)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            target = self.teacher(input_ids=input_ids, attention_mask=attention_mask).logits.softmax(-1)
        logits = self.student(input_ids=input_ids, attention_mask=attention_mask).logits
        return F.kl_div(logits.log_softmax(-1), target, reduction="batchmean")


@setup
def _teacher_in_eval() -> Setup:
    m = _GPT2Distill()
    m.train()
    m.teacher.eval()
    batch = token_batch(pad_last=3)
    return m, lambda: m(batch["input_ids"], batch["attention_mask"])


@setup
def _lora_bert_classifier() -> Setup:
    from peft import LoraConfig, get_peft_model

    m = get_peft_model(_bert_classifier(), LoraConfig(r=2, lora_alpha=4, lora_dropout=0.1,
                                                      target_modules=["query", "value"], modules_to_save=["classifier"]))
    m.train()
    batch = {**token_batch(pad_last=3), "labels": torch.tensor([0, 1, 1, 0])}
    return m, lambda: m(**batch)


@setup
def _lora_gpt2() -> Setup:
    from peft import LoraConfig, get_peft_model

    m = get_peft_model(gpt2(), LoraConfig(r=2, lora_alpha=4, lora_dropout=0.1, target_modules=["c_attn"],
                                          fan_in_fan_out=True))
    m.train()
    batch = token_batch(pad_last=3)
    return m, lambda: m(**batch)


@setup
def _partially_frozen_bert() -> Setup:
    m = _bert_classifier()
    m.bert.embeddings.requires_grad_(False)
    m.bert.encoder.layer[0].requires_grad_(False)
    m.train()  # the usual recipe: dropout stays on everywhere
    batch = {**token_batch(pad_last=3), "labels": torch.tensor([0, 1, 1, 0])}
    return m, lambda: m(**batch)


@setup
def _bert_encoder_right_padded() -> Setup:
    encoder = _bert_encoder()
    head = nn.Linear(32, 2)
    m = nn.ModuleDict({"encoder": encoder, "head": head})
    m.train()
    batch = token_batch(pad_last=3)

    def step() -> torch.Tensor:
        h = encoder(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
        pooled = (h * batch["attention_mask"][..., None]).sum(1) / batch["attention_mask"].sum(1, keepdim=True)
        return F.cross_entropy(head(pooled), torch.tensor([0, 1, 1, 0]))

    return m, step


@setup
def _frozen_encoder_no_grad_eval() -> Setup:
    from tests.test_audit_checks import _FrozenEncoderProbe

    m = _FrozenEncoderProbe()
    m.train()
    m.encoder.eval()
    batch = token_batch(pad_last=3)
    return m, lambda: F.cross_entropy(m(batch["input_ids"], batch["attention_mask"]), torch.arange(4) % 3)


@setup
def _frozen_llama_without_dropout_in_train_mode() -> Setup:
    class Probe(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lm = llama()  # attention_dropout=0: train mode draws no random numbers
            self.lm.requires_grad_(False)
            self.head = nn.Linear(32, 2)

        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
            out = self.lm.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
            return self.head(out[:, -1])

    m = Probe()
    m.train()
    batch = token_batch()
    return m, lambda: F.cross_entropy(m(batch["input_ids"], batch["attention_mask"]), torch.tensor([0, 1, 1, 0]))


@setup
def _gpt2_pad_is_eos_supervised() -> Setup:
    m = gpt2()  # pad == eos == 0
    batch = token_batch(pad_last=3)
    batch["input_ids"][:, -4] = 0  # every row ends its text with EOS (row 3 just before its padding)
    batch["input_ids"][:3, -1] = 0
    batch["labels"] = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    return m, lambda: m(**batch)


@setup
def _llama_left_padded() -> Setup:
    m = llama()  # rotary positions follow the mask-derived cache positions of each token, not the row start
    batch = _left_padded()
    return m, lambda: m(**batch)


@setup
def _opt_left_padded() -> Setup:
    from transformers import OPTConfig, OPTForCausalLM

    quiet_transformers()
    torch.manual_seed(0)
    m = OPTForCausalLM(OPTConfig(vocab_size=VOCAB, hidden_size=32, ffn_dim=64, num_hidden_layers=2,
                                 num_attention_heads=2, max_position_embeddings=32, word_embed_proj_dim=32,
                                 pad_token_id=1, bos_token_id=2, eos_token_id=2))
    batch = _left_padded(pad=1)  # OPT derives positions from the attention mask
    return m, lambda: m(**batch)


@setup
def _roberta_mlm_left_padded() -> Setup:
    from transformers import RobertaConfig, RobertaForMaskedLM

    quiet_transformers()
    torch.manual_seed(0)
    m = RobertaForMaskedLM(RobertaConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                         intermediate_size=64, max_position_embeddings=40, pad_token_id=1))
    batch = _left_padded(pad=1)  # RoBERTa numbers positions past its pad ids
    return m, lambda: m(**batch)


@setup
def _t5_padded() -> Setup:
    from transformers import T5Config, T5ForConditionalGeneration

    quiet_transformers()
    torch.manual_seed(0)
    m = T5ForConditionalGeneration(T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=1,
                                            num_decoder_layers=1, num_heads=2, decoder_start_token_id=0,
                                            pad_token_id=0, eos_token_id=1))
    batch = token_batch(pad_last=3)
    labels = token_batch(seed=7)["input_ids"]
    labels[-1, -2:] = -100
    batch["labels"] = labels
    return m, lambda: m(**batch)


@setup
def _bart_padded() -> Setup:
    from transformers import BartConfig, BartForConditionalGeneration

    quiet_transformers()
    torch.manual_seed(0)
    m = BartForConditionalGeneration(BartConfig(
        vocab_size=VOCAB, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=32,
        pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2))
    batch = token_batch(pad_last=3)
    batch["input_ids"][batch["attention_mask"] == 0] = 1
    labels = token_batch(seed=7)["input_ids"]
    labels[-1, -2:] = -100
    batch["labels"] = labels
    return m, lambda: m(**batch)


@pytest.mark.parametrize("name", sorted(SETUPS))
def test_correct_setup_raises_no_mode_or_padding_finding(name: str) -> None:
    model, step = SETUPS[name]()
    report = audit(model, step)
    hits = [f"{f.severity.label} {f.catalog_id} {f.message}" for f in report if f.catalog_id in NEW_IDS]
    assert not hits, "\n".join(hits)


def test_a_lora_setup_with_a_frozen_backbone_in_train_mode_is_still_caught() -> None:
    """Looking through peft's wrappers: a frozen vision-style backbone next to a LoRA'd part is a component."""
    from peft import LoraConfig, get_peft_model

    class TwoTower(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.backbone = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.2), nn.ReLU())
            self.body = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.body(self.backbone(x))

    m = get_peft_model(TwoTower(), LoraConfig(r=2, target_modules=["body.0"]))
    m.train()
    x, y = torch.randn(8, 8, generator=torch.Generator().manual_seed(1)), torch.arange(8) % 3
    (finding,) = audit(m, lambda: F.cross_entropy(m(x), y)).by_id("MODE-002")
    assert finding.details["modules"] == ["base_model.model.backbone"]


def test_frozen_parts_probe_leaves_rng_and_buffers_as_found() -> None:
    from tests._audit_core_helpers import fingerprint
    from tests.test_audit_checks import CASES

    for key in ("MODE-002", "MODE-003"):
        model, step, kwargs = CASES[key](True)
        before = fingerprint(model)
        assert audit(model, step, **kwargs).by_id(key)
        assert fingerprint(model) == before


def test_input_003_every_row_padded_alike_and_bert_without_position_ids() -> None:
    m = gpt2()
    batch = _left_padded()
    batch["input_ids"][:, :2], batch["attention_mask"][:, :2] = 0, 0  # no row starts with a real token
    batch["labels"] = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    assert audit(m, lambda: m(**batch)).by_id("INPUT-003")
    fixed = {**batch, "position_ids": (batch["attention_mask"].cumsum(-1) - 1).clamp(min=0)}
    assert not audit(m, lambda: m(**fixed)).by_id("INPUT-003")
    from tests._audit_core_helpers import bert_mlm

    m = bert_mlm()
    batch = _left_padded()
    (finding,) = audit(m, lambda: m(**batch)).by_id("INPUT-003")
    assert finding.details["rows"] == [1, 2, 3] and finding.details["position_ids"] is False


def test_roberta_padding_with_another_id_shifts_its_positions_too() -> None:
    model, step = SETUPS["roberta_mlm_left_padded"]()
    batch = _left_padded(pad=0)  # the tokenizer pads with 0, the config says 1
    report = audit(model, lambda: model(**batch))
    (wrong_id,) = report.by_id("INPUT-005")
    assert wrong_id.details == {"pad_id_used": 0, "pad_token_id": 1}
    assert report.by_id("INPUT-003")  # RoBERTa numbers positions past pad ids only: these count as tokens


def test_frozen_layers_of_a_stack_are_fine_tuning_not_a_frozen_component() -> None:
    """Freezing the first blocks of a conv stack (the YOLO transfer-learning recipe) keeps its dropout as the
    fine-tune's regularisation and reports the moving statistics as INFO only; a frozen backbone is a WARN."""
    def block(c_in: int, c_out: int) -> nn.Sequential:
        return nn.Sequential(nn.Conv2d(c_in, c_out, 3, padding=1), nn.BatchNorm2d(c_out), nn.SiLU(), nn.Dropout2d(0.1))

    torch.manual_seed(0)
    m = nn.Sequential(block(3, 8), block(8, 8), nn.Conv2d(8, 5, 1))
    m[0].requires_grad_(False)
    m.train()
    x, y = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(2)), torch.arange(4) % 5
    report = audit(m, lambda: F.cross_entropy(m(x).mean((2, 3)), y))
    assert not report.by_id("MODE-002") and not report.by_id("MODE-001")
    (stats,) = report.by_id("MODE-003")
    assert stats.severity.label == "INFO" and stats.details["modules"] == ["0"]
    torch.manual_seed(0)
    m = nn.Sequential(block(3, 8), block(8, 8), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 5))
    m[:2].requires_grad_(False)  # the whole conv stack is a frozen backbone in front of a head
    m.train()
    report = audit(m, lambda: F.cross_entropy(m(x), y))
    assert report.by_id("MODE-002") and not report.errors
    assert {f.severity.label for f in report.by_id("MODE-003")} == {"WARN"}


def test_input_005_reads_padding_at_row_edges_only() -> None:
    """A position masked out inside a row (a hidden token, not padding) says nothing about the pad id."""
    from tests.test_audit_checks import _llama_classifier

    m = _llama_classifier(pad=VOCAB - 1)
    batch = {**token_batch(), "labels": torch.tensor([0, 1, 1, 0])}
    batch["attention_mask"][1, 3] = 0
    assert not audit(m, lambda: m(**batch)).by_id("INPUT-005")
    batch["attention_mask"][1, -2:] = 0  # real right padding, filled with another id than the config's
    batch["input_ids"][1, -2:] = 5
    assert audit(m, lambda: m(**batch)).by_id("INPUT-005")
