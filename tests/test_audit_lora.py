"""LoRA / PEFT audit checks on real peft models (tiny GPT-2, Llama, BERT built from configs).

Every catalog entry LORA-001..012 has a test that triggers it and a clean counterpart.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from _audit_lora_helpers import (
    cls_step,
    ids,
    lm_batch,
    lm_step,
    loralib_llama_cls,
    lora,
    run_audit,
    tiny_bert_cls,
    tiny_gpt2,
    tiny_llama,
    tiny_llama_cls,
)
from guardtower.preflight.lora import is_peft_model, lora_summary
from guardtower.report import Report
from guardtower.failure_modes import CATALOG
from guardtower.errors import ConfigError
from guardtower.severity import Severity

GPT2_TARGETS = dict(target_modules=["c_attn"], fan_in_fan_out=True)


def gpt2_lora(**kw: object) -> nn.Module:
    return lora(tiny_gpt2(), **{**GPT2_TARGETS, **kw})


def trainable_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)


# --- clean baseline ----------------------------------------------------------------------------------------------


def test_fresh_gpt2_lora_passes_with_only_the_expected_info() -> None:
    model = gpt2_lora()
    report = run_audit(model, lm_step(model, lm_batch()), optimizer=trainable_optimizer(model))
    lora_ids = {i for i in ids(report) if i.startswith("LORA")}
    assert report.ok
    assert lora_ids == {"LORA-004", "LORA-013"}
    (info,) = report.by_id("LORA-004")
    assert info.severity is Severity.INFO and info.details["count"] == 2
    assert all("lora_A" in name for name in info.details["params"])


def test_probes_leave_no_hooks_behind() -> None:
    model = gpt2_lora()
    before = {n: (len(m._forward_pre_hooks), len(m._forward_hooks)) for n, m in model.named_modules()}
    run_audit(model, lm_step(model, lm_batch()), optimizer=trainable_optimizer(model))
    after = {n: (len(m._forward_pre_hooks), len(m._forward_hooks)) for n, m in model.named_modules()}
    assert after == before


# --- LORA-001 base not frozen -------------------------------------------------------------------------------------


def test_lora_001_unfrozen_base_is_an_error() -> None:
    model = gpt2_lora()
    model.requires_grad_(True)  # "make sure everything trains" after wrapping
    report = lora_summary(model)
    (finding,) = report.by_id("LORA-001")
    assert finding.severity is Severity.ERROR and finding.check == "lora_base_frozen"
    assert any("wte" in p for p in finding.details["params"]) or finding.details["count"] > 10
    assert not any("lora_" in p for p in finding.details["params"])


def test_lora_001_clean_with_frozen_base_and_bias_all() -> None:
    assert not lora_summary(gpt2_lora()).by_id("LORA-001")
    # bias="all" makes every bias trainable on purpose: not a frozen-base violation
    assert not lora_summary(gpt2_lora(bias="all")).by_id("LORA-001")


# --- LORA-002 adapter frozen ----------------------------------------------------------------------------------------


def test_lora_002_adapter_loaded_for_inference_is_frozen(tmp_path) -> None:
    from peft import PeftModel

    gpt2_lora().save_pretrained(tmp_path / "adapter")
    loaded = PeftModel.from_pretrained(tiny_gpt2(), tmp_path / "adapter")  # is_trainable defaults to False
    report = run_audit(loaded, lm_step(loaded, lm_batch()))
    (finding,) = report.by_id("LORA-002")
    assert finding.severity is Severity.ERROR and "inference_mode" in finding.message
    assert finding.details["count"] == 4


def test_lora_002_clean_when_loaded_trainable(tmp_path) -> None:
    from peft import PeftModel

    gpt2_lora().save_pretrained(tmp_path / "adapter")
    loaded = PeftModel.from_pretrained(tiny_gpt2(), tmp_path / "adapter", is_trainable=True)
    assert not run_audit(loaded, lm_step(loaded, lm_batch())).by_id("LORA-002")


# --- LORA-003 adapter missing from optimizer ------------------------------------------------------------------------


def test_lora_003_optimizer_built_before_get_peft_model() -> None:
    base = tiny_gpt2()
    optimizer = torch.optim.AdamW(base.parameters(), lr=1e-3)
    model = lora(base, **GPT2_TARGETS)
    report = run_audit(model, lm_step(model, lm_batch()), optimizer=optimizer)
    (finding,) = report.by_id("LORA-003")
    assert finding.severity is Severity.ERROR and "before get_peft_model" in finding.message
    assert not report.ok


def test_lora_003_partial_optimizer_names_the_missing_factors() -> None:
    model = gpt2_lora()
    adapters = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW([p for n, p in adapters if ".h.0." in n], lr=1e-3)
    (finding,) = lora_summary(model, optimizer=optimizer).by_id("LORA-003")
    assert finding.details["count"] == 2 and all(".h.1." in p for p in finding.details["params"])


def test_lora_003_clean_when_optimizer_built_after() -> None:
    model = gpt2_lora()
    assert not lora_summary(model, optimizer=trainable_optimizer(model)).by_id("LORA-003")


# --- LORA-004 zero gradient of the random factor at init (expected) -------------------------------------------------


def test_lora_004_is_info_and_clean_when_b_is_not_zero() -> None:
    fresh = gpt2_lora()
    assert run_audit(fresh, lm_step(fresh, lm_batch())).by_id("LORA-004")[0].severity is Severity.INFO
    random_init = gpt2_lora(init_lora_weights=False)  # B random too: no by-design zero gradient
    assert not run_audit(random_init, lm_step(random_init, lm_batch())).by_id("LORA-004")


def test_lora_004_gone_after_one_real_training_step() -> None:
    model = gpt2_lora()
    optimizer = trainable_optimizer(model)
    x = lm_batch()
    model(input_ids=x, labels=x).loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    report = run_audit(model, lm_step(model, x), optimizer=optimizer)
    assert not report.by_id("LORA-004") and not report.by_id("LORA-006")


# --- LORA-005 trainable share high ----------------------------------------------------------------------------------


def test_lora_005_large_rank_on_small_model() -> None:
    (finding,) = lora_summary(gpt2_lora(r=64, lora_alpha=128)).by_id("LORA-005")
    assert finding.severity is Severity.INFO and finding.details["percent"] > 10


def test_lora_005_clean_for_small_rank() -> None:
    report = lora_summary(gpt2_lora(r=4))
    assert not report.by_id("LORA-005")
    assert "trainable" in report.title and "3.2" in report.title


def test_lora_005_not_fooled_by_modules_to_save_the_user_asked_for() -> None:
    saved = gpt2_lora(r=4, modules_to_save=["wte"])  # a whole embedding copy: a large share, chosen on purpose
    trainable = sum(p.numel() for p in saved.parameters() if p.requires_grad)
    assert trainable / sum(p.numel() for p in saved.parameters()) > 0.10
    assert not lora_summary(saved).by_id("LORA-005")


# --- LORA-006 zero-init factor gets no gradient (reentrant checkpointing) -------------------------------------------


def _checkpointed_llama_cls(reentrant: bool) -> tuple[nn.Module, object]:
    model = lora(tiny_llama_cls(), task_type="SEQ_CLS", target_modules=["q_proj", "v_proj"])
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    model.train()
    ids_ = lm_batch()
    # embeddings computed outside the model (a frozen projector, cached prompt embeddings): they do not require
    # grad, and transformers' enable_input_require_grads hook on the embedding layer never sees them
    embeds = model.get_input_embeddings().weight[ids_].detach()
    labels = torch.tensor([0, 1])
    return model, lambda: model(inputs_embeds=embeds, labels=labels)


def test_lora_006_reentrant_checkpointing_starves_lora_b() -> None:
    model, step = _checkpointed_llama_cls(reentrant=True)
    report = run_audit(model, step, optimizer=trainable_optimizer(model))
    (finding,) = report.by_id("LORA-006")
    assert finding.severity is Severity.ERROR and not report.ok
    assert finding.details["count"] == 4 and all("lora_B" in p for p in finding.details["params"])
    assert "reentrant" in finding.message and finding.details["reentrant_checkpointing"]
    assert not report.by_id("LORA-004")  # nothing flowed: not the by-design zero


def test_lora_006_clean_with_non_reentrant_checkpointing() -> None:
    model, step = _checkpointed_llama_cls(reentrant=False)
    report = run_audit(model, step, optimizer=trainable_optimizer(model))
    assert not report.by_id("LORA-006")
    assert report.by_id("LORA-004")


def _checkpointed_llama_cls_ids(*, input_grads: bool) -> tuple[nn.Module, object]:
    model = lora(tiny_llama_cls(), task_type="SEQ_CLS", target_modules=["q_proj", "v_proj"])
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    if not input_grads:
        model.disable_input_require_grads()  # what older transformers versions never enabled
    model.train()
    ids_, labels = lm_batch(), torch.tensor([0, 1])
    return model, lambda: model(input_ids=ids_, labels=labels)


def test_lora_006_reentrant_checkpointing_without_input_require_grads() -> None:
    model, step = _checkpointed_llama_cls_ids(input_grads=False)
    (finding,) = run_audit(model, step, optimizer=trainable_optimizer(model)).by_id("LORA-006")
    assert finding.details["count"] == 4 and len(finding.details["reentrant_checkpointing"]) == 2


def test_lora_006_clean_with_reentrant_checkpointing_and_input_require_grads() -> None:
    model, step = _checkpointed_llama_cls_ids(input_grads=True)
    report = run_audit(model, step, optimizer=trainable_optimizer(model))
    assert not report.by_id("LORA-006")
    assert report.ok, str(report)  # reentrant checkpointing itself is no error (no false LOSS-006)


def test_lora_006_embedding_adapter_zero_factor_is_lora_embedding_a() -> None:
    model = lora(tiny_llama(), target_modules=["embed_tokens", "q_proj"])
    report = run_audit(model, lm_step(model, lm_batch()))
    assert not report.by_id("LORA-006")
    expected = report.by_id("LORA-004")[0].details["params"]
    assert any("lora_embedding_B" in p for p in expected) and any("lora_A" in p for p in expected)


# --- LORA-007 adapters merged or disabled ---------------------------------------------------------------------------


def test_lora_007_merged_adapter_left_from_evaluation() -> None:
    model = gpt2_lora(init_lora_weights=False)
    model.merge_adapter()
    assert lora_summary(model).by_id("LORA-007")
    report = run_audit(model, lm_step(model, lm_batch()))
    (finding,) = report.by_id("LORA-007")
    assert finding.severity is Severity.ERROR and "merged" in finding.details["reasons"]
    assert not report.by_id("LORA-006")  # the starved factors are explained by LORA-007 alone


def test_lora_007_step_runs_inside_disable_adapter() -> None:
    model = gpt2_lora()
    x = lm_batch()

    def step() -> object:
        with model.disable_adapter():  # e.g. copied from a reference-model forward
            return model(input_ids=x, labels=x)

    assert not lora_summary(model).by_id("LORA-007")  # statically everything looks fine
    (finding,) = run_audit(model, step).by_id("LORA-007")
    assert "during the step" in finding.message and finding.details["count"] == 2


def test_lora_007_clean_for_dpo_style_reference_forward() -> None:
    model = gpt2_lora()
    x = lm_batch()

    def step() -> torch.Tensor:
        with torch.no_grad(), model.disable_adapter():
            reference = model(input_ids=x).logits
        policy = model(input_ids=x).logits
        return (policy - reference).pow(2).mean() + model(input_ids=x, labels=x).loss

    report = run_audit(model, step)
    assert not report.by_id("LORA-007") and not report.by_id("LORA-006")


# --- LORA-008 frozen classification head ----------------------------------------------------------------------------


def test_lora_008_bert_classifier_frozen_without_task_type() -> None:
    model = lora(tiny_bert_cls(), target_modules=["query", "value"])  # task_type forgotten
    x, y = lm_batch(), torch.tensor([0, 2])
    report = run_audit(model, cls_step(model, x, y), optimizer=trainable_optimizer(model))
    (finding,) = report.by_id("LORA-008")
    assert finding.severity is Severity.ERROR and finding.details["modules"] == ["classifier"]


def test_lora_008_clean_with_seq_cls_task_type() -> None:
    model = lora(tiny_bert_cls(), task_type="SEQ_CLS", target_modules=["query", "value"])
    x, y = lm_batch(), torch.tensor([0, 2])
    report = run_audit(model, cls_step(model, x, y), optimizer=trainable_optimizer(model))
    assert not report.by_id("LORA-008")
    assert not lora_summary(model).by_id("LORA-008")


# --- LORA-009 partial block coverage --------------------------------------------------------------------------------


def test_lora_009_regex_matches_only_first_block() -> None:
    model = lora(tiny_llama(num_hidden_layers=3), target_modules=r".*layers\.0\.self_attn\.(q|v)_proj")
    (finding,) = lora_summary(model).by_id("LORA-009")
    assert finding.severity is Severity.WARN
    assert finding.details["covered"] == [0] and finding.details["missing"] == [1, 2]


def test_lora_009_clean_for_all_blocks_or_explicit_layers_to_transform() -> None:
    assert not lora_summary(lora(tiny_llama(num_hidden_layers=3), target_modules=["q_proj", "v_proj"])).by_id("LORA-009")
    deliberate = lora(tiny_llama(num_hidden_layers=3), target_modules=["q_proj"], layers_to_transform=[0])
    assert not lora_summary(deliberate).by_id("LORA-009")


# --- LORA-014 target_modules entries that match nothing -----------------------------------------------------------


def test_lora_014_names_the_target_entries_that_match_no_module() -> None:
    # "mlp.up" is a path no module has (the Llama MLP holds up_proj): peft skips it because q_proj matched
    model = lora(tiny_llama(num_hidden_layers=2), target_modules=["q_proj", "v_proj", "mlp.up"])
    (finding,) = lora_summary(model).by_id("LORA-014")
    assert finding.severity is Severity.WARN and finding.details["unmatched"] == ["mlp.up"]


def test_lora_014_clean_when_every_entry_names_modules() -> None:
    model = lora(tiny_llama(num_hidden_layers=2), target_modules=["q_proj", "v_proj", "mlp.up_proj"])
    assert not lora_summary(model).by_id("LORA-014")


# --- LORA-010 half-precision adapters -------------------------------------------------------------------------------


def test_lora_010_model_cast_to_bf16_after_wrapping() -> None:
    model = gpt2_lora().to(torch.bfloat16)
    report = run_audit(model, lm_step(model, lm_batch()))
    (finding,) = report.by_id("LORA-010")
    assert finding.severity is Severity.WARN and "bfloat16" in finding.message and finding.details["count"] == 4


def test_lora_010_clean_when_bf16_base_keeps_fp32_adapters() -> None:
    model = lora(tiny_gpt2().to(torch.bfloat16), **GPT2_TARGETS)  # peft autocasts adapters to fp32
    assert not lora_summary(model).by_id("LORA-010")


# --- LORA-011 scaling out of range ----------------------------------------------------------------------------------


@pytest.mark.parametrize("r, alpha, shrunk", [(16, 1, True), (4, 64, False)])
def test_lora_011_scaling_far_outside_range(r: int, alpha: int, shrunk: bool) -> None:
    (finding,) = lora_summary(gpt2_lora(r=r, lora_alpha=alpha)).by_id("LORA-011")
    assert finding.severity is Severity.WARN
    assert finding.details["scaling"] == pytest.approx(alpha / r)
    assert ("shrunk" in finding.message) is shrunk


def test_lora_011_clean_for_usual_scaling_and_rslora() -> None:
    assert not lora_summary(gpt2_lora(r=4, lora_alpha=8)).by_id("LORA-011")
    # rsLoRA scales by alpha/sqrt(r): 4/sqrt(16) = 1
    assert not lora_summary(gpt2_lora(r=16, lora_alpha=4, use_rslora=True)).by_id("LORA-011")


# --- LORA-012 tied weights untied by modules_to_save ----------------------------------------------------------------


def test_lora_012_lm_head_saved_while_tied_to_embedding() -> None:
    model = gpt2_lora(modules_to_save=["lm_head"])
    (finding,) = lora_summary(model).by_id("LORA-012")
    assert finding.severity is Severity.WARN
    assert any("lm_head" in m and "wte" in m for m in finding.details["modules"])


def test_lora_012_clean_with_ensure_weight_tying_or_untied_model() -> None:
    tied = lora(tiny_llama(tie_word_embeddings=True), target_modules=["q_proj"], modules_to_save=["embed_tokens"], ensure_weight_tying=True)
    assert not lora_summary(tied).by_id("LORA-012")
    split = lora(tiny_llama(tie_word_embeddings=True), target_modules=["q_proj"], modules_to_save=["embed_tokens"])
    assert lora_summary(split).by_id("LORA-012")
    untied = lora(tiny_llama(tie_word_embeddings=False), target_modules=["q_proj"], modules_to_save=["lm_head"])
    assert not lora_summary(untied).by_id("LORA-012")


# --- is_peft_model, lora_summary, catalog ---------------------------------------------------------------------------


class HandRolledLora(nn.Module):
    """A LoRA layer written by hand with peft's parameter naming."""

    def __init__(self) -> None:
        super().__init__()
        self.base = nn.Linear(4, 4)
        self.lora_A = nn.Linear(4, 2, bias=False)
        self.lora_B = nn.Linear(2, 4, bias=False)


