"""The LoRA bug that trains nothing: the optimizer was built before get_peft_model().

The loss is computed, backward runs and lora_A/lora_B get gradients, but the optimizer only holds the (now
frozen) base weights, so optimizer.step() never moves the adapter. guardtower's pre-flight audit catches it
in one instrumented step (LORA-003, plus OPT-003 "stale optimizer"), while reporting lora_A's zero gradient
at step 1 as expected (LORA-004, INFO). Building the optimizer after get_peft_model() passes.

Runs on CPU in a few seconds with a tiny GPT-2 built from a config (no download):

    python examples/lora_optimizer_bug.py

Exits non-zero when the audit does not behave as described above.
"""

from __future__ import annotations

import os
import sys
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")
warnings.filterwarnings("ignore")

import torch  # noqa: E402
from peft import LoraConfig, get_peft_model  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

import guardtower  # noqa: E402


def tiny_gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=64, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config)


def lora_config() -> LoraConfig:
    return LoraConfig(r=8, lora_alpha=16, target_modules=["c_attn"], fan_in_fan_out=True, lora_dropout=0.0)


def main() -> int:
    hf_logging.set_verbosity_error()
    batch = torch.randint(0, 100, (4, 16), generator=torch.Generator().manual_seed(0))
    failures: list[str] = []

    # --- the bug: optimizer first, adapter second ---------------------------------------------------------------
    base = tiny_gpt2()
    optimizer = torch.optim.AdamW(base.parameters(), lr=1e-3)  # holds the base weights only
    model = get_peft_model(base, lora_config())
    report = guardtower.audit(model, lambda: model(input_ids=batch, labels=batch), optimizer=optimizer)
    print(report)
    found = {f.catalog_id for f in report.findings}
    if report.ok:
        failures.append("the buggy setup passed the audit")
    for expected in ("LORA-003", "OPT-003", "LORA-004"):
        if expected not in found:
            failures.append(f"{expected} not reported for the buggy setup")
    if any(f.severity is not guardtower.Severity.INFO for f in report.by_id("LORA-004")):
        failures.append("LORA-004 (lora_A's zero gradient at step 1) should be INFO")

    # --- the fix: wrap first, then build the optimizer from the trainable parameters ------------------------------
    model = get_peft_model(tiny_gpt2(), lora_config())
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    report = guardtower.audit(model, lambda: model(input_ids=batch, labels=batch), optimizer=optimizer)
    print(report)
    if not report.ok:
        failures.append(f"the fixed setup failed: {sorted({f.catalog_id for f in report.errors})}")
    if report.by_id("LORA-003"):
        failures.append("LORA-003 reported although the optimizer holds the adapter")

    print("static view of the fixed model:", guardtower.lora_summary(model, optimizer=optimizer).title)
    for failure in failures:
        print("EXPECTATION FAILED:", failure, file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
