"""The catalog of silent training bugs: what each is, why it is silent, how to fix it, where to read more.

Ids are public (users have them in scripts and dashboards): an id never changes meaning. Every entry is
emitted by some audit check. ``CATALOG.md`` is generated from this module (``catalog_markdown()``).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Mapping

from guardtower.severity import Severity

__all__ = ["FailureMode", "CATALOG", "catalog", "catalog_markdown"]


@dataclass(frozen=True)
class FailureMode:
    """One catalog entry."""

    id: str
    title: str
    severity: Severity
    summary: str
    why: str
    fix: str
    reference: str
    tags: tuple[str, ...] = ()


# --- core wiring, loss, inputs, optimizer, mode, numerics, mixed precision (LOSS-, INPUT-, GRAD-, OPT-,
# NAN-, RELU-, TIE-, MODE-, AMP-, DATA-, ...) ---------------------------------------------------------------
_CORE: tuple[FailureMode, ...] = ()

_PEFT_TROUBLESHOOTING = "https://huggingface.co/docs/peft/developer_guides/troubleshooting"
_PEFT_LORA = "https://huggingface.co/docs/peft/developer_guides/lora"
_DDP_DOCS = "https://pytorch.org/docs/stable/generated/torch.nn.parallel.DistributedDataParallel.html"

# --- LoRA / PEFT (LORA-) --------------------------------------------------------------------------------------
_LORA: tuple[FailureMode, ...] = (
    FailureMode(
        id="LORA-001",
        title="Base model weights are not frozen",
        severity=Severity.ERROR,
        summary="Base-model parameters still have requires_grad=True next to the LoRA adapters, so the run is a "
        "full fine-tune wearing a LoRA label.",
        why="Training works and the loss falls, only with far more memory and optimizer state; and "
        "save_pretrained() stores just the adapter, so every base-weight update is thrown away at save time.",
        fix="Build the model with get_peft_model() after any manual requires_grad changes, and do not call "
        "model.train()/requires_grad_(True) on the whole model afterwards; list extra trainable modules in "
        "modules_to_save instead.",
        reference=_PEFT_LORA,
        tags=("lora", "peft", "freezing"),
    ),
    FailureMode(
        id="LORA-002",
        title="LoRA adapter is frozen",
        severity=Severity.ERROR,
        summary="The active adapter's lora_A / lora_B factors have requires_grad=False, so nothing trains.",
        why="The forward pass and the loss look normal; the usual cause is PeftModel.from_pretrained() without "
        "is_trainable=True (inference_mode) or a blanket model.requires_grad_(False) after wrapping.",
        fix="Load adapters to continue training with PeftModel.from_pretrained(base, path, is_trainable=True), or "
        "freeze the base before get_peft_model() rather than after.",
        reference="https://huggingface.co/docs/peft/package_reference/peft_model",
        tags=("lora", "peft", "freezing"),
    ),
    FailureMode(
        id="LORA-003",
        title="LoRA adapter missing from the optimizer",
        severity=Severity.ERROR,
        summary="Trainable LoRA factors are not in any optimizer param group, so optimizer.step() never moves them.",
        why="Gradients are computed and the loss is reported, but the weights never change; the classic cause "
        "is building the optimizer before get_peft_model() created the adapter parameters.",
        fix="Create the optimizer after get_peft_model(), from model.parameters() filtered on requires_grad.",
        reference="https://pytorch.org/docs/stable/optim.html",
        tags=("lora", "peft", "optimizer"),
    ),
    FailureMode(
        id="LORA-004",
        title="Random LoRA factor has a zero gradient at step 1 (expected)",
        severity=Severity.INFO,
        summary="lora_A gets an all-zero gradient on the first step because lora_B is initialised to zero; "
        "this is by design, not a bug.",
        why="Generic gradient checks would flag it as a dead parameter; it receives gradient as soon as lora_B "
        "has moved after the first update.",
        fix="Nothing to fix; reported so that other zero-gradient findings are not confused with it.",
        reference="https://arxiv.org/abs/2106.09685",
        tags=("lora", "peft", "gradients"),
    ),
    FailureMode(
        id="LORA-005",
        title="Trainable share too high for LoRA",
        severity=Severity.WARN,
        summary="Adapters plus modules_to_save make up more than 10% of the model's parameters.",
        why="Nothing fails; memory, optimizer state and checkpoint size approach a full fine-tune, typically "
        "from a very large rank or from saving whole embeddings / lm_head with modules_to_save.",
        fix="Lower r, target fewer modules, or prefer trainable_token_indices over saving whole embeddings.",
        reference=_PEFT_LORA,
        tags=("lora", "peft", "efficiency"),
    ),
    FailureMode(
        id="LORA-006",
        title="Zero-initialised LoRA factor gets no gradient",
        severity=Severity.ERROR,
        summary="lora_B (lora_embedding_A for embeddings) got no gradient although its layer ran, so the adapter "
        "stays exactly zero for the whole run.",
        why="The loss still falls through the parts that do train (a classification head, other layers); the usual "
        "cause is reentrant gradient checkpointing whose input does not require grad (inputs_embeds computed "
        "outside the model, custom checkpointing), which silently drops the gradient of everything inside.",
        fix="Call model.enable_input_require_grads() or checkpoint with use_reentrant=False "
        "(gradient_checkpointing_kwargs={'use_reentrant': False}).",
        reference="https://pytorch.org/docs/stable/checkpoint.html",
        tags=("lora", "peft", "gradients", "checkpointing"),
    ),
    FailureMode(
        id="LORA-007",
        title="LoRA adapter merged or disabled during training",
        severity=Severity.ERROR,
        summary="LoRA layers ran with their adapter merged into the base weight or disabled, so the forward uses "
        "only base weights and the adapter gets no gradient.",
        why="Left-overs of an evaluation (merge_adapter(), a disable_adapter() block around the whole step, "
        "disable_adapter_layers()) produce a perfectly normal-looking loss from the base model.",
        fix="Call unmerge_adapter() / enable_adapter_layers() before training and keep disable_adapter() to the "
        "reference forward only (as in DPO).",
        reference="https://huggingface.co/docs/peft/package_reference/lora",
        tags=("lora", "peft"),
    ),
    FailureMode(
        id="LORA-008",
        title="New classification head is frozen",
        severity=Severity.ERROR,
        summary="A sequence/token classification or QA model's freshly initialised head (score, classifier) is "
        "not trainable, so predictions come from a random projection forever.",
        why="get_peft_model() only keeps the head trainable when task_type is set (SEQ_CLS, TOKEN_CLS, ...) or the "
        "head is listed in modules_to_save; otherwise the loss only decreases a little through the adapters.",
        fix="Pass task_type='SEQ_CLS' (or TOKEN_CLS / QUESTION_ANS) to LoraConfig, or add the head to "
        "modules_to_save.",
        reference=_PEFT_TROUBLESHOOTING,
        tags=("lora", "peft", "freezing"),
    ),
    FailureMode(
        id="LORA-009",
        title="LoRA adapts only some transformer blocks",
        severity=Severity.WARN,
        summary="target_modules matched the layers of some blocks but not of others in the same stack.",
        why="peft accepts any pattern that matches at least one module; a too-specific regex or a list of full "
        "module names copied from one block leaves the other blocks untouched without any warning.",
        fix="Use short module names (['q_proj', 'v_proj']) or fix the regex; use layers_to_transform when only "
        "some blocks are meant to be adapted.",
        reference="https://huggingface.co/docs/peft/package_reference/lora",
        tags=("lora", "peft", "target_modules"),
    ),
    FailureMode(
        id="LORA-010",
        title="Trainable LoRA weights stored in half precision",
        severity=Severity.WARN,
        summary="Trainable adapter factors are float16/bfloat16, so optimizer updates smaller than the dtype's "
        "resolution round away.",
        why="Training runs and the loss moves a little at first, then stalls; it happens after model.half() / "
        ".to(torch.bfloat16) on the PEFT model or with autocast_adapter_dtype=False.",
        fix="Keep adapters in float32 (peft's default autocast_adapter_dtype=True, or "
        "peft.cast_mixed_precision_params) and run the forward under torch.autocast.",
        reference=_PEFT_TROUBLESHOOTING,
        tags=("lora", "peft", "dtype", "mixed-precision"),
    ),
    FailureMode(
        id="LORA-011",
        title="LoRA scaling alpha/r far outside the usual range",
        severity=Severity.WARN,
        summary="The adapter's output is multiplied by alpha/r (alpha/sqrt(r) with rsLoRA); below 0.1 or above 8 "
        "the update is shrunk or amplified by an order of magnitude.",
        why="The learning rate looks normal but is effectively divided or multiplied by the scaling; a large r with "
        "peft's default lora_alpha=8 makes the adapter learn almost nothing.",
        fix="Set lora_alpha relative to r (alpha = r or 2r are common), or use use_rslora=True for large ranks.",
        reference="https://arxiv.org/abs/2312.03732",
        tags=("lora", "peft", "hyperparameters"),
    ),
    FailureMode(
        id="LORA-012",
        title="modules_to_save unties tied embeddings",
        severity=Severity.WARN,
        summary="Only one side of a tied input-embedding / lm_head pair is in modules_to_save, so its trainable copy "
        "drifts away from its frozen partner.",
        why="Training sees a trainable lm_head (or embedding) and the loss falls, but the tie the model relies on "
        "is broken and the saved adapter no longer matches the model it is loaded into.",
        fix="Set ensure_weight_tying=True in LoraConfig, or list both tied modules in modules_to_save.",
        reference="https://github.com/huggingface/peft/issues/2777",
        tags=("lora", "peft", "weight-tying"),
    ),
)

# --- distributed (DDP-) ---------------------------------------------------------------------------------------
_DIST: tuple[FailureMode, ...] = (
    FailureMode(
        id="DDP-001",
        title="Unused parameter will hang DDP",
        severity=Severity.ERROR,
        summary="A trainable parameter got no gradient under DistributedDataParallel(find_unused_parameters=False).",
        why="The first step completes; DDP's reducer keeps waiting for the missing gradient, so the next iteration "
        "raises 'Expected to have finished reduction', or hangs when only some ranks skip the parameter.",
        fix="Freeze parameters the model does not use, or pass find_unused_parameters=True (or static_graph=True).",
        reference=_DDP_DOCS,
        tags=("ddp", "distributed", "gradients"),
    ),
    FailureMode(
        id="DDP-002",
        title="BatchNorm not synchronised across ranks",
        severity=Severity.WARN,
        summary="A data-parallel model trains plain BatchNorm layers, which normalise with each rank's own small "
        "batch statistics.",
        why="Everything runs; with small per-GPU batches the statistics are noisy and running stats differ per "
        "rank, which costs accuracy without any error.",
        fix="model = nn.SyncBatchNorm.convert_sync_batchnorm(model) before wrapping in DDP.",
        reference="https://pytorch.org/docs/stable/generated/torch.nn.SyncBatchNorm.html",
        tags=("ddp", "distributed", "batchnorm"),
    ),
    FailureMode(
        id="DDP-003",
        title="Process group initialised but model not wrapped",
        severity=Severity.WARN,
        summary="torch.distributed runs with several ranks but the model is not wrapped in DDP or FSDP.",
        why="Each rank trains happily on its own shard of data; gradients are never averaged, so the ranks drift "
        "into different models and only rank 0's is saved.",
        fix="Wrap the model: DistributedDataParallel(model, device_ids=[local_rank]) or fully_shard(model) "
        "(audit the wrapped model).",
        reference="https://pytorch.org/tutorials/intermediate/ddp_tutorial.html",
        tags=("ddp", "distributed"),
    ),
    FailureMode(
        id="DDP-004",
        title="Forward bypasses the DDP wrapper",
        severity=Severity.ERROR,
        summary="The step called ddp_model.module(...) instead of ddp_model(...), so DDP never arms its gradient "
        "hooks and gradients are not all-reduced.",
        why="Each rank computes a correct local loss and steps on its own gradients; the ranks silently diverge.",
        fix="Call the wrapper (ddp_model(inputs)); use ddp_model.module only for saving and inspection.",
        reference="https://pytorch.org/docs/stable/notes/ddp.html",
        tags=("ddp", "distributed"),
    ),
    FailureMode(
        id="DDP-005",
        title="Ranks hold different weights",
        severity=Severity.ERROR,
        summary="Per-parameter checksums differ between ranks at the start of the step.",
        why="DDP broadcasts rank 0's weights only when it is constructed; a checkpoint loaded on one rank after "
        "wrapping, or an unwrapped model with per-rank seeds, leaves ranks on different weights while the "
        "averaged gradients keep everything looking normal.",
        fix="Load checkpoints on every rank (or before wrapping in DDP) and seed the model init identically.",
        reference="https://pytorch.org/docs/stable/notes/ddp.html",
        tags=("ddp", "distributed"),
    ),
    FailureMode(
        id="DDP-006",
        title="Every rank receives the same batch",
        severity=Severity.WARN,
        summary="The first forward's inputs are identical on all ranks.",
        why="Training converges exactly like a single-GPU run, so nothing looks wrong; the other ranks compute the "
        "same gradients and add no data, typically because the DataLoader has no DistributedSampler.",
        fix="Use DistributedSampler(dataset) (and sampler.set_epoch(epoch)), or shard the data stream by rank.",
        reference="https://pytorch.org/docs/stable/data.html#torch.utils.data.distributed.DistributedSampler",
        tags=("ddp", "distributed", "data"),
    ),
)


CATALOG: Mapping[str, FailureMode] = MappingProxyType({m.id: m for m in (*_CORE, *_LORA, *_DIST)})


def catalog() -> list[FailureMode]:
    """Every entry, sorted by id."""
    return sorted(CATALOG.values(), key=lambda m: m.id)


def catalog_markdown() -> str:
    """The text of ``CATALOG.md``."""
    lines = [
        "# guardtower catalog of silent training bugs",
        "",
        "Generated from `guardtower/catalog.py` by `guardtower catalog`; do not edit by hand.",
        "",
        "| id | severity | title |",
        "| --- | --- | --- |",
    ]
    entries = catalog()
    lines += [f"| [{m.id}](#{m.id.lower()}) | {m.severity.label} | {m.title} |" for m in entries]
    for m in entries:
        lines += [
            "",
            f"## {m.id}",
            "",
            f"**{m.title}** ({m.severity.label}; tags: {', '.join(m.tags) or '-'})",
            "",
            m.summary,
            "",
            f"- **Why it is silent:** {m.why}",
            f"- **Fix:** {m.fix}",
            f"- **Reference:** {m.reference}",
        ]
    return "\n".join(lines) + "\n"