def test_is_peft_model_detects_peft_and_hand_rolled_lora_only() -> None:
    assert is_peft_model(gpt2_lora())
    assert is_peft_model(HandRolledLora())
    assert not is_peft_model(tiny_gpt2())
    assert not is_peft_model(nn.Linear(2, 2))
    assert not is_peft_model("not a model")  # type: ignore[arg-type]


@pytest.mark.slow
def test_is_peft_model_never_imports_peft() -> None:
    code = (
        "import sys, torch; from guardtower.preflight.lora import is_peft_model, lora_summary;"
        "m = torch.nn.Sequential(torch.nn.Linear(2, 2));"
        "print(is_peft_model(m), lora_summary(m).ok, 'peft' in sys.modules, 'transformers' in sys.modules)"
    )
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True, timeout=120)
    assert out.stdout.split() == ["False", "True", "False", "False"]


def test_lora_summary_runs_no_forward_pass() -> None:
    model = gpt2_lora()
    calls: list[int] = []
    model.register_forward_pre_hook(lambda *_: calls.append(1))
    report = lora_summary(model, optimizer=trainable_optimizer(model))
    assert calls == [] and report.ok
    assert {"lora_base_frozen", "lora_adapter", "lora_optimizer", "lora_dtype"} <= set(report.checks_run)
    assert "lora_gradient_flow" not in report.checks_run


