"""The catalog of silent training bugs: what each is, why it is silent, how to fix it, where to read more.

Ids are public (users have them in scripts and dashboards): an id never changes meaning. Every entry is
emitted by some audit check. ``CATALOG.md`` is generated from this module (``catalog_markdown()``).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Mapping

from guardtower.severity import Severity

__all__ = ["FailureMode", "CATALOG", "FAMILIES", "catalog", "catalog_markdown"]


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
_CORE: tuple[FailureMode, ...] = (
    FailureMode(
        "AUDIT-001", "An audit check crashed", Severity.ERROR,
        "A check raised (or emitted something that is not a catalogued finding) while judging this model, so its "
        "verdict is unknown. The training state was still restored.",
        "The audit keeps going so one broken check cannot hide the others; the failure shows up only as this finding.",
        "Read the exception in the finding's details; it usually names an unusual model or optimizer layout. Run "
        "the audit with checks= excluding that check meanwhile, and report the case.",
        "https://docs.python.org/3/library/traceback.html",
        ("audit",),
    ),
    FailureMode(
        "LOSS-001", "Loss is detached from the graph", Severity.ERROR,
        "The loss tensor does not require grad, or is a new leaf made to require it, so backward() cannot reach "
        "any parameter.",
        "Calling .item()/.detach(), rebuilding the loss with torch.tensor(...), or computing it under "
        "torch.no_grad() gives a perfectly printable number; loss curves look normal while weights never change. "
        "Rebuilding it with requires_grad=True silences the backward() error and still trains nothing.",
        "Return the loss tensor produced by the model/criterion itself; keep .item() for logging only.",
        "https://pytorch.org/docs/stable/notes/autograd.html",
        ("loss", "wiring"),
    ),
    FailureMode(
        "LOSS-002", "Loss is not a scalar", Severity.ERROR,
        "The loss has more than one element (typically reduction='none' left un-reduced).",
        "Some training code sums or averages it somewhere else, or calls backward(gradient=ones), so nothing "
        "fails; the effective loss scale then depends on batch and sequence size.",
        "Reduce explicitly (mean over the supervised elements) before backward.",
        "https://pytorch.org/docs/stable/generated/torch.nn.CrossEntropyLoss.html",
        ("loss",),
    ),
    FailureMode(
        "LOSS-003", "Loss is NaN or Inf", Severity.ERROR,
        "The loss of the audited batch is not finite.",
        "A NaN loss still backpropagates and optimizers happily apply NaN updates; logs often average it away or "
        "print 'nan' far down the line after the weights are already destroyed.",
        "Find the first non-finite module (NAN-001), check log(0)/division by zero in custom losses, and batches "
        "with no supervised token (DATA-001).",
        "https://pytorch.org/docs/stable/autograd.html#anomaly-detection",
        ("loss", "numerics"),
    ),
    FailureMode(
        "LOSS-004", "Probabilities fed to a logits loss (double softmax/sigmoid)", Severity.ERROR,
        "cross_entropy / CrossEntropyLoss received rows in [0, 1] that sum to 1, or "
        "binary_cross_entropy_with_logits received values all in [0, 1]: the model already applied "
        "softmax/sigmoid.",
        "The loss still decreases a little and the model trains, only much worse: the double squashing caps "
        "the gradient and the achievable loss.",
        "Remove the final softmax/sigmoid from the model (apply it only at inference), or use NLLLoss on "
        "log_softmax / BCELoss on probabilities.",
        "https://pytorch.org/docs/stable/generated/torch.nn.CrossEntropyLoss.html",
        ("loss", "wiring"),
    ),
    FailureMode(
        "LOSS-005", "Regression target broadcasts against the prediction", Severity.ERROR,
        "mse_loss / l1_loss / smooth_l1_loss / huber_loss got input and target of different but broadcastable "
        "shapes, e.g. (N, 1) and (N,), so every prediction is compared with every target.",
        "PyTorch only emits a UserWarning that scrolls away; the loss is a valid number that converges to the "
        "target mean.",
        "Make the shapes identical: pred.squeeze(-1) or target.unsqueeze(-1).",
        "https://pytorch.org/docs/stable/generated/torch.nn.MSELoss.html",
        ("loss", "shapes"),
    ),
    FailureMode(
        "LOSS-006", "The training step raised", Severity.ERROR,
        "step_fn (or the backward pass) raised an exception on the audited batch.",
        "Without a pre-flight run this surfaces only after data loading, compilation and model download, often "
        "hours into a queued job.",
        "Fix the exception in the details (phase, type, message, location); common causes are shape mismatches, "
        "dtype/device mismatches and in-place ops on tensors autograd saved.",
        "https://pytorch.org/docs/stable/notes/autograd.html#in-place-operations-with-autograd",
        ("loss", "wiring"),
    ),
    FailureMode(
        "LOSS-007", "The step returned no loss tensor", Severity.ERROR,
        "step_fn returned something without a loss tensor: a Python number, None, or a Hugging Face output whose "
        ".loss is None. A step that ran backward itself and returned a number (return loss.item()) or nothing is "
        "INFO: its gradients are judged all the same.",
        "Hugging Face models compute a loss only when labels are passed; without them .loss is None and a "
        "custom loop may skip backward or log zeros.",
        "Pass labels= to the model (or compute the loss from the logits) and return the tensor.",
        "https://huggingface.co/docs/transformers/main_classes/output",
        ("loss", "wiring", "huggingface"),
    ),
    FailureMode(
        "LOSS-008", "NLLLoss fed logits or probabilities", Severity.ERROR,
        "nll_loss received values above 0; it expects log-probabilities, which are <= 0.",
        "nll_loss just picks -input[target]; on logits or probabilities it returns a finite number and the "
        "model optimises a meaningless objective.",
        "Apply log_softmax before NLLLoss, or use cross_entropy on the raw logits.",
        "https://pytorch.org/docs/stable/generated/torch.nn.NLLLoss.html",
        ("loss", "wiring"),
    ),
    FailureMode(
        "LOSS-009", "The loss does not fall when overfitting one batch", Severity.ERROR,
        "audit(steps=N) ran N real optimizer steps on the audited batch and its loss did not fall by at least 1%, lowered by at least 60% of the steps "
        "(or went non-finite).",
        "Any correctly wired model memorises a single batch; when it cannot, something upstream is broken: labels "
        "that do not match the inputs (shuffled separately, re-drawn every step), a loss that does not measure the "
        "model's output, parameters that never train, or a learning rate orders of magnitude too small. The "
        "one-step checks can all pass in those cases.",
        "Look at the recorded loss curve in the finding's details; check the label pipeline, the loss, the frozen "
        "parameters (OPT-006) and the learning rate. Karpathy's recipe: 'overfit one batch' before anything else.",
        "https://karpathy.github.io/2019/04/25/recipe/",
        ("loss", "training"),
    ),
    FailureMode(
        "INPUT-001", "Loss does not depend on the input", Severity.ERROR,
        "The gradient of the loss with respect to the model's input (or the embedding of its token ids) is zero "
        "or absent.",
        "The model still fits the label distribution (bias terms, a stored tensor), so the loss goes down and "
        "looks like learning.",
        "Look for .detach()/no_grad on the input path, an input that is overwritten or ignored in forward, or a "
        "cached tensor used instead of the batch.",
        "https://karpathy.github.io/2019/04/25/recipe/",
        ("wiring", "inputs"),
    ),
    FailureMode(
        "INPUT-002", "Samples leak across the batch", Severity.WARN,
        "The prediction for the first sample (and for the last, where the batch axis is unambiguous) has a "
        "non-zero gradient with respect to other samples' inputs; measured on the step's own graph, or on the "
        "audit's own eval-mode pass of the model when step_fn runs the backward itself.",
        "A view/reshape/transpose that mixes the batch dimension with time or features, or a sequence-first "
        "layer (an RNN or transformer built without batch_first=True) fed (batch, seq, ...) data, produces the "
        "right shapes and a decreasing loss; BatchNorm in train mode mixes samples too, by design (INFO).",
        "Use permute instead of view to reorder dimensions, keep the batch dimension first, build recurrent and "
        "attention layers with batch_first=True for batch-first data; if the leak is BatchNorm and samples must "
        "stay independent, use GroupNorm/LayerNorm.",
        "https://karpathy.github.io/2019/04/25/recipe/",
        ("wiring", "inputs", "shapes"),
    ),
    FailureMode(
        "INPUT-003", "Left padding shifts absolute positions", Severity.WARN,
        "Rows are left padded (their attention_mask starts with 0s) and the model's absolute position embedding "
        "gives their first real token another position than an unpadded row's, or an encoder classifier pools "
        "position 0 (CLS), which is padding in those rows.",
        "GPT-2/BERT-style learned positions number tokens from the start of the row unless position_ids say "
        "otherwise, so each padded row trains at positions shifted by its pad count (and generation sees other "
        "positions again); the loss still falls.",
        "Pass position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0), or pad on the right "
        "(tokenizer.padding_side = 'right') for training; encoders that pool position 0 need right padding.",
        "https://github.com/huggingface/trl/issues/469",
        ("inputs", "padding", "positions", "huggingface"),
    ),
    FailureMode(
        "INPUT-004", "Padding not covered by the attention mask", Severity.WARN,
        "Rows end (or start) with a run of config.pad_token_id that the attention_mask marks as real tokens, or "
        "rows hold padding runs (of the pad id, or of another id every row is padded with) and no attention_mask "
        "reaches the model.",
        "Attention then reads the padding as text: every padded row's representation depends on how much padding "
        "the batch needed, and nothing errors.",
        "Pass the tokenizer's attention_mask (or build it as input_ids != pad_token_id when pad and EOS differ); "
        "when pad_token_id == eos_token_id, build the mask from the lengths, not from the ids.",
        "https://huggingface.co/docs/transformers/troubleshooting#incorrect-output-when-padding-tokens-arent-masked",
        ("inputs", "padding", "huggingface"),
    ),
    FailureMode(
        "INPUT-005", "Batch pads with another id than config.pad_token_id", Severity.WARN,
        "The positions the attention_mask marks as padding all hold one id that is not config.pad_token_id, or "
        "config.pad_token_id is None while a last-token sequence classifier gets padded rows.",
        "Models find the padding by config.pad_token_id (decoder sequence classifiers pool the token before the "
        "first pad id, RoBERTa-style positions skip pad ids), so with another pad id they pool or number padding "
        "positions; the loss still falls.",
        "Set model.config.pad_token_id = tokenizer.pad_token_id (and resize the embeddings if the pad token is new).",
        "https://github.com/ymcui/Chinese-LLaMA-Alpaca-2/issues/160",
        ("inputs", "padding", "special-tokens", "huggingface"),
    ),
    FailureMode(
        "GRAD-001", "Trainable parameter gets no gradient", Severity.ERROR,
        "After backward, a parameter with requires_grad=True still has .grad None.",
        "Optimizers skip parameters without a gradient, so the layer silently stays at its initialisation; "
        "under DDP it can also hang the job (DDP-001).",
        "Use the layer in forward, remove it, or freeze it explicitly; look for detach()/no_grad and modules "
        "replaced after the optimizer was built. Reported as INFO when nothing was meant to train the parameter "
        "(an architecture's optional part that never ran, a layer skipped by design, or a copy such as a target "
        "network that no optimizer holds either).",
        "https://pytorch.org/docs/stable/notes/autograd.html",
        ("gradients", "wiring"),
    ),
    FailureMode(
        "GRAD-002", "Exploding gradient norm", Severity.WARN,
        "The global gradient norm exceeds 1e4, or a tensor's gradient norm exceeds 100x its weight norm.",
        "Adam normalises the update, so training continues, but the first steps wreck the initialisation and "
        "clipping (if any) silently rescales every step.",
        "Normalise inputs and regression targets, check the init scale, clip gradients, lower the learning rate.",
        "https://arxiv.org/abs/1211.5063",
        ("gradients", "numerics"),
    ),
    FailureMode(
        "GRAD-003", "Vanishing gradient norm", Severity.WARN,
        "The global gradient norm is below 1e-8, or a weight matrix's gradient norm is below 1e-8 of its norm.",
        "Nothing fails; the affected layers just do not learn while the rest of the network compensates.",
        "Use non-saturating activations, residual connections and normalisation; check the init and any loss "
        "scaling (a loss multiplied by a tiny factor).",
        "http://proceedings.mlr.press/v9/glorot10a.html",
        ("gradients", "numerics"),
    ),
    FailureMode(
        "GRAD-004", "Gradient is exactly zero", Severity.WARN,
        "A trainable parameter's gradient exists but every element is 0.",
        "The parameter is connected to the graph, so connectivity checks pass, but something upstream (dead "
        "ReLUs, clamps, zero-initialised layers, fully masked outputs) blocks every signal.",
        "Find what zeroes the signal: dead ReLUs (RELU-001), saturated clamps, or a zero-initialised layer "
        "between this one and the loss. When the audit has the optimizer it runs the step twice more: a gradient "
        "that flows once the weights have moved (a zero-initialised gate or projection after it, by design) is "
        "only INFO.",
        "https://cs231n.github.io/neural-networks-3/#gradcheck",
        ("gradients",),
    ),
    FailureMode(
        "GRAD-005", "Update-to-weight ratio far from ~1e-3", Severity.WARN,
        "One real optimizer step (measured, then undone) changes the weight matrices by a median fraction above "
        "1e-1 or below 1e-6 of their norm.",
        "Too large overwrites the initialisation or pretrained weights in a few steps; too small looks like a "
        "flat loss that is blamed on the data. Both train without any error.",
        "Tune the learning rate (and warmup) until the ratio is around 1e-3; check lr units and scheduler setup.",
        "https://cs231n.github.io/neural-networks-3/#ratio",
        ("optimizer", "gradients"),
    ),
    FailureMode(
        "GRAD-006", "Reentrant checkpoint cuts trainable weights off from the gradient", Severity.ERROR,
        "A torch.utils.checkpoint(..., use_reentrant=True) call wraps layers with trainable weights, but none of "
        "its tensor inputs requires grad, so its output has no gradient and those weights never train.",
        "The forward and the loss are unchanged and nothing raises; with LoRA on a frozen base (or inputs "
        "detached before the block) the adapters silently stay at their initial values.",
        "Pass use_reentrant=False (recommended), or make the block's input require grad "
        "(model.enable_input_require_grads() for Hugging Face models).",
        "https://pytorch.org/docs/stable/checkpoint.html",
        ("gradients", "checkpointing"),
    ),
    FailureMode(
        "GRAD-007", "Every position reads one row of the position table", Severity.WARN,
        "The gradient of a learned position table (a parameter named like pos_emb, positional_encodings, "
        "position_embeddings or wpe) reaches exactly one position, and not the first one.",
        "Indexing a row (pe[n]) where a slice was meant (pe[:n]), or position ids that are all equal, adds the "
        "same vector at every position: shapes broadcast, the loss falls on what the content alone gives, and the "
        "model never learns word or patch order.",
        "Slice the table's first n positions (pe[:n] or pe[:, :n]) or pass position ids 0..n-1.",
        "https://github.com/labmlai/annotated_deep_learning_paper_implementations/issues/133",
        ("gradients", "positions"),
    ),
    FailureMode(
        "OPT-001", "Trainable parameter missing from the optimizer", Severity.ERROR,
        "A parameter with requires_grad=True is in no optimizer param group.",
        "It receives gradients (so gradient checks pass) but is never updated.",
        "Build the optimizer from model.parameters() after the model is final (heads added, adapters "
        "attached), or add the missing parameters to a param group.",
        "https://pytorch.org/docs/stable/optim.html",
        ("optimizer", "wiring"),
    ),
    FailureMode(
        "OPT-002", "Frozen parameter in the optimizer", Severity.WARN,
        "A parameter with requires_grad=False sits in an optimizer param group.",
        "Optimizers skip tensors without a gradient, so nothing fails; it wastes optimizer memory and, if the "
        "tensor is unfrozen later, stale moments or weight decay apply to it.",
        "Pass only trainable parameters: [p for p in model.parameters() if p.requires_grad].",
        "https://pytorch.org/docs/stable/optim.html#per-parameter-options",
        ("optimizer", "freezing"),
    ),
    FailureMode(
        "OPT-003", "Optimizer is stale (built for other tensors)", Severity.ERROR,
        "The optimizer holds tensors that are not the model's parameters, or updates none of its trainable "
        "parameters: it was built before the model was wrapped, re-created, given a new head, passed through "
        "get_peft_model or materialised from the meta device. For a mixed-precision optimizer that steps float32 "
        "main copies of the model's 16-bit weights: those copies are not the model's values (a checkpoint loaded "
        "after the optimizer was built).",
        "optimizer.step() runs without error on the old tensors while the model that computes the loss never "
        "changes.",
        "Create the optimizer last, from the final model object.",
        "https://pytorch.org/docs/stable/optim.html",
        ("optimizer", "wiring", "lora"),
    ),
    FailureMode(
        "OPT-004", "Learning rate is zero", Severity.WARN,
        "A param group with trainable parameters has lr=0 and no scheduler that will raise it.",
        "Every step runs, loss is computed and logged, gradients flow; only the weights never change.",
        "Set the learning rate (check config parsing and units); a warmup scheduler should start from a "
        "non-zero initial_lr.",
        "https://pytorch.org/docs/stable/optim.html#how-to-adjust-learning-rate",
        ("optimizer",),
    ),
    FailureMode(
        "OPT-005", "Weight decay on biases and normalisation weights", Severity.INFO,
        "A param group with weight_decay > 0 contains 1-D tensors (biases, LayerNorm/BatchNorm weights).",
        "Decaying norm gains and biases toward zero slightly hurts training; it shows up as a small quality gap, "
        "never as an error.",
        "Put 1-D parameters in a param group with weight_decay=0 (as nanoGPT and HF Trainer do).",
        "https://arxiv.org/abs/1711.05101",
        ("optimizer",),
    ),
    FailureMode(
        "OPT-006", "Frozen parameters (info)", Severity.INFO,
        "Some parameters have requires_grad=False: the step will not train them.",
        "Freezing is usually deliberate (a frozen backbone, a LoRA base), but a layer frozen by a stale "
        "requires_grad_(False) or a name filter trains nothing and raises no error; the list says which.",
        "Check that the listed tensors are the ones you meant to freeze.",
        "https://pytorch.org/docs/stable/notes/autograd.html#locally-disabling-gradient-computation",
        ("optimizer", "frozen"),
    ),
    FailureMode(
        "OPT-007", "Weight decay on a tensor the no-decay group was meant to hold", Severity.WARN,
        "The optimizer has an explicit weight_decay=0 group next to decayed ones, yet a decayed group still holds "
        "1-D tensors (a name filter such as 'LayerNorm.weight' missed 'ln_f.weight', or T5's 'layer_norm.weight' "
        "and caught none of them).",
        "The user meant to exclude them, so nobody looks again; the norm gains are pulled toward zero every step "
        "and the result is a quiet quality gap.",
        "Build the groups by tensor shape or module type (p.ndim < 2, isinstance(m, nn.LayerNorm)) instead of "
        "by name, and check the listed tensors.",
        "https://github.com/karpathy/nanoGPT/blob/master/model.py",
        ("optimizer",),
    ),
    FailureMode(
        "LOOP-001", "Gradients cleared between backward() and step()", Severity.ERROR,
        "The step runs loss.backward(), then optimizer.zero_grad(), then optimizer.step(): every gradient is None "
        "(or zero) when the optimizer steps.",
        "Forward, loss and logging all look normal and nothing raises; the optimizer simply has nothing to apply, "
        "so the model \"does not optimize at all\".",
        "Order the step zero_grad() -> forward -> backward() -> step().",
        "https://discuss.pytorch.org/t/model-does-not-optimize-model-parameters-at-all/",
        ("loop", "optimizer"),
    ),
    FailureMode(
        "LOOP-002", "optimizer.step() before backward()", Severity.ERROR,
        "The step calls optimizer.step() before loss.backward(), so each update applies the previous batch's "
        "gradients (nothing at all on the first step).",
        "The model still trains, one batch late, and with zero_grad() in between it does not train at all; both "
        "look like a merely poor run.",
        "Call backward() first, then step().",
        "https://pytorch.org/tutorials/beginner/basics/optimization_tutorial.html",
        ("loop", "optimizer"),
    ),
    FailureMode(
        "LOOP-003", "Gradients never cleared", Severity.WARN,
        "The step runs backward() and optimizer.step() but never zero_grad(): gradients accumulate across steps.",
        "Each update is the sum of every gradient so far, so the effective learning rate keeps growing; training "
        "usually still moves, then diverges or plateaus.",
        "Call optimizer.zero_grad() (or model.zero_grad()) once per step; when accumulating on purpose, clear "
        "right after each optimizer step.",
        "https://pytorch.org/docs/stable/generated/torch.optim.Optimizer.zero_grad.html",
        ("loop", "optimizer"),
    ),
    FailureMode(
        "NAN-001", "NaN/Inf in the forward pass", Severity.ERROR,
        "A module's output holds NaN or +Inf (-Inf is ignored: attention masks use it); the finding names the "
        "first such module in execution order and whether its input was already non-finite.",
        "NaNs propagate silently through every later layer and into the loss; by the time the loss prints nan "
        "the origin is lost.",
        "Inspect the named module: overflow in fp16, log/sqrt/division of zero or negatives, or unnormalised "
        "inputs.",
        "https://pytorch.org/docs/stable/autograd.html#anomaly-detection",
        ("numerics",),
    ),
    FailureMode(
        "NAN-002", "NaN/Inf in gradients", Severity.ERROR,
        "After backward, some gradient tensors hold NaN or Inf.",
        "Optimizers apply the NaN update without complaint and every weight it touches becomes NaN.",
        "Look for operations with infinite derivatives (sqrt at 0, log near 0, norms of zero vectors), clip "
        "gradients, or guard the step with GuardedOptimizer.",
        "https://pytorch.org/docs/stable/autograd.html#anomaly-detection",
        ("numerics", "gradients"),
    ),
    FailureMode(
        "NAN-003", "NaN/Inf in parameters or buffers before training", Severity.ERROR,
        "Parameters or buffers already hold NaN/Inf before the first step.",
        "Uninitialised memory (torch.empty, to_empty after meta init) or a bad checkpoint can hold NaN that "
        "only surfaces when that entry is used.",
        "Initialise every tensor after to_empty(), load the complete checkpoint, and check it with "
        "torch.isfinite.",
        "https://pytorch.org/docs/stable/generated/torch.nn.Module.html#torch.nn.Module.to_empty",
        ("numerics", "initialisation"),
    ),
    FailureMode(
        "NAN-004", "One optimizer step turns the weights non-finite", Severity.ERROR,
        "The audit's trial optimizer step (undone afterwards) left NaN/Inf in weights that were finite and "
        "received finite gradients.",
        "Typical with fp16 weights under Adam/AdamW: eps=1e-8 underflows to 0 in fp16, so a zero gradient gives "
        "0/0 = NaN. The forward of this step was fine; the damage shows up one step later as a NaN loss.",
        "Keep trainable weights (LoRA adapters included) in fp32 and let autocast run the compute in fp16/bf16, "
        "or use an optimizer with fp32 master weights.",
        "https://pytorch.org/docs/stable/amp.html",
        ("numerics", "optimizer", "precision"),
    ),
    FailureMode(
        "RELU-001", "Dead ReLUs", Severity.WARN,
        "At least three quarters of a ReLU layer's units output zero for every sample in the batch (judged on at "
        "least 4 rows per unit; on samples that look alike half is the healthy ceiling); nn.ReLU-style modules and "
        "F.relu calls inside the model are both measured (a relu in the step's own loss is a hinge).",
        "Dead units pass no gradient, so they never recover; the network just behaves like a smaller one.",
        "Check bias init and input normalisation, lower the learning rate, or use LeakyReLU/GELU.",
        "https://cs231n.github.io/neural-networks-1/#actfun",
        ("activations",),
    ),
    FailureMode(
        "TIE-001", "Tied (shared) weights", Severity.INFO,
        "A parameter is registered under several names (e.g. lm_head.weight is the token embedding).",
        "Intended in most language models; listed so that freezing, optimizer groups, LoRA targets and "
        "checkpoint surgery treat the shared tensor consistently.",
        "Nothing to fix if intended; remember that freezing or re-initialising one name affects the other.",
        "https://arxiv.org/abs/1608.05859",
        ("weights", "huggingface"),
    ),
    FailureMode(
        "TIE-002", "Config promises tied embeddings, tensors are separate", Severity.WARN,
        "config.tie_word_embeddings is True but the input and output embedding weights are different tensors.",
        "Replacing or resizing the head after tying (or skipping tie_weights()) creates an untied copy; both "
        "train and the saved checkpoint no longer matches what the config says.",
        "Call model.tie_weights() after changing embeddings or the head, or set tie_word_embeddings=False "
        "deliberately.",
        "https://huggingface.co/docs/transformers/main_classes/model",
        ("weights", "huggingface"),
    ),
    FailureMode(
        "MODE-001", "Eval mode during the training step", Severity.WARN,
        "The model (or some dropout/BatchNorm submodules) is in eval mode while training.",
        "from_pretrained() returns an eval-mode model, and an evaluation loop's model.eval() outlives it; "
        "training still works, just without dropout and with frozen BatchNorm statistics.",
        "Call model.train() at the start of every training epoch; freeze BatchNorm on purpose only.",
        "https://pytorch.org/docs/stable/generated/torch.nn.Module.html#torch.nn.Module.train",
        ("modes",),
    ),
    FailureMode(
        "MODE-002", "Frozen part is stochastic in the step", Severity.WARN,
        "A frozen part of the model (a submodule subtree whose parameters all have requires_grad=False) drew random "
        "numbers during its forward in the training step: dropout (or another random layer) is on inside it. Not "
        "reported for a part another optimizer of the step trains, or a momentum copy whose weights the step "
        "updates itself (a mean teacher, a BYOL/MoCo target encoder), which follow the trained network's modes.",
        "Freezing with requires_grad=False does not switch dropout off, and model.train() switches it back on every "
        "epoch, so a frozen encoder or backbone hands the trainable head randomly perturbed features every step; "
        "the loss still falls.",
        "Call .eval() on the frozen part after every model.train() (or override train() to keep it in eval), or "
        "run it under torch.no_grad() in eval mode; leave it in train mode only if the noise is wanted.",
        "https://pytorch.org/docs/stable/notes/autograd.html#locally-disabling-gradient-computation",
        ("modes", "freezing", "randomness"),
    ),
    FailureMode(
        "MODE-003", "Frozen part's running statistics move", Severity.WARN,
        "The buffers of a frozen part (BatchNorm running mean/variance) changed during the training step. Not "
        "reported for a part another optimizer of the step trains, or a momentum copy whose weights the step "
        "updates itself.",
        "requires_grad=False freezes the weights but not the running statistics: BatchNorm in train mode keeps "
        "re-estimating them from each batch, so the frozen backbone's features drift and evaluation uses "
        "statistics of the new data, with no error.",
        "Call .eval() on the frozen part (or its BatchNorm layers) after every model.train(), or use "
        "FrozenBatchNorm2d (torchvision.ops) for frozen backbones.",
        "https://github.com/lightly-ai/lightly/issues/1438",
        ("modes", "freezing", "batchnorm"),
    ),
    FailureMode(
        "MODE-004", "Normalisation momentum keeps only the last batch", Severity.WARN,
        "A BatchNorm/InstanceNorm layer that tracks running statistics has momentum >= 0.5.",
        "PyTorch updates running = (1 - momentum) * running + momentum * batch, the opposite of Keras/TF, so "
        "momentum=0.9 or 0.99 copied from a Keras model makes the running statistics hold little more than the "
        "last batch; training looks normal and only evaluation is noisy and worse.",
        "Use PyTorch's convention: momentum = 1 - keras_momentum (0.01 for Keras 0.99; the default is 0.1), or "
        "momentum=None for a cumulative average.",
        "https://pytorch.org/docs/stable/generated/torch.nn.BatchNorm2d.html",
        ("modes", "batchnorm"),
    ),
    FailureMode(
        "ACT-001", "Saturated sigmoid/tanh", Severity.WARN,
        "At least half the outputs of a sigmoid/tanh layer are within 1% of the asymptotes.",
        "Saturated units have near-zero derivative, so earlier layers stop learning without any error.",
        "Scale the pre-activations down (init, input normalisation), add normalisation before the activation, "
        "or use a non-saturating activation.",
        "http://proceedings.mlr.press/v9/glorot10a.html",
        ("activations", "gradients"),
    ),
    FailureMode(
        "AMP-001", "float16 autocast without a GradScaler", Severity.ERROR,
        "The step ran under float16 autocast and no enabled GradScaler was passed.",
        "Small gradients underflow to zero in fp16; the run trains, only worse, with no error.",
        "Use torch.amp.GradScaler (scaler.scale(loss).backward(), scaler.step(opt), scaler.update()) and pass it "
        "to audit(scaler=...), or switch to bfloat16.",
        "https://pytorch.org/docs/stable/amp.html#gradient-scaling",
        ("mixed-precision",),
    ),
    FailureMode(
        "AMP-002", "Low-precision weights swallow the updates", Severity.ERROR,
        "Trainable fp16/bf16 parameters did not change in a real optimizer step although their gradient was "
        "non-zero: lr x update is below the dtype's resolution and rounds away.",
        "Without fp32 master weights the loss plateaus as if the learning rate were too low; nothing errors. A "
        "FAIL when the stuck tensors hold most of the low-precision weights; a WARN when only some are stuck "
        "(norm gains at 1.0 sit where one bf16 step is 0.0078).",
        "Keep fp32 weights and use autocast, or an optimizer with fp32 master copies / stochastic rounding.",
        "https://arxiv.org/abs/1710.03740",
        ("mixed-precision", "optimizer"),
    ),
    FailureMode(
        "AMP-003", "Activations close to the fp16 maximum", Severity.WARN,
        "With fp16 in use, module outputs reach more than 1/8 of 65504.",
        "They fit today; a little growth during training overflows to Inf, which then surfaces as NaN far "
        "from the cause.",
        "Normalise inputs, scale residual branches, or use bfloat16.",
        "https://pytorch.org/docs/stable/amp.html",
        ("mixed-precision", "numerics"),
    ),
    FailureMode(
        "DATA-001", "Batch without a supervised position", Severity.ERROR,
        "Every target is ignore_index (-100): nothing in the batch is supervised.",
        "cross_entropy returns NaN (0/0) or 0 depending on reduction; with truncation in completion-only "
        "fine-tuning it hits only some batches, so the run degrades intermittently.",
        "Check truncation (max_length vs. prompt length) and the label masking; drop empty examples.",
        "https://pytorch.org/docs/stable/generated/torch.nn.CrossEntropyLoss.html",
        ("data", "loss", "huggingface"),
    ),
    FailureMode(
        "DATA-002", "Padding positions carry labels", Severity.WARN,
        "Positions where attention_mask is 0 have labels other than -100.",
        "labels = input_ids.clone() with pad_token = eos trains the model to emit padding; the loss even looks "
        "better because padding is easy to predict.",
        "Set labels to -100 where attention_mask == 0 (DataCollatorForLanguageModeling does this).",
        "https://huggingface.co/docs/transformers/main_classes/data_collator",
        ("data", "huggingface"),
    ),
    FailureMode(
        "DATA-003", "Every end-of-sequence token is masked from the labels", Severity.WARN,
        "In a causal-LM batch every real EOS (attention_mask 1) has label -100 and no label is EOS, or (a loss "
        "computed outside the model) no position that predicts a real EOS gets loss gradient, typically because "
        "pad_token = eos_token and the collator or the loss mask drops padding by token id.",
        "Loss and perplexity look fine; the model simply never sees a target to stop on, so it generates until "
        "max_new_tokens.",
        "Give the tokenizer a distinct pad token (e.g. add '<pad>' or use unk), or build labels from the "
        "attention mask rather than from token ids.",
        "https://github.com/huggingface/transformers/issues/23530",
        ("data", "labels", "llm"),
    ),
    FailureMode(
        "DATA-004", "Causal-LM labels shifted twice", Severity.WARN,
        "labels[t] == input_ids[t+1] almost everywhere, and the model (a Hugging Face *ForCausalLM) shifts the "
        "labels again inside its loss, so each position is trained to predict the token after next.",
        "The loss still falls (next-next-token prediction is learnable), just to a worse value; generations "
        "come out garbled.",
        "Pass labels = input_ids (with -100 on padding / prompt) and let the model shift them.",
        "https://huggingface.co/docs/transformers/tasks/language_modeling",
        ("data", "labels", "llm"),
    ),
    FailureMode(
        "DEV-001", "Tensors on the meta device or on mixed devices", Severity.ERROR,
        "Some parameters/buffers are on the meta device (never materialised), or the model is spread over "
        "devices without a device map.",
        "Meta tensors have no data; a partially moved model fails late or silently runs some layers on the CPU.",
        "Materialise and load weights (to_empty + init, or load_state_dict(assign=True)); move the whole model "
        "with model.to(device).",
        "https://pytorch.org/docs/stable/meta.html",
        ("device",),
    ),
    FailureMode(
        "DEV-002", "float64 weights", Severity.WARN,
        "Trainable parameters are float64.",
        "Everything works, at twice the memory and, on GPUs, a fraction of the speed; usually caused by "
        "torch.set_default_dtype(torch.float64) or .double().",
        "Keep weights in float32 (or use mixed precision); convert numpy inputs with .float().",
        "https://pytorch.org/docs/stable/generated/torch.set_default_dtype.html",
        ("device", "dtype"),
    ),
)

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
        "modules_to_save instead. With loralib or hand-rolled LoRA layers, freeze everything but the factors "
        "(loralib.mark_only_lora_as_trainable(model)) before unfreezing a head.",
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
        severity=Severity.INFO,
        summary="The LoRA adapters make up more than 10% of the model's parameters (modules_to_save copies, which "
        "the user asked to train whole, are not counted).",
        why="Nothing fails; memory, optimizer state and checkpoint size approach a full fine-tune, typically "
        "from a rank far larger than intended.",
        fix="Lower r or target fewer modules.",
        reference=_PEFT_LORA,
        tags=("lora", "peft", "efficiency"),
    ),
    FailureMode(
        id="LORA-006",
        title="Zero-initialised LoRA factor gets no gradient",
        severity=Severity.ERROR,
        summary="lora_B (lora_embedding_A for embeddings) got no gradient although its layer ran, so the adapter "
        "stays exactly zero for the whole run; or both factors start at zero, so neither ever gets one.",
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
    FailureMode(
        id="LORA-013",
        title="LoRA adapters found (summary)",
        severity=Severity.INFO,
        summary="The model holds trainable LoRA factors (peft's, loralib's or hand-rolled ones named lora_A / "
        "lora_B); the finding counts them, their values and their share of the model.",
        why="Not a bug: a wrong target_modules pattern or rank still trains, only a different adapter than intended; "
        "the count is the first number to compare with the config (r x (in + out) per adapted layer).",
        fix="Nothing to fix; if the count is off, check target_modules and r (peft) or which layers were replaced "
        "(loralib).",
        reference=_PEFT_LORA,
        tags=("lora", "peft", "summary"),
    ),
    FailureMode(
        id="LORA-014",
        title="target_modules entries that match no module",
        severity=Severity.WARN,
        summary="Some entries of LoraConfig.target_modules name no module of the model (a module's name must equal "
        "the entry or end with '.' + entry).",
        why="peft raises only when no entry matches at all; an entry with a wrong path ('ff.0' for 'ff.net.0.proj') "
        "is skipped without a word, so the layers it meant get no adapter and the run trains less than planned.",
        fix="Use the names model.named_modules() prints; check model.print_trainable_parameters() against the plan.",
        reference="https://github.com/bghira/SimpleTuner/issues/766",
        tags=("lora", "peft"),
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
    FailureMode(
        id="DDP-007",
        title="Data-parallel wrapper found (summary)",
        severity=Severity.INFO,
        summary="The model is wrapped in DistributedDataParallel, FSDP or DeepSpeed (recognised by class name, so "
        "subclasses and other libraries' DistributedDataParallel count); the finding names the wrapper, the world "
        "size and the DDP settings that decide DDP-001.",
        why="Not a bug: it says which distributed checks applied, and whether an unused parameter will stop "
        "the run (find_unused_parameters=False, static_graph=False).",
        fix="Nothing to fix; if the wrapper or the world size is not what the launch script meant, check how the "
        "model was wrapped and launched.",
        reference=_DDP_DOCS,
        tags=("ddp", "distributed", "summary"),
    ),
)


# --- what the measured step does against what the setup intends (issue 18): the schedule over the planned run,
# what the loss supervises, what the update does (SCHED-, DATA-, OPT-, AMP-, LOOP-) ---------------------------
_STEP: tuple[FailureMode, ...] = (
    FailureMode(
        "OPT-008", "The optimizer moves tensors that got no gradient", Severity.WARN,
        "One optimizer step changes a tensor whose gradient was None or zero, or embedding rows the batch read "
        "whose gradient was zero: weight decay or momentum, not the loss, moves them.",
        "Freezing by running a part under no_grad, by zeroing its gradient, or by masking embedding rows leaves "
        "requires_grad=True and the tensors in the optimizer; decoupled weight decay (AdamW) or momentum shrinks "
        "and shifts them every step. The loss falls; the 'frozen' weights drift.",
        "Freeze with requires_grad_(False) and build the optimizer over the trainable tensors only; when only "
        "some rows may train (textual inversion), restore the others after each step or use weight_decay=0.",
        "https://github.com/huggingface/diffusers/issues/1176",
        ("optimizer", "frozen"),
    ),
    FailureMode(
        "INPUT-006", "Sequences start with BOS twice", Severity.WARN,
        "Most rows of the batch start (after any left padding) with config.bos_token_id twice.",
        "Text that already holds BOS (a chat template's '<s>', a dataset that stored it) tokenized with "
        "add_special_tokens=True gets a second one; the model trains on a prefix inference never sends, which "
        "shifts rewards and generations a little and raises nothing.",
        "Tokenize templated text with add_special_tokens=False (or strip the template's BOS).",
        "https://github.com/YangRui2015/Generalizable-Reward-Model/issues/6",
        ("inputs", "tokenizer"),
    ),
    FailureMode(
        "INPUT-007", "A 0/1 float mask handed to attention", Severity.WARN,
        "scaled_dot_product_attention or nn.MultiheadAttention gets a floating attn_mask/key_padding_mask that "
        "holds only 0s and 1s.",
        "Attention adds a float mask to its scores, so a keep-mask of 1s and 0s (the tokenizer's attention_mask "
        "cast to float) shifts the kept scores by 1 and masks nothing: every token attends to the padding, and "
        "nothing raises.",
        "Pass a bool mask (mind the convention: True = ignore for key_padding_mask, True = attend for "
        "scaled_dot_product_attention) or an additive mask of 0 and -inf.",
        "https://pytorch.org/docs/stable/generated/torch.nn.functional.scaled_dot_product_attention.html",
        ("inputs", "attention"),
    ),
    FailureMode(
        "LOSS-010", "KL divergence averaged over its classes", Severity.WARN,
        "kl_div / nn.KLDivLoss runs with reduction='mean' on a (batch, classes) input.",
        "'mean' divides the summed divergence by every element, batch x classes, not by the batch: the term is "
        "the number of classes times smaller than the KL divergence, so a distillation or regularisation term "
        "barely pulls, and torch only warns.",
        "Use reduction='batchmean' (the mathematical KL divergence per sample).",
        "https://pytorch.org/docs/stable/generated/torch.nn.KLDivLoss.html",
        ("loss",),
    ),
    FailureMode(
        "OPT-014", "Module flagged requires_grad=False still trains", Severity.WARN,
        "A module has requires_grad = False set as a plain attribute (module.requires_grad = False), but its "
        "parameters still require grad and sit in the optimizer.",
        "nn.Module has no requires_grad flag: the assignment creates an unused attribute and raises nothing, so "
        "the part meant to stay fixed (a pretrained encoder, a source-model head) trains with everything else.",
        "Call module.requires_grad_(False) (note the trailing underscore), or set p.requires_grad = False on each "
        "of its parameters, before building the optimizer.",
        "https://github.com/CSCYQJ/MICCAI23-ProtoContra-SFDA/issues/18",
        ("optimizer", "freezing"),
    ),
    FailureMode(
        "OPT-015", "Momentum the size of a weight decay", Severity.WARN,
        "A param group's momentum (SGD/RMSprop momentum, Adam's first beta) is above 0 but below 0.05.",
        "Positional arguments one slot off (SGD(params, lr, 5e-4) puts the weight decay into momentum) give a "
        "run with almost no momentum and no weight decay; it trains, just worse, and nothing raises.",
        "Pass momentum= and weight_decay= by keyword; check optimizer.param_groups after construction.",
        "https://pytorch.org/docs/stable/generated/torch.optim.SGD.html",
        ("optimizer",),
    ),
    FailureMode(
        "OPT-016", "Submodules kept in a plain list are not registered", Severity.WARN,
        "A module keeps submodules with parameters in a plain Python list, tuple or dict attribute.",
        "nn.Module registers only nn.Module, nn.ModuleList and nn.ModuleDict attributes: the hidden layers run in "
        "forward, but their parameters are missing from model.parameters() (the optimizer never updates them), "
        "from state_dict() and from .to(device); the rest of the model trains around random layers.",
        "Hold them in nn.ModuleList / nn.ModuleDict.",
        "https://discuss.pytorch.org/t/when-should-i-use-nn-modulelist-and-when-should-i-use-nn-sequential/5463",
        ("optimizer", "registration"),
    ),
    FailureMode(
        "OPT-017", "A param group with its own lr holds no tensors", Severity.WARN,
        "A param group has no tensors and a learning rate no other group has.",
        "A group built by a name filter that matches nothing (a backbone selected by a prefix its parameters do not "
        "have) leaves those tensors in the main group: they train at the main lr, and nothing raises.",
        "Build the groups from model.named_parameters() with the real names, and check that every group holds "
        "tensors.",
        "https://github.com/huggingface/lerobot/pull/280",
        ("optimizer",),
    ),
    FailureMode(
        "AMP-004", "Gradients clipped while still scaled", Severity.WARN,
        "The step calls clip_grad_norm_/clip_grad_value_ after a GradScaler-scaled backward and before "
        "scaler.unscale_(optimizer): the threshold is compared with the scaled gradients.",
        "With a scale of 65536 the scaled norm is huge, so clipping always triggers and scaler.step() then divides "
        "by the scale: every update is a tiny fraction of the intended one. Nothing fails; training crawls.",
        "Call scaler.unscale_(optimizer) before clipping, then scaler.step(optimizer) and scaler.update().",
        "https://pytorch.org/docs/stable/notes/amp_examples.html#gradient-clipping",
        ("precision", "loop"),
    ),
    FailureMode(
        "DATA-005", "Padding carries loss gradient", Severity.WARN,
        "Positions that the batch marks as padding (attention_mask / decoder_attention_mask 0, or the pad id as "
        "the target) receive gradient from the loss, measured at the model's output in the real backward; or a "
        "cross_entropy/nll_loss call (one inside forward too) whose targets are the batch's tokens, shifted or "
        "not, asks for the pad id where a mask argument marks padding, and does not ignore it.",
        "A custom loss over every position, labels padded with the pad id instead of -100 (T5/BART), or a "
        "collator that forgets to mask padding all train the model to predict padding; the loss still falls, "
        "helped by the easy pad targets.",
        "Set the labels of padding positions to -100 (DataCollatorForSeq2Seq(label_pad_token_id=-100)), or "
        "multiply a per-token loss by the mask before reducing it.",
        "https://huggingface.co/docs/transformers/main_classes/data_collator",
        ("data", "loss"),
    ),
    FailureMode(
        "DATA-006", "The target is the input token at the same position", Severity.WARN,
        "A large share of the supervised positions ask the model for the very token it is given at that position.",
        "Labels that are not shifted for a custom causal-LM loss, or masked-LM labels kept at unmasked positions "
        "instead of -100, turn training into copying the visible input; the loss drops fast and looks great.",
        "Shift the targets (predict token t+1 from position t), or set the labels of unmasked positions to -100 "
        "for masked-LM (DataCollatorForLanguageModeling does it).",
        "https://github.com/huggingface/transformers/issues/20797",
        ("data", "loss"),
    ),
    FailureMode(
        "DATA-007", "The batch holds one class only", Severity.WARN,
        "Every sample of the audited batch has the same target class, with a batch large enough that a shuffled "
        "draw would almost never do that; or, over three classes or more, every supervised position (token, "
        "pixel of a channels-first segmentation output) of the batch has the same class.",
        "A dataset sorted or grouped by label and loaded without shuffling gives batches of one class; labels "
        "that collapse on their way to the loss (a class-id mask through ToTensor, which divides by 255 before "
        ".long() truncates every id to 0) give one class everywhere. The model learns to predict that class, "
        "the loss falls, and accuracy is chance.",
        "Shuffle the training data (DataLoader(shuffle=True), or a sampler that mixes classes per batch); keep "
        "class-id masks out of image transforms (convert them with torch.as_tensor(mask, dtype=torch.long)).",
        "https://pytorch.org/docs/stable/data.html#data-loading-order-and-sampler",
        ("data",),
    ),
    FailureMode(
        "DATA-008", "Class weights grow with class frequency", Severity.WARN,
        "Measured per sample from the loss gradient, the classes that are most frequent in the batch get the "
        "largest loss weights.",
        "Class weights meant to counter imbalance are easily built as frequencies instead of inverse frequencies "
        "(or normalised the wrong way); the rare classes then count even less and nothing reports it.",
        "Use inverse-frequency weights, e.g. n_samples / (n_classes * count_c), or sklearn's "
        "compute_class_weight('balanced', ...).",
        "https://scikit-learn.org/stable/modules/generated/sklearn.utils.class_weight.compute_class_weight.html",
        ("data", "loss"),
    ),
    FailureMode(
        "DATA-009", "Class weights cancel out", Severity.WARN,
        "The loss is given class weights with reduction='mean', and every supervised sample of the batch has "
        "the same class: a weighted mean divides by the batch's summed weights, so the weights change nothing.",
        "CrossEntropyLoss(weight=...) normalises by the weights of the batch's targets; at batch size 1, or with "
        "batches of one class, up-weighting the rare class has no effect at all, and nothing reports it.",
        "Mix classes in every batch, or use reduction='none' and divide the weighted sum by the batch size.",
        "https://github.com/pytorch/pytorch/issues/50528",
        ("data", "loss"),
    ),
    FailureMode(
        "LOOP-004", "Accumulated losses are summed, not averaged", Severity.WARN,
        "The step runs K backward passes (micro-batches) before one optimizer step, and each micro-batch's mean "
        "loss enters the gradient with weight 1: the step's gradient is K times the mean over its batch.",
        "Gradient accumulation without dividing the loss by the accumulation count multiplies the effective lr by "
        "K (and changes it whenever K changes); training still runs, just hotter than planned.",
        "Divide each micro-batch's loss by the number of accumulation steps before backward (or let "
        "Accelerate/the Trainer do the accumulation).",
        "https://huggingface.co/docs/accelerate/usage_guides/gradient_accumulation",
        ("loop", "loss"),
    ),
    FailureMode(
        "LOOP-005", "Micro-batches of one step are weighted unequally", Severity.WARN,
        "Within one accumulated step, each micro-batch's positions get a different loss weight: each micro-batch "
        "is a mean over its own token or sample count.",
        "With padding-dependent token counts, averaging per micro-batch and then over micro-batches weights the "
        "tokens of short micro-batches more than those of long ones: not the loss of the whole batch.",
        "Normalise the summed loss by the total number of supervised positions of the whole accumulated step.",
        "https://huggingface.co/blog/gradient_accumulation",
        ("loop", "loss"),
    ),
    FailureMode(
        "LOOP-012", "Micro-batch gradients cleared before the step", Severity.WARN,
        "Within one optimizer step, zero_grad() runs between the micro-batches' backward passes (and no weight "
        "changes in between), so only the last micro-batch's gradient reaches the step.",
        "zero_grad() inside the accumulation loop instead of after the step: every update sees one micro-batch, "
        "divided by the accumulation count; the loss still falls, slowly and noisily.",
        "Call zero_grad() once per optimizer step, right after optimizer.step().",
        "https://github.com/bytetriper/RAE/issues/67",
        ("loop", "optimizer"),
    ),
    FailureMode(
        "LOOP-011", "Accumulated loss divided by the accumulation count twice", Severity.WARN,
        "Within one accumulated step the micro-batches' loss weights add up to 1/K instead of 1: a loss already "
        "normalised over the whole step (num_items_in_batch) is divided by the K micro-batches again.",
        "Every gradient is K times too small: with SGD the lr is effectively K times lower, with Adam weight "
        "decay and epsilon weigh K times more; training runs, just slower, and changes with K.",
        "Divide once: either each micro-batch's mean by K, or the summed loss by the step's total count, not both.",
        "https://github.com/unslothai/unsloth-zoo/pull/1023",
        ("loop", "loss"),
    ),
    FailureMode(
        "LOOP-009", "optimizer.step() twice on one backward's gradients", Severity.WARN,
        "The step calls optimizer.step() more than once with no backward() in between, so the same gradients "
        "(or, after a zero_grad, only the momentum) are applied again.",
        "A leftover optimizer.step() after scaler.step(optimizer), or a step in both the loop and a helper, "
        "doubles every update and the optimizer's step count; the loss still falls, just on a hotter, noisier "
        "path, and the bias correction and schedule run at twice the planned pace.",
        "Step once per backward window: with a GradScaler only scaler.step(optimizer); remove the other call.",
        "https://pytorch.org/docs/stable/notes/amp_examples.html",
        ("loop", "optimizer"),
    ),
    FailureMode(
        "LOOP-010", "Gradients computed but the optimizer never steps", Severity.WARN,
        "The step runs backward() and clears gradients or advances the lr scheduler, but never calls the "
        "optimizer's step(): the gradients are thrown away and no weight moves.",
        "The loss is computed and logged every step and the lr follows its schedule, so the run looks alive; "
        "only a flat loss curve (or weights identical to the initial ones) gives it away.",
        "Call optimizer.step() after every backward window (not in an else branch of 'if scheduler:').",
        "https://github.com/ClementPinard/SfmLearner-Pytorch/issues/5",
        ("loop", "optimizer"),
    ),
    FailureMode(
        "SCHED-001", "The lr schedule ends early", Severity.WARN,
        "Walked over the planned run at the cadence the step really steps it, the learning rate falls to ~0 "
        "(<= 1e-3 x its peak) well before the last planned optimizer step.",
        "A schedule built for one epoch's steps, for the steps of a shorter run, or stepped once per micro-batch "
        "reaches its end early; the rest of the run trains at lr ~0 (or on a cosine that climbs back up), and the "
        "loss curve merely flattens.",
        "Build the schedule with num_training_steps = the real number of optimizer steps (epochs x batches // "
        "accumulation), step it once per optimizer step, and pass total_steps= to the audit.",
        "https://huggingface.co/docs/transformers/main_classes/optimizer_schedules",
        ("schedule", "optimizer"),
    ),
    FailureMode(
        "SCHED-002", "The run ends inside the warmup", Severity.WARN,
        "Over the planned run the learning rate is still rising at the last optimizer step: the warmup (or the "
        "whole schedule) is longer than the run.",
        "Warmup and length multiplied by gradient_accumulation_steps or counted in samples make the schedule "
        "slower than the loop; training never reaches the planned lr nor decays, and nothing reports it.",
        "Count warmup and training steps in optimizer steps (after accumulation); check the schedule's length "
        "against the trainer's max_steps.",
        "https://github.com/huggingface/diffusers/issues/4387",
        ("schedule", "optimizer"),
    ),
    FailureMode(
        "SCHED-003", "The schedule is not stepped once per optimizer step", Severity.WARN,
        "The training step runs optimizer.step() but steps its per-step LR scheduler zero times (stepped once per "
        "epoch elsewhere) or several times (once per micro-batch).",
        "A per-step schedule (OneCycleLR, linear or cosine warmup) stepped per epoch never leaves its first lr; "
        "stepped per micro-batch it runs K times too fast. Both train, just at the wrong learning rates.",
        "Call scheduler.step() right after each optimizer.step() (under accumulation: only when the optimizer "
        "stepped, e.g. when accelerator.sync_gradients), or build a per-epoch schedule for per-epoch stepping.",
        "https://pytorch.org/docs/stable/optim.html#how-to-adjust-learning-rate",
        ("schedule", "loop"),
    ),
    FailureMode(
        "SCHED-005", "The schedule never comes near the optimizer's lr", Severity.WARN,
        "Walked over the planned run, the learning rate's peak stays below 1/100 of the lr the optimizer was "
        "built with (its initial_lr).",
        "LambdaLR multiplies the lr by what lr_lambda returns: a function that returns a learning rate (3e-4) "
        "instead of a factor (1.0) trains at lr squared; the loss still falls, a hundred to ten thousand times "
        "slower than planned.",
        "Make lr_lambda return a multiplier in [0, 1] (lr / max_lr), or build the optimizer with lr=1.0 on purpose.",
        "https://pytorch.org/docs/stable/generated/torch.optim.lr_scheduler.LambdaLR.html",
        ("schedule", "optimizer"),
    ),
    FailureMode(
        "SCHED-007", "One max_lr overwrites the param groups' lrs", Severity.WARN,
        "A OneCycleLR or CyclicLR was given a single max_lr (base_lr) for an optimizer with several param groups, "
        "and every group now holds the same settings.",
        "These schedulers set each group's lr from their own argument, not from the lr the group was built with: a "
        "backbone meant to train at lr/10 trains at the head's rate for the whole run. The schedule itself looks "
        "right in every log, and the groups still exist.",
        "Pass one value per group: OneCycleLR(optimizer, max_lr=[lr / 10, lr], ...).",
        "https://github.com/shariqfarooq123/AdaBins/issues/44",
        ("schedule", "optimizer"),
    ),
    FailureMode(
        "SCHED-008", "A scheduler drives another optimizer than the one it was meant for", Severity.WARN,
        "The step steps as many LR schedulers as optimizers, but two of the schedulers drive one optimizer and "
        "another optimizer the step steps has none.",
        "A scheduler built on the wrong optimizer raises no error: stepping it rewrites an lr another scheduler "
        "already set, while the part the other optimizer trains (a prompt encoder, a head at its own lr) runs at a "
        "constant base lr from step 0, with no warmup and no decay.",
        "Build each scheduler on the optimizer it is meant for (get_linear_schedule_with_warmup(embedding_optimizer, "
        "...)).",
        "https://github.com/THUDM/P-tuning/issues/13",
        ("schedule", "optimizer"),
    ),
    FailureMode(
        "SCHED-009", "ReduceLROnPlateau maximises a loss", Severity.WARN,
        "A ReduceLROnPlateau with mode='max' is stepped, inside the step, with the value of a loss the step "
        "computed.",
        "In 'max' mode the scheduler waits for the metric to rise: a falling loss counts as no improvement, so the "
        "lr is cut by its factor every patience + 1 steps exactly while the model learns, and the run crawls; "
        "nothing errors.",
        "Use mode='min' for a loss (mode='max' is for scores such as accuracy or mAP).",
        "https://github.com/RMeli/gnina-torch/pull/57",
        ("schedule",),
    ),
    FailureMode(
        "SCHED-006", "The schedule is sized for a longer run", Severity.WARN,
        "Walked over the planned run, the learning rate never falls below half its peak once there, and walked on it "
        "decays to ~0 "
        "between 2x and 16x the planned length: the schedule's horizon is several times the run's.",
        "A horizon counted in micro-batches while the scheduler steps once per accumulated update (or in samples) "
        "makes the decay barely start: the run ends at the peak lr and never anneals; the loss still falls, just "
        "not as low.",
        "Size the schedule in optimizer steps: num_training_steps = len(loader) * epochs // "
        "gradient_accumulation_steps (the trainer's max_steps).",
        "https://github.com/huggingface/accelerate/issues/225",
        ("schedule", "optimizer"),
    ),
    FailureMode(
        "SCHED-004", "The schedule starts over on a resumed optimizer", Severity.WARN,
        "The LR scheduler is at its first step (last_epoch=0) while the optimizer it drives already holds state "
        "from earlier steps (Adam's step count, momentum buffers), and the schedule is not constant; or the "
        "scheduler has stepped, but a param group's lr is not the one it last set (a scheduler built after "
        "optimizer.load_state_dict wrote its first lr back, and loading its own state does not undo that).",
        "Resuming from a checkpoint that restores the model and optimizer but builds the scheduler afresh "
        "replays the warmup and the decay from the top on trained weights; the run goes on with the wrong "
        "learning rates and never reaches the planned end of the schedule.",
        "Save scheduler.state_dict() in the checkpoint and load it with the optimizer's on resume (or build the "
        "scheduler with last_epoch= the resumed step).",
        "https://github.com/victoresque/pytorch-template/issues/68",
        ("schedule", "optimizer"),
    ),
    # what each loss receives, against the domain its function documents (issue 18, round 3)
    FailureMode(
        "LOSS-011", "A log-probability loss gets something else", Severity.WARN,
        "nll_loss, ctc_loss or kl_div receives an input that is not log-probabilities over the dimension it reads: "
        "raw logits, probabilities, or log_softmax taken over another dimension (the batch, the time axis).",
        "These losses pick or weigh entries of their input as if it were log p. On raw logits the objective is "
        "not a likelihood (shifting every logit lowers it); normalised over the batch it ranks samples against "
        "each other instead of classes. Nothing checks it, and the loss still falls.",
        "Apply log_softmax over the class dimension (dim=1 for nll_loss, the last for ctc_loss and kl_div's input) "
        "right before the loss, or use cross_entropy on the logits.",
        "https://pytorch.org/docs/stable/generated/torch.nn.CTCLoss.html",
        ("loss",),
    ),
    FailureMode(
        "LOSS-012", "Targets outside the loss's domain", Severity.WARN,
        "A loss receives floating targets its function does not define: binary cross entropy targets outside "
        "[0, 1], kl_div targets that are log-probabilities without log_target=True (or probabilities with it), "
        "soft cross-entropy targets that do not sum to 1 over the classes.",
        "torch computes a number for them: -1/+1 labels in BCE reward the wrong sign, log-probabilities as "
        "kl_div's target give a divergence of nothing in particular, unnormalised soft targets reweigh samples. "
        "The loss moves and nothing warns.",
        "Map binary labels to 0/1, pass log_target=True for log-probability targets, normalise soft targets.",
        "https://pytorch.org/docs/stable/generated/torch.nn.KLDivLoss.html",
        ("loss", "labels"),
    ),
    FailureMode(
        "LOSS-013", "Loss arguments swapped: the target carries the gradient", Severity.WARN,
        "An asymmetric loss (kl_div, cross_entropy with soft targets, binary cross entropy) gets a target that "
        "requires grad and an input that does not.",
        "These functions expect (prediction, reference). With the roles swapped the gradient flows through the "
        "target, so the model minimises another divergence (KL(model || reference) instead of "
        "KL(reference || model)): mode-seeking instead of mean-seeking, a different fixed point, and no error.",
        "Pass the trained model's output as the first argument and the fixed reference as the target (detach it "
        "if it comes from a teacher); write a reverse KL explicitly if that is intended.",
        "https://github.com/sarahwie/attention/issues/6",
        ("loss",),
    ),
    FailureMode(
        "LOSS-014", "Logits that cannot go negative", Severity.WARN,
        "cross_entropy or binary_cross_entropy_with_logits receives only non-negative values: a ReLU, sigmoid or "
        "softplus sits between the last linear layer and a loss that applies its own softmax/sigmoid.",
        "The loss still falls, but it can only express part of its range: sigmoid of a non-negative logit is at "
        "least 0.5, so a binary head never predicts the negative class with confidence; bounded logits cap how "
        "sharp a softmax can get.",
        "Feed the raw output of the last linear layer to the loss; keep activations for inference-time "
        "probabilities only.",
        "https://pytorch.org/docs/stable/generated/torch.nn.CrossEntropyLoss.html",
        ("loss", "activations"),
    ),
    FailureMode(
        "LOSS-015", "The prediction's activation cannot reach the targets", Severity.WARN,
        "A regression loss (mse_loss, l1_loss, smooth_l1_loss, huber_loss) compares a prediction that comes "
        "straight from a sigmoid, tanh, softmax, ReLU or softplus with targets of which 5% or more lie outside "
        "that activation's range.",
        "A sigmoid head regressing 0..100 scores, a tanh head for unnormalised coordinates, a ReLU head for "
        "signed targets: the loss falls while the bounded outputs saturate, and those targets are never fitted.",
        "Remove the final activation (a linear output for regression), or scale the targets into its range "
        "and back at inference.",
        "https://pytorch.org/docs/stable/generated/torch.nn.MSELoss.html",
        ("loss", "activations"),
    ),
    FailureMode(
        "LOSS-016", "A loss term carries no gradient", Severity.WARN,
        "A loss function called with gradients on returns a result without gradient, and the trained loss adds "
        "a term without gradient at its top-level sum; or a hand-written term (a full mean or sum) without "
        "gradient is added to it while its value moves with the trained weights (a cut through numpy or .item()).",
        "Both sides of a distillation KL taken from the frozen teacher, or a generator's adversarial term on "
        "fake.detach() judged by a discriminator frozen for that step: the loss value includes the term, the "
        "run trains, and the term contributes no gradient at all.",
        "Compute the learning side from the trained model (the student's logits, the generator's output without "
        ".detach()); drop a term that is meant as a metric from the loss.",
        "https://pytorch.org/docs/stable/notes/autograd.html#locally-disabling-gradient-computation",
        ("loss", "gradients"),
    ),
    FailureMode(
        "LOSS-017", "A loss term trains nothing its step updates", Severity.WARN,
        "A loss function's result is part of the loss that step_fn backpropagates and its gradient reaches "
        "trainable parameters, but none that the optimizer steps following that backward hold.",
        "A generator's adversarial term that scores the real frame instead of the generated one, or an actor "
        "loss computed on the replay buffer's actions: the term's gradient lands only on the discriminator or "
        "critic, whose own step clears it; the loss value moves, and the part being updated never learns from "
        "that term.",
        "Compute the term from the output of the part this step trains (the discriminator on the fake, the "
        "critic on the actor's action).",
        "https://pytorch.org/tutorials/beginner/dcgan_faces_tutorial.html#training",
        ("loss", "gradients"),
    ),
    FailureMode(
        "LOSS-018", "A policy-gradient weight carries gradient", Severity.WARN,
        "A log-probability (Distribution.log_prob, log_softmax) is multiplied by a weight that takes both signs "
        "and whose gradient reaches trainable tensors the log-probability does not reach.",
        "-(log_prob * advantage) is the policy gradient only while the advantage is a constant for backward. Left "
        "attached (returns - values), it also pushes the value head, or the reward model, by the policy "
        "objective; the loss falls and the policy seems to learn, while the baseline is trained on a mix of two "
        "objectives and stops reducing variance.",
        "Detach the weight in the policy term: -(log_prob * advantage.detach()).mean(); train the critic with "
        "its own value loss.",
        "https://spinningup.openai.com/en/latest/spinningup/rl_intro3.html",
        ("loss", "gradients"),
    ),
    FailureMode(
        "LOSS-019", "A loss term is maximised", Severity.INFO,
        "The gradient that backward brings to a loss function's result (cross_entropy, mse_loss, kl_div, ...) is "
        "nowhere positive and somewhere negative, and the optimizer step after that backward moves what the "
        "term reaches: the loss enters the objective with a minus sign.",
        "A KL-to-reference penalty, a reconstruction or a regulariser subtracted instead of added: the total "
        "loss still falls, faster than before, because the term runs off to large values; the model drifts "
        "from the reference or forgets what the term was meant to keep.",
        "Add the term (loss = task + beta * kl); to maximise a reward, negate the reward, not a loss function. "
        "Reported as INFO: adversarial objectives (a domain or attention adversary), unlearning and minimax "
        "generators maximise a loss on purpose, and one step cannot tell them from a penalty subtracted by "
        "mistake.",
        "https://github.com/huggingface/trl/blob/main/trl/trainer/ppo_trainer.py",
        ("loss", "gradients"),
    ),
    FailureMode(
        "LOSS-020", "A mask multiplies an already-reduced loss", Severity.WARN,
        "A loss function's result, already reduced to one number (reduction='mean' or 'sum', the default), is "
        "multiplied by a weight tensor that holds zeros before the loss is backpropagated.",
        "The mask was meant to drop padded or unsupervised elements, but it scales a scalar: sum(mean * w) / sum(w) "
        "is the mean itself. Every element it should drop still carries loss, and the loss curve looks like any "
        "other.",
        "Compute the per-element loss (reduction='none'), multiply it by the mask, then normalise by the mask's sum.",
        "https://github.com/d2l-ai/d2l-en/issues/2582",
        ("loss", "masks"),
    ),
    FailureMode(
        "AMP-005", "Softmax-family loss computed in 16 bits", Severity.WARN,
        "cross_entropy, nll_loss, kl_div or ctc_loss runs on float16/bfloat16 input outside autocast (bf16 "
        "weights, an FSDP bf16 parameter policy, logits cast to half).",
        "Autocast runs these losses in float32; outside it they run in the input's dtype. bf16 keeps 8 bits of "
        "mantissa: the log-softmax over a large vocabulary, the loss and the gradient it sends back are rounded, "
        "so small improvements vanish into quantisation and the run plateaus early.",
        "Upcast the logits before the loss (logits.float()), as transformers' own losses do.",
        "https://github.com/Modalities/modalities/pull/464",
        ("mixed-precision", "loss"),
    ),
    FailureMode(
        "LOOP-013", "Gradient clipping that no optimizer step uses", Severity.WARN,
        "step_fn calls clip_grad_norm_/clip_grad_value_, but never between its last backward() and "
        "optimizer.step(): it clips after the step, or before backward(), or it clips only tensors that another "
        "of its optimizers steps (an actor-critic update clipping the critic's head).",
        "The clip runs and returns a norm, so logs look right, but it edits gradients that are cleared before "
        "any step reads them. Every update is unclipped and a gradient spike reaches the weights.",
        "Clip the parameters the optimizer steps, after the last backward() of the step and before "
        "optimizer.step() (after scaler.unscale_ under a GradScaler).",
        "https://github.com/VGraphRNN/VGRNN/issues/4",
        ("loop", "gradients"),
    ),
    FailureMode(
        "LOOP-014", "An optimizer applies gradients another phase's backward left", Severity.WARN,
        "step_fn steps several optimizers (a GAN's generator and discriminator), and the tensors of one of them "
        "received gradient both before and after another optimizer's step with no zero_grad in between.",
        "Each loss is right and each optimizer steps; only the discriminator's update also carries the generator "
        "loss's gradient (which flows through the discriminator), so it partly trains to help the generator.",
        "Clear each optimizer's gradients right before its own backward (optimizer.zero_grad() first), or "
        "detach what one phase feeds the other.",
        "https://github.com/Lightning-AI/pytorch-lightning/issues/591",
        ("loop", "gradients"),
    ),
    FailureMode(
        "DATA-010", "End-of-sequence is never a label", Severity.WARN,
        "A language-model batch of whole, padded examples (each row starts with BOS) in which no label is "
        "config.eos_token_id.",
        "A tokenizer that adds no EOS (Llama's add_eos_token defaults to False) or a template that drops it "
        "leaves every example without its stop token. The loss falls as usual; the fine-tuned model never "
        "learns to stop and rambles until max_new_tokens.",
        "Append EOS to every example (add_eos_token=True, text + tokenizer.eos_token, or a collator that adds "
        "it) and keep it in the labels.",
        "https://github.com/huggingface/trl/issues/734",
        ("data", "labels", "llm"),
    ),
    FailureMode(
        "DATA-011", "Examples with no supervised token", Severity.WARN,
        "In a language-model batch, some examples have every label at -100 while the others have labels.",
        "Completion-only masking plus truncation to max_length cuts the completion off long prompts; the "
        "example still costs a forward and backward but contributes no loss. The mean over the remaining "
        "tokens hides it: the loss looks normal while a share of the data (the long prompts) is never learned.",
        "Raise max_length, truncate the prompt rather than the completion (truncation_side='left' on the prompt), "
        "or filter out examples whose completion does not fit.",
        "https://huggingface.co/docs/trl/sft_trainer",
        ("data", "labels", "llm"),
    ),
    FailureMode(
        "DATA-012", "Every sample in the batch is the same", Severity.WARN,
        "Each input tensor the model receives (masks and labels aside) has identical rows across the batch.",
        "A Dataset whose __getitem__ ignores its index (returns self.data[0], a cached item, a fixed seed's "
        "crop), or a batch built with expand() from one example, trains on one sample repeated. The loss falls "
        "fast, since one example is easy to memorise, and the model learns nothing general.",
        "Check that __getitem__ uses its index and that the collator stacks different items; print two rows "
        "of one batch.",
        "https://pytorch.org/tutorials/beginner/basics/data_tutorial.html",
        ("data",),
    ),
    FailureMode(
        "DATA-013", "The decoder never starts from its start token", Severity.WARN,
        "An encoder-decoder LM gets decoder_input_ids built by the user, and no row begins with "
        "config.decoder_start_token_id.",
        "generate() starts every output from decoder_start_token_id. Targets sliced the BART way "
        "(decoder_input_ids = y[:, :-1], labels = y[:, 1:]) for a model whose targets carry no BOS (T5) train "
        "the decoder from the first target token instead: the first token is never a label, and the start the "
        "model meets at inference was never trained.",
        "Pass the full targets as labels and let the model build decoder_input_ids (shift_right prepends the "
        "start token), or prepend decoder_start_token_id yourself.",
        "https://github.com/huggingface/transformers/issues/5987",
        ("data", "labels", "llm"),
    ),
    FailureMode(
        "DATA-014", "The positive is also a negative", Severity.WARN,
        "A cross_entropy over candidates (in-batch negatives, a contrastive score matrix) has rows where the "
        "target's logit equals another candidate's logit: the same item is both the positive and a negative.",
        "A duplicate passage or caption in an in-batch-negatives batch, hard negatives resampled from a pool that "
        "holds the positive, or a sample drawn twice: the loss pushes the item away from itself, cannot fall below "
        "log 2 on those rows, and the gradient of the two equal candidates cancels. Training runs; retrieval "
        "quality is quietly lower.",
        "Deduplicate the batch (a sampler with no duplicates, e.g. sentence-transformers' NoDuplicatesBatchSampler), "
        "sample hard negatives only from the true negatives, or mask candidates equal to the positive.",
        "https://github.com/huggingface/sentence-transformers/issues/3189",
        ("data", "loss"),
    ),
    FailureMode(
        "DATA-015", "The ignore index is one of the classes", Severity.WARN,
        "A per-sample cross_entropy or nll_loss (one target per sample of the batch) has an ignore_index in "
        "[0, classes), and samples of that class are in the batch.",
        "The loss silently drops every sample of that class: the head is never trained to predict it, while the "
        "loss looks fine (it is averaged over the other samples). Typical cause: one criterion with "
        "ignore_index=0, meant for token labels where 0 marks padding, reused for a sentence-level head where 0 "
        "is a real class.",
        "Give each head its own loss; keep ignore_index at -100 (outside the classes) and mark ignored targets "
        "with -100.",
        "https://github.com/codertimo/BERT-pytorch/issues/49",
        ("data", "loss", "labels"),
    ),
    FailureMode(
        "INPUT-012", "Packed examples attend one another", Severity.WARN,
        "position_ids restart inside a row (several examples packed into one row), yet the predictions of the "
        "row's later examples change when only its first example's tokens change (measured in eval mode).",
        "Packing is meant to be invisible: each example should see only itself. When the attention mask does "
        "not follow the packing (a 2-D all-ones attention_mask passed with packed position_ids turns the "
        "model's packed-sequence masking off, and so does a cache (use_cache=True); an attention backend that "
        "ignores position_ids), every example "
        "attends the ones before it. The loss still falls, and the model learns from context that will not "
        "exist at inference.",
        "Pass position_ids without the all-ones attention_mask and with use_cache=False (the model then masks by "
        "them), use an attention "
        "implementation that supports packing (flash_attention_2, SDPA with packed position_ids), or pass a "
        "block-diagonal mask.",
        "https://github.com/huggingface/transformers/pull/46634",
        ("inputs", "masks", "llm"),
    ),
    FailureMode(
        "INPUT-013", "The loss reads one position of a token sequence", Severity.WARN,
        "Of a (batch, positions) token input with three or more positions that the model embeds, the loss "
        "gradient reaches the embedding output at one position only, the same in every row, while the other "
        "positions hold tokens.",
        "A sequence length built as ones, a mask that keeps the first item, or an index where a pooling was "
        "meant drops the rest of each sequence from the forward; shapes still fit, the loss falls on what one "
        "item predicts, and the history or context the model was built for never trains.",
        "Pass each row's real length (or mask) to the pooling or attention, and pool over the positions instead "
        "of indexing one.",
        "https://github.com/shenweichen/DeepCTR-Torch/issues/128",
        ("inputs", "masks"),
    ),
    FailureMode(
        "INPUT-014", "The RoPE config was changed after the model was built", Severity.WARN,
        "A transformers rotary embedding's frequencies, rebuilt from the config the model holds now, differ from "
        "the ones it computed at construction.",
        "transformers computes the rotary frequencies once, in __init__: a RoPE scaling (linear, dynamic, yarn) or "
        "theta written into model.config afterwards is never read. The run logs the long context, trains on long "
        "sequences, and the model still rotates with the base frequencies.",
        "Put the RoPE parameters into the config before the model is built (from_pretrained(..., rope_scaling=...) "
        "or a modified config passed to from_config), not into model.config afterwards.",
        "https://github.com/MakazhanAlpamys/Soup/issues/793",
        ("inputs", "positions", "llm"),
    ),
    FailureMode(
        "DATA-016", "The prompt is masked by column on left-padded rows", Severity.WARN,
        "A causal LM's batch is left-padded; every row whose padding ends before some column has its labels "
        "masked up to exactly that column, and a row padded past it has its first real token supervised.",
        "labels[:, :prompt_len] = -100 masks tensor columns. On a left-padded batch (a processor's default) those "
        "columns are padding for short rows, so their real prompt tokens stay in the loss: the model is trained "
        "to predict the prompt, and how much of it depends on how much padding each row got.",
        "Mask by position among each row's real tokens (attention_mask.cumsum(1) - 1 < prompt_len), or pad on the "
        "right for training.",
        "https://github.com/QwenLM/Qwen3-ASR/pull/212",
        ("data", "labels", "llm", "masks"),
    ),
    FailureMode(
        "DATA-017", "The regression target is already in the input", Severity.WARN,
        "A regression loss's target equals, for every sample of the batch, the model's input at one fixed "
        "position of its second axis (one step of a window).",
        "The answer is among the features: a forecasting label shifted the wrong way (shift(1), the previous "
        "value, for shift(-1), the next), or the target column left in the feature window. The model learns to "
        "copy it, the training loss looks excellent, and the forecasts carry no information.",
        "Build the target from values the input window does not hold (the next step, series[t + 1]), and keep "
        "the target column out of the features.",
        "https://github.com/KIC/pandas-ml-quant/issues/25",
        ("data", "labels"),
    ),
    FailureMode(
        "DATA-018", "Two forwards of the step compute the same thing", Severity.WARN,
        "Two training forwards of the model in one step get equal inputs and compute equal outputs, and one "
        "loss function's input is computed from both (it compares them).",
        "A contrastive or consistency loss needs two different views of each sample (two augmentations, or "
        "dropout as in SimCSE). Passing the same view twice (model(aug1) for both embeddings) through a "
        "deterministic model makes every positive pair an image with itself: the loss falls, and no invariance "
        "is learned.",
        "Pass the second view (batch['aug2']), or keep dropout on when the views are meant to differ only by "
        "it.",
        "https://github.com/catalyst-team/catalyst/pull/1278",
        ("data", "loss"),
    ),
    FailureMode(
        "DATA-019", "Packed examples' labels run across the boundary", Severity.WARN,
        "In a packed batch (position ids restart where each example starts), the last position of an example is "
        "pulled towards the next example's first token (measured from the loss gradient).",
        "Packing concatenates unrelated documents; when the labels are concatenated too, with no -100 at each "
        "document's first token, the model is trained to continue every document with an unrelated one. The "
        "loss looks normal; generation runs on past the end of an answer into another topic.",
        "Set the label of each packed example's first token to -100 (the collator's separator), e.g. "
        "labels[position_ids == 0] = -100.",
        "https://github.com/NVIDIA-BioNeMo/bionemo-recipes/pull/1449",
        ("data", "labels", "llm"),
    ),
    FailureMode(
        "DATA-020", "Contrastive positives are the anchors themselves", Severity.WARN,
        "In a cross_entropy over candidates, every row's target logit is one and the same non-zero value and the "
        "largest of its row: the positive pair is each embedding with itself (cosine 1 over the temperature).",
        "Both views sliced from the same half of the batch (z[:n] twice), or a key computed from the query's own "
        "view, make the positive term constant; the loss still falls by pushing the anchors apart, and the "
        "invariance between views the method is about is never learned.",
        "Take the positive from the other view (z[:n] against z[n:]) and check the two views are different "
        "augmentations.",
        "https://github.com/microsoft/A-CLIP/pull/4",
        ("loss", "contrastive"),
    ),
    FailureMode(
        "INPUT-010", "The prediction sees the token it must predict", Severity.WARN,
        "The loss pulls each position towards the next input token, and the prediction at a position depends on "
        "the tokens after it (measured: gradient from later token embeddings).",
        "A hand-written decoder without a causal mask (is_causal=False, no tgt_mask), or a bidirectional "
        "LSTM/encoder trained as a language model, can read its own target one position ahead. The loss falls "
        "fast, close to zero, because copying is easy; generation, which has no future to read, produces garbage.",
        "Mask attention causally (F.scaled_dot_product_attention(..., is_causal=True), "
        "nn.Transformer.generate_square_subsequent_mask for tgt_mask) or use a unidirectional recurrent layer.",
        "https://pytorch.org/docs/stable/generated/torch.nn.Transformer.html",
        ("inputs", "llm", "masks"),
    ),
    FailureMode(
        "INPUT-011", "A row's prediction depends on its padding", Severity.WARN,
        "The setup marks padding (a mask argument, config.pad_token_id or an embedding's padding_idx), yet a padded "
        "row's prediction changes when its padding is cut off (measured: the row alone, then cut to its real tokens, "
        "in eval mode).",
        "Padding is read as input: a mask that never reaches the attention, a mask of the other convention "
        "(nn.MultiheadAttention's key_padding_mask is True at padding, an HF attention_mask is 1 at real tokens), "
        "or a mean pooling or normalisation over the padded length. The loss still falls; every prediction depends "
        "on how long the other sequences of its batch were, and inference on unpadded inputs sees another model.",
        "Apply the mask where attention runs and in the correct convention; pool and normalise over the real "
        "positions only (sum of masked outputs over the mask's sum).",
        "https://pytorch.org/docs/stable/generated/torch.nn.MultiheadAttention.html",
        ("inputs", "masks"),
    ),
    FailureMode(
        "INPUT-008", "padding_idx is a real token", Severity.WARN,
        "An nn.Embedding's padding_idx is an id that occurs inside the batch's sequences (between other "
        "tokens), not only as left or right padding.",
        "The padding row gets no gradient by construction. When padding_idx is not the id the data pads with "
        "(the vocabulary pads with 1, padding_idx=0 is <unk>), that real token's embedding stays at its "
        "initial (zero) value for the whole run.",
        "Set padding_idx to the id the tokenizer pads with (tokenizer.pad_token_id), or to None.",
        "https://github.com/hyunwoongko/transformer/pull/2",
        ("inputs", "embeddings"),
    ),
    FailureMode(
        "INPUT-009", "First layer input far from unit scale", Severity.WARN,
        "The first linear, convolutional or recurrent layer to run receives unscaled values (root-mean-square "
        "above 20 and magnitudes above 100: raw pixels, raw measurements) or a nearly constant input (spread "
        "under 1% of its magnitude).",
        "Layers are initialised for inputs of about unit scale. Unscaled features saturate activations and make "
        "one feature dominate the gradient; a nearly constant input (pixels divided by 255 twice) leaves the "
        "samples indistinguishable. The loss still moves a little.",
        "Standardise features (subtract the mean, divide by the standard deviation, computed once on the "
        "training set), divide pixels by 255 exactly once, and check the preprocessing on one batch.",
        "https://github.com/SarahwXU/HiSup/issues/35",
        ("inputs", "data"),
    ),
    FailureMode(
        "OPT-018", "Adam's betas swapped", Severity.WARN,
        "An Adam-family optimizer has betas=(b1, b2) with b1 > b2, e.g. (0.999, 0.9).",
        "The first beta averages the gradient (momentum), the second its square. Swapped, the momentum is smoothed "
        "over ~1,000 steps and lags far behind the weights, while the variance estimate follows the last ~10 "
        "squared gradients, so the step size jumps with every noisy batch. Training runs, slower and less stable.",
        "Pass betas=(0.9, 0.999) (or (0.9, 0.95) for large-batch pre-training): the first value is the smaller.",
        "https://pytorch.org/docs/stable/generated/torch.optim.Adam.html",
        ("optimizer",),
    ),
    FailureMode(
        "MODE-007", "Dropout drops most activations", Severity.WARN,
        "A dropout layer has p >= 0.8 (p = 1 zeroes everything).",
        "PyTorch's p is the probability of zeroing an element; TensorFlow's old keep_prob is the probability of "
        "keeping it. p=0.9 copied from keep_prob=0.9 keeps a tenth of each activation and multiplies it by ten: "
        "training is dominated by noise, the loss falls slowly, evaluation (no dropout) looks unrelated.",
        "Use p = 1 - keep_prob (0.1 for keep_prob=0.9); typical values are 0.0-0.5.",
        "https://pytorch.org/docs/stable/generated/torch.nn.Dropout.html",
        ("modes",),
    ),
    FailureMode(
        "MODE-008", "Dropout that ignores eval mode", Severity.WARN,
        "In the audit's own pass of the model with every module in eval mode, a functional dropout "
        "(F.dropout, F.dropout2d, ...) ran with training=True.",
        "F.dropout(x, p) defaults to training=True: called without training=self.training inside forward it keeps "
        "dropping in model.eval(). Training is unaffected; validation scores are noisy and low, and the served "
        "model is random.",
        "Pass training=self.training to the functional dropout, or use an nn.Dropout module, which follows "
        "model.train()/model.eval().",
        "https://pytorch.org/docs/stable/generated/torch.nn.functional.dropout.html",
        ("modes",),
    ),
    FailureMode(
        "OPT-019", "One module listed several times in a container", Severity.WARN,
        "An nn.ModuleList or nn.Sequential holds the same module object at several positions.",
        "nn.ModuleList([Block()] * n) repeats a reference: the n-layer stack is one layer applied n times, with "
        "one set of weights. It trains, with a fraction of the intended capacity, and nothing warns.",
        "Build each entry anew: nn.ModuleList(Block() for _ in range(n)), or copy.deepcopy(block) per entry; "
        "share weights on purpose by calling one module in a loop.",
        "https://github.com/zalandoresearch/pytorch-vq-vae/issues/2",
        ("optimizer", "architecture"),
    ),
    FailureMode(
        "OPT-020", "A layer built inside forward", Severity.WARN,
        "The model's forward registers trainable parameters (nn.Linear(...), nn.Parameter(...) made in forward) "
        "that the model does not hold once the step is over.",
        "Each call draws new random weights: they get a gradient, so the loss backpropagates without error, but "
        "no optimizer holds them, state_dict() never saves them and the next call replaces them. That part of "
        "the network stays random while the rest trains around it.",
        "Build the layer in __init__ and only call it in forward (a lazily built layer must be assigned to the "
        "module once, before the optimizer is made).",
        "https://github.com/lafith/Mobile-UNet/issues/1",
        ("optimizer", "architecture"),
    ),
    FailureMode(
        "OPT-021", "A copy of the weights moves away from them", Severity.WARN,
        "A tensor that step_fn updates in place after the optimizer step, and that was a near copy of a trainable "
        "tensor (an EMA shadow, a mean teacher, a target network), ends the step farther from that tensor, moved "
        "back along the gap or toward zero.",
        "An update of an average moves it toward the live weights whatever the decay. With its sign flipped, or "
        "one of its two terms missing, the copy drifts away a little each step; the loss curve is the live "
        "model's and looks normal, while the averaged weights that get evaluated and saved are garbage.",
        "Move the copy toward the weights: s -= (1 - decay) * (s - p), s.mul_(decay).add_(p, alpha=1 - decay), "
        "or s.lerp_(p, 1 - decay); torch.optim.swa_utils.AveragedModel does it for you.",
        "https://github.com/ostris/ai-toolkit/issues/1034",
        ("optimizer", "state"),
    ),
    FailureMode(
        "OPT-023", "A copy of the weights is updated once per micro-batch", Severity.WARN,
        "A near copy of trainable tensors that step_fn updates in place (an EMA shadow, a mean teacher, a target "
        "network) is written in more micro-batch windows (between backward passes) than the step runs optimizer "
        "steps.",
        "Under gradient accumulation an EMA updated on every micro-batch decays k times per real step, k - 1 of "
        "them toward weights that have not changed: its effective decay depends on the accumulation setting, and "
        "the averaged weights that get evaluated and saved follow the live ones far faster than configured.",
        "Update the copy once per optimizer step: after optimizer.step(), or only when accelerator.sync_gradients "
        "is True.",
        "https://github.com/SWivid/F5-TTS/issues/631",
        ("optimizer", "state"),
    ),
    FailureMode(
        "OPT-022", "The step unfreezes what was frozen", Severity.WARN,
        "Tensors with requires_grad=False when the training step starts require grad when it ends, get a gradient "
        "and sit in the optimizer.",
        "Freezing is a flag, and anything the step calls can set it back: a context manager that re-enables "
        "gradients on exit (peft's disable_adapter() turns an adapter loaded with inference_mode=True trainable), "
        "a helper that calls model.requires_grad_(True), a toggle left undone. The optimizer was built over all the "
        "parameters, so the frozen part trains from the first step while the loss looks normal.",
        "Freeze the part again after the call that unfreezes it (peft: set_adapter(name, inference_mode=True)), or "
        "build the optimizer only over the tensors meant to train.",
        "https://github.com/huggingface/peft/issues/3447",
        ("optimizer", "freezing"),
    ),
    FailureMode(
        "MODE-009", "A momentum copy's statistics never follow its weights", Severity.WARN,
        "The step updates a frozen part's weights in place (an EMA or mean teacher, a target encoder), or those "
        "of a copy it holds beside the model, but the running statistics of its normalisation layers, in eval "
        "mode, stay where they were while the trained network's statistics move.",
        "An EMA update written over parameters() skips the buffers: the teacher's BatchNorm keeps its initial "
        "mean 0 and variance 1 (or the values it was copied with) under weights that keep changing, so its "
        "pseudo-labels and evaluation are computed with mismatched normalisation; nothing errors.",
        "Update the buffers with the weights: an EMA of the float buffers and a copy of num_batches_tracked "
        "(timm's ModelEmaV3 and torch.optim.swa_utils.AveragedModel(use_buffers=True) do both).",
        "https://github.com/saltoricristiano/cosmix-uda/issues/21",
        ("modes", "batchnorm", "state"),
    ),
    FailureMode(
        "INIT-001", "Identical units that stay identical", Severity.WARN,
        "Every row (output unit) of a trainable weight is equal, and so is every row of its gradient.",
        "Gradient descent keeps equal units equal: a layer initialised with a constant (nn.init.constant_, "
        "zeros in two consecutive layers) behaves as one unit however wide it is. The loss falls a little and "
        "then plateaus.",
        "Initialise weights randomly (the module's reset_parameters, nn.init.kaiming_uniform_ or normal_); a "
        "zero initialisation is fine for an output layer alone.",
        "https://cs231n.github.io/neural-networks-2/#init",
        ("gradients", "initialisation"),
    ),
)


# --- the loop watch inside GuardedOptimizer and the callbacks (issue 19): invariants across steps ------------
_WATCH: tuple[FailureMode, ...] = (
    FailureMode(
        "OPT-009", 'Optimizer rebuilt during training (moments thrown away)', Severity.WARN,
        "The loop watch saw a new optimizer take over parameters another optimizer had already stepped, with empty state: Adam's moments and step counts start again from zero (typically an optimizer built inside the epoch loop).",
        'Every rebuild restarts bias correction and forgets the moments, so each epoch begins with a burst of badly scaled updates; the loss still falls, just worse, and nothing raises.',
        'Build the optimizer (and its scheduler) once, before the epoch loop; to change hyper-parameters, edit optimizer.param_groups instead of constructing a new one.',
        'https://github.com/alan-turing-institute/deepsensor/issues/47',
        ('watch', 'optimizer', 'loop'),
    ),
    FailureMode(
        "OPT-010", 'Optimizer state emptied or step count went backwards', Severity.WARN,
        "The loop watch saw the optimizer's per-parameter state disappear between steps, or its step count decrease (state reset, a stale state dict loaded mid-run).",
        'Resetting moments mid-run looks like an ordinary loss bump; a step count that goes back re-applies bias correction meant for the first steps.',
        "Do not reset optimizer.state during training; load a state dict only when resuming, from the same run's latest checkpoint.",
        'https://github.com/NVlabs/stylegan2-ada-pytorch/issues/108',
        ('watch', 'optimizer'),
    ),
    FailureMode(
        "OPT-011", 'Param-group learning rates collapsed to one value', Severity.WARN,
        'The param groups started with different learning rates (e.g. a backbone at lr/10) and now all have the same one: a helper such as adjust_learning_rate wrote one lr into every group.',
        'Training goes on at a plausible lr, so nothing looks wrong; the pretrained backbone is fine-tuned ten times too fast and quietly loses what it knew.',
        "Scale each group's own lr (group['lr'] = group['initial_lr'] * factor) or use an LR scheduler, which keeps the groups' ratios.",
        'https://github.com/JUGGHM/PENet_ICRA2021/issues/29',
        ('watch', 'optimizer', 'lr'),
    ),
    FailureMode(
        "OPT-012", 'Learning rate written outside the scheduler', Severity.WARN,
        "A param group's lr differs from the lr its scheduler set last: something wrote group['lr'] directly while a scheduler is active.",
        'The scheduler overwrites the change at its next step, or a chainable scheduler compounds it; either way the lr the run uses is not the one the config or the log says.',
        'Change the lr through the scheduler (or rebuild the scheduler after writing the groups), never both.',
        'https://github.com/AnswerDotAI/ModernBERT/pull/124',
        ('watch', 'optimizer', 'lr', 'scheduler'),
    ),
    FailureMode(
        "OPT-013", 'Learning rate stuck at 0', Severity.WARN,
        'A param group with trainable tensors has had lr 0 (or below a millionth of its peak) for many consecutive steps, outside a warmup.',
        'Forward, backward and logging all run normally; the weights simply stop moving and the loss plateaus (a scheduler stepped per batch instead of per epoch decays to nothing).',
        "Check the scheduler's cadence and gamma; step per-epoch schedules once per epoch.",
        'https://github.com/Lornatang/SRGAN-PyTorch/issues/1',
        ('watch', 'optimizer', 'lr', 'scheduler'),
    ),
    FailureMode(
        "LOOP-006", 'Schedule stepped too rarely to get through it', Severity.WARN,
        'A schedule sized in optimizer steps (OneCycleLR, a cosine or linear schedule with total steps) is stepped about once per epoch, so by the planned end it has walked only a fraction of its length.',
        'The run never leaves warmup (or never decays): it trains at a small, nearly constant lr, and the loss still falls.',
        "Step a per-step schedule after every optimizer step (Lightning: interval='step'), or size it in epochs.",
        'https://github.com/pytorch/pytorch/issues/65417',
        ('watch', 'loop', 'scheduler'),
    ),
    FailureMode(
        "LOOP-007", 'Scheduler stepped more than once per optimizer step', Severity.WARN,
        "The scheduler's step count grows faster than the optimizer's: it is stepped per batch and again per epoch, per micro-batch under accumulation, or twice in the loop.",
        'The schedule runs ahead of the training: warmup ends early and the lr decays before the run is over; nothing raises.',
        'Call scheduler.step() exactly once per optimizer step (for a per-step schedule) and nowhere else.',
        'https://github.com/aimagelab/meshed-memory-transformer/issues/71',
        ('watch', 'loop', 'scheduler'),
    ),
    FailureMode(
        "LOOP-008", 'Backward calls per optimizer step differ from the declared accumulation', Severity.WARN,
        'The trainer declares gradient accumulation over N micro-batches, but the gradients applied at a step hold a different number of backward passes (zero_grad inside the accumulation window, or a step taken every micro-batch).',
        'The run trains with an effective batch N times smaller (or larger) than configured, and the learning rate tuned for it is wrong; the loss curve looks normal.',
        "Clear gradients only right after optimizer.step(), and step once every N micro-batches (accelerator.accumulate / Trainer's gradient_accumulation_steps do both).",
        'https://github.com/huggingface/accelerate/issues/1299',
        ('watch', 'loop'),
    ),
    FailureMode(
        "MODE-005", 'Frozen eval-mode module switched back to training mode', Severity.WARN,
        'A module that was frozen and in eval mode at the start of the run (a teacher, a frozen BatchNorm backbone) is in training mode at a later step, usually because model.train() at the start of each epoch recursed into it.',
        "Its BatchNorm statistics are overwritten by the fine-tuning data and its dropout turns on, while its parameters stay frozen, so every check of 'frozen' still passes.",
        'Re-apply eval() to the frozen part after every model.train() (or override train() in the module to keep it in eval).',
        'https://github.com/pgniewko/gt-pyg/issues/112',
        ('watch', 'modes', 'frozen'),
    ),
    FailureMode(
        "MODE-006", 'Model left in eval mode during training', Severity.WARN,
        'The model was in training mode at the start of the run and is in eval mode at a later optimizer step: an evaluation called model.eval() and training never called model.train() again.',
        'Dropout is off and BatchNorm uses running statistics for the rest of the epoch; the loss still falls, and the model over-fits or trains differently from what the config says.',
        'Call model.train() at the start of every training epoch (and after each evaluation).',
        'https://github.com/fartashf/vsepp/issues/4',
        ('watch', 'modes'),
    ),
    FailureMode(
        "TIE-003", 'Tied parameters stopped sharing storage', Severity.WARN,
        'Parameters that were one shared tensor at the start of the run (tied embeddings and LM head) are separate tensors now.',
        'Both copies keep training separately and the checkpoint carries two matrices; the model that is evaluated is not the one that was configured, and nothing raises.',
        'Re-tie after any operation that replaces parameters (model.tie_weights() after resizing, loading or moving), and do not assign new nn.Parameter objects to tied slots.',
        'https://github.com/NVIDIA/Megatron-LM/issues/656',
        ('watch', 'weights'),
    ),
    FailureMode(
        "DRIFT-001", 'Frozen tensor changed during training', Severity.WARN,
        'A tensor with requires_grad=False changed value between two sampled steps: the optimizer still holds it with momentum or weight decay and a zero (not None) gradient, or some code writes it.',
        "Freezing is checked by requires_grad, which still says False; the 'frozen' backbone drifts slowly and results do not reproduce.",
        'Remove frozen tensors from the optimizer (or clear their gradients with set_to_none=True and drop their state) when you freeze them.',
        'https://github.com/facebookresearch/fairseq/issues/4702',
        ('watch', 'frozen'),
    ),
    FailureMode(
        "DRIFT-002", 'Running statistics of a frozen eval-mode module changed', Severity.WARN,
        'A BatchNorm-style module that was frozen and in eval mode at the start has running statistics that changed between two sampled steps.',
        'Normalisation of the frozen part now follows the training batches instead of the pretrained statistics; outputs drift while its weights stay bitwise frozen.',
        'Keep the frozen modules in eval mode for every forward (re-apply eval() after model.train()), or use FrozenBatchNorm.',
        'https://github.com/pytorch/pytorch/issues/86590',
        ('watch', 'frozen', 'modes'),
    ),
)


CATALOG: Mapping[str, FailureMode] = MappingProxyType({m.id: m for m in (*_CORE, *_STEP, *_WATCH, *_LORA, *_DIST)})


def catalog() -> list[FailureMode]:
    """Every entry, sorted by id."""
    return sorted(CATALOG.values(), key=lambda m: m.id)


#: how the audit finds the entries: each family measures something the step does and compares it with what the
#: setup declares, so a bug nobody listed is still caught when it breaks the invariant (CATALOG.md's preface)
FAMILIES: tuple[tuple[str, str], ...] = (
    ("what the loss supervises", "the gradient reaching the model's output, per position, against masks, pad "
     "ids, class counts and micro-batches (DATA-005..009, LOOP-004/005/011)"),
    ("what each loss receives", "each loss call's input and target against the domain its function documents: "
     "log-probabilities over the class dim, targets in range, prediction first, unbounded logits, 32-bit "
     "softmax (LOSS-004/005/008, LOSS-010..015, AMP-005)"),
    ("what the first layers receive", "embedding padding rows against the batch's padding, the first layer's "
     "input scale, distinct samples (INPUT-008/009, DATA-012)"),
    ("what a prediction reads", "a prediction's dependence on later tokens in a next-token setup, and on other "
     "samples (INPUT-002, INPUT-010)"),
    ("what the update does", "each tensor before and after an optimizer step against its gradient and the "
     "optimizer's state (OPT-008, GRAD-005, AMP-002/004, INIT-001)"),
    ("what the loop calls", "the order of zero_grad, backward, clip, step and scheduler calls (LOOP-001..013)"),
    ("the whole schedule", "the scheduler walked over the planned run at the real cadence, and what it writes into each param group (SCHED-001..007)"),
    ("modes and randomness", "which parts are stochastic, frozen, in eval mode, updating statistics "
     "(MODE-001..007)"),
    ("inputs and labels against the model", "padding side, masks, special-token ids, EOS in the labels "
     "(INPUT-003..007, DATA-001..004, DATA-010/011)"),
    ("the setup's own flags", "freeze flags and what the step does to them, param groups, optimizer hyper-parameters (OPT-001..018, OPT-022)"),
)


def catalog_markdown() -> str:
    """The text of ``CATALOG.md``."""
    lines = [
        "# guardtower catalog of silent training bugs",
        "",
        "Generated from `guardtower/failure_modes.py` by `guardtower catalog`; do not edit by hand.",
        "",
        "The audit measures what one training step does and judges it by families of invariants; an entry is "
        "one way a family's invariant breaks. Blind-batch figures (reports nobody building the checks had read) "
        "are in README.md; reproduce them with `python bench/blind.py --batch N`.",
        "",
        *[f"- **{name}**: {what}" for name, what in FAMILIES],
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