@pytest.mark.parametrize("kwargs, argument", [({"model": "gpt2"}, "model"), ({"optimizer": [1]}, "optimizer")])
def test_lora_summary_rejects_bad_arguments(kwargs: dict, argument: str) -> None:
    model = kwargs.pop("model", nn.Linear(2, 2))
    with pytest.raises(ConfigError) as err:
        lora_summary(model, **kwargs)
    assert err.value.argument == argument


def test_lora_catalog_entries_are_complete() -> None:
    lora_ids = sorted(i for i in CATALOG if i.startswith("LORA-"))
    assert lora_ids == [f"LORA-{n:03d}" for n in range(1, 15)]
    for entry_id in lora_ids:
        entry = CATALOG[entry_id]
        assert entry.title and entry.summary and entry.why and entry.fix and "lora" in entry.tags
        assert entry.reference.startswith("https://")
    assert CATALOG["LORA-004"].severity is Severity.INFO
    assert CATALOG["LORA-006"].severity is Severity.ERROR


def test_lora_005_silent_on_a_toy_model_where_any_rank_is_a_large_share() -> None:
    from guardtower.preflight.lora import MIN_PARAMS_FOR_SHARE

    toy = lora(nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3)), target_modules=["0"], r=2)
    assert sum(p.numel() for p in toy.parameters()) < MIN_PARAMS_FOR_SHARE
    assert not lora_summary(toy).by_id("LORA-005")


# --- hand-rolled LoRA: loralib layers and peft-named modules without peft -------------------------------------------


class SeedStyleLoraLinear(nn.Module):
    """The original guardtower's stand-in: peft's naming (base_layer, lora_A/lora_B dicts), no peft config, no r."""

    def __init__(self, d: int = 8, r: int = 2) -> None:
        super().__init__()
        self.base_layer = nn.Linear(d, d)
        self.lora_A = nn.ModuleDict({"default": nn.Linear(d, r, bias=False)})
        self.lora_B = nn.ModuleDict({"default": nn.Linear(r, d, bias=False)})
        self.base_layer.requires_grad_(False)
        nn.init.zeros_(self.lora_B["default"].weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base_layer(x) + self.lora_B["default"](self.lora_A["default"](x))


def seed_style_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(SeedStyleLoraLinear(), nn.ReLU(), nn.Linear(8, 3))


def loralib_step(model: nn.Module) -> tuple[object, torch.optim.Optimizer]:
    batch = lm_batch(seed=3, batch=4)
    return cls_step(model, batch, torch.tensor([0, 1, 1, 0])), trainable_optimizer(model)


def test_loralib_model_is_understood_and_a_correct_setup_is_quiet() -> None:
    model = loralib_llama_cls()
    assert is_peft_model(model)
    step, opt = loralib_step(model)
    report = run_audit(model, step, optimizer=opt)
    assert report.ok and not report.warnings, str(report)
    (summary,) = report.by_id("LORA-013")
    assert summary.severity is Severity.INFO and summary.details["count"] == 8  # A and B, q and v, 2 blocks
    assert summary.details["numel"] == 2 * 2 * 4 * (32 + 32)
    (expected,) = report.by_id("LORA-004")  # lora_B starts at zero, so lora_A's first gradient is zero
    assert all(p.endswith("lora_A") for p in expected.details["params"])


def test_lora_001_loralib_without_mark_only_lora_as_trainable() -> None:
    model = loralib_llama_cls(mark_only_lora=False)  # loralib froze q/v weights; everything else still trains
    (finding,) = lora_summary(model).by_id("LORA-001")
    params = finding.details["params"]
    assert finding.severity is Severity.ERROR and "BASE model is not fully frozen" in finding.message
    assert any("k_proj.weight" in p for p in params) and any("mlp" in p for p in params)
    assert not any("lora_" in p or "norm" in p or "embed" in p or p.startswith("score") for p in params)


def test_lora_001_seed_style_layer_with_its_base_unfrozen() -> None:
    model = seed_style_model()
    model.requires_grad_(True)
    (finding,) = lora_summary(model).by_id("LORA-001")
    assert finding.details["params"] == ["0.base_layer.weight"]  # the head and the biases are fair to train


def test_lora_001_clean_hand_rolled_with_head_biases_and_norms_trainable() -> None:
    assert not lora_summary(seed_style_model()).by_id("LORA-001")  # a trainable head next to the adapter
    model = loralib_llama_cls()
    for name, p in model.named_parameters():  # LongLoRA-style: norms and embeddings train with the adapters
        if "norm" in name or "embed" in name:
            p.requires_grad_(True)
    report = lora_summary(model)
    assert not report.by_id("LORA-001") and report.ok, str(report)


class HandRolledDoRA(nn.Module):
    """A DoRA layer as repositories write it: a frozen weight, a trained magnitude vector ``m`` and two factors."""

    def __init__(self, d: int = 8, r: int = 2, a_random: bool = True) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d, d) / d**0.5, requires_grad=False)
        self.m = nn.Parameter(self.weight.norm(p=2, dim=0, keepdim=True))
        self.lora_A = nn.Parameter(torch.randn(d, r) / r**0.5 if a_random else torch.zeros(d, r))
        self.lora_B = nn.Parameter(torch.zeros(r, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        adapted = self.weight + self.lora_A @ self.lora_B
        return F.linear(x, self.m * adapted / adapted.norm(p=2, dim=0, keepdim=True))


def _dora_audit(a_random: bool) -> Report:
    torch.manual_seed(0)
    model = nn.Sequential(HandRolledDoRA(a_random=a_random), nn.ReLU(), nn.Linear(8, 3))
    x, y = torch.randn(6, 8), torch.tensor([0, 1, 2, 0, 1, 2])
    return run_audit(model, lambda: F.cross_entropy(model(x), y), optimizer=trainable_optimizer(model))


def test_a_hand_rolled_dora_magnitude_vector_is_not_base_left_unfrozen() -> None:
    report = _dora_audit(a_random=True)
    assert not report.by_id("LORA-001") and not report.by_id("LORA-006"), str(report)


def test_lora_006_both_factors_zero_initialised_neither_ever_gets_a_gradient() -> None:
    (finding,) = _dora_audit(a_random=False).by_id("LORA-006")
    assert finding.severity is Severity.ERROR and finding.details["both_zero"] == ["0"]
    assert finding.details["params"] == ["0.lora_A", "0.lora_B"]


def test_lora_002_hand_rolled_adapters_all_frozen() -> None:
    for model in (seed_style_model(), loralib_llama_cls()):
        model.requires_grad_(False)
        report = lora_summary(model)
        (finding,) = report.by_id("LORA-002")
        assert "ALL frozen" in finding.message and not report.ok
        assert not report.by_id("LORA-013")  # nothing trainable to summarise


def test_lora_002_clean_hand_rolled_adapters_trainable() -> None:
    for model in (seed_style_model(), loralib_llama_cls()):
        report = lora_summary(model)
        assert not report.by_id("LORA-002") and report.by_id("LORA-013"), str(report)


def test_lora_013_only_for_models_with_trainable_adapters() -> None:
    assert not lora_summary(tiny_llama_cls()).by_id("LORA-013")
    (summary,) = lora_summary(gpt2_lora()).by_id("LORA-013")
    assert summary.details["count"] == 4 and "trainable adapter" in summary.message  # c_attn in 2 blocks


def test_lora_009_silent_for_hand_rolled_lora_on_some_blocks() -> None:
    model = loralib_llama_cls(layers=[0])  # a choice, not a target_modules pattern gone wrong
    report = lora_summary(model)
    assert not report.by_id("LORA-009") and report.ok, str(report)


def loralib_gpt2(mark_only_lora: bool) -> nn.Module:
    """loralib's own GPT-2 recipe: c_attn as a MergedLinear adapting q and v only, biases of LoRA layers trained."""
    import loralib

    model = tiny_gpt2()
    for block in model.transformer.h:
        old = block.attn.c_attn
        new = loralib.MergedLinear(32, 96, r=4, lora_alpha=8, enable_lora=[True, False, True], fan_in_fan_out=True)
        new.weight.data.copy_(old.weight.data)
        new.bias.data.copy_(old.bias.data)
        block.attn.c_attn = new
    if mark_only_lora:
        loralib.mark_only_lora_as_trainable(model, bias="lora_only")
    return model


def test_loralib_merged_linear_gpt2_quiet_when_marked_caught_when_not() -> None:
    model = loralib_gpt2(mark_only_lora=True)
    batch = lm_batch()
    report = run_audit(model, lm_step(model, batch), optimizer=trainable_optimizer(model))
    assert report.ok and not report.warnings, str(report)
    model = loralib_gpt2(mark_only_lora=False)
    report = run_audit(model, lm_step(model, batch), optimizer=trainable_optimizer(model))
    (finding,) = report.by_id("LORA-001")
    assert any("c_proj.weight" in p for p in finding.details["params"])
    assert not any("c_attn" in p or "wte" in p or "ln_" in p for p in finding.details["params"])
