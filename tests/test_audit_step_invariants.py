"""The step-invariant families (issue 18): the schedule over the planned run, what the loss supervises, what the
update does. Every entry of ``_STEP`` has a trigger and a clean counterpart; the severity-from-consequence
rules (GRAD-001 for a module that never ran, OPT-002 without optimizer state) have their own tests."""

from __future__ import annotations

import copy
from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from guardtower.errors import ConfigError
from guardtower.failure_modes import _STEP
from guardtower.preflight import audit
from guardtower.severity import Severity

from tests._audit_core_helpers import VOCAB, Case, SmallCNN, case_registry, gpt2, sgd_step, token_batch

CASES, case = case_registry()


def _data(n: int = 16, classes: int = 3, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 8, generator=g), torch.arange(n) % classes


def _classifier(classes: int = 3) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, classes))


# --- the schedule over the planned run ------------------------------------------------------------------------
def _scheduled(build: Callable[[torch.optim.Optimizer], Any], total: int, per_step: int = 1,
               groups: Callable[[nn.Module], Any] | None = None) -> Case:
    """A classifier step under the scheduler ``build`` makes (over ``groups(model)``'s param groups, when given)."""
    m = _classifier()
    opt = torch.optim.AdamW(m.parameters() if groups is None else groups(m), lr=1e-3)
    sched = build(opt)
    x, y = _data()

    def step() -> torch.Tensor:
        opt.zero_grad()
        loss = F.cross_entropy(m(x), y)
        loss.backward()
        opt.step()
        for _ in range(per_step):
            sched.step()
        return loss

    return m, step, {"optimizer": opt, "lr_scheduler": sched, "total_steps": total}


@case("SCHED-001")
def _schedule_built_for_one_epoch(bug: bool) -> Case:
    from transformers import get_linear_schedule_with_warmup

    # 100 batches per epoch, 10 epochs: the schedule must count 1,000 optimizer steps, not 100
    return _scheduled(lambda o: get_linear_schedule_with_warmup(o, 10, 100 if bug else 1000), total=1000)


@case("SCHED-001/steplr-per-batch")
def _steplr_stepped_per_batch(bug: bool) -> Case:
    # StepLR(step_size=100) meant per epoch of 100 batches; stepped per batch it decays 0.1x every batch... 100
    return _scheduled(lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=1 if bug else 100, gamma=0.5),
                      total=300)


@case("SCHED-002")
def _warmup_longer_than_run(bug: bool) -> Case:
    from transformers import get_cosine_schedule_with_warmup

    return _scheduled(lambda o: get_cosine_schedule_with_warmup(o, 2000 if bug else 50, 8000 if bug else 500),
                      total=500)


@case("SCHED-002/unstepped")
def _warmup_longer_than_run_stepped_outside(bug: bool) -> Case:
    # not stepped inside the step: a warmup longer than the run outlasts it at any cadence, while a decay that
    # would end within a few steps walked per step is planned in epochs and stepped per epoch outside
    def factor(k: int) -> float:
        return min(1.0, k / 4000) if bug else 0.5 ** k

    return _scheduled(lambda o: torch.optim.lr_scheduler.LambdaLR(o, factor), total=500, per_step=0)


@case("SCHED-006")
def _schedule_sized_in_micro_batches(bug: bool) -> Case:
    from transformers import get_linear_schedule_with_warmup

    # 2,000 micro-batches, accumulated 4 per update: the schedule must count 500 optimizer steps, not 2,000
    return _scheduled(lambda o: get_linear_schedule_with_warmup(o, 10, 2000 if bug else 500), total=500)


def test_sched_006_leaves_a_schedule_that_never_reaches_zero_alone() -> None:
    # an inverse-square-root decay is meant to run on: walked on, it never reaches ~0
    model, step, kwargs = _scheduled(lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda k: (1 + k) ** -0.5),
                                     total=500)
    assert not audit(model, step, **kwargs).by_id("SCHED-006")


@case("DATA-013")
def _t5_targets_sliced_the_bart_way(bug: bool) -> Case:
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    m = T5ForConditionalGeneration(T5Config(vocab_size=VOCAB, d_model=16, d_kv=8, d_ff=32, num_layers=1,
                                            num_heads=2, pad_token_id=0, eos_token_id=1,
                                            decoder_start_token_id=0)).train()
    g = torch.Generator().manual_seed(3)
    src = torch.randint(2, VOCAB, (4, 8), generator=g)
    tgt = torch.cat([torch.randint(2, VOCAB, (4, 5), generator=g), torch.ones(4, 1, dtype=torch.long)], 1)
    # the fix builds the decoder inputs itself too, by shifting right behind the start token
    batch = ({"decoder_input_ids": tgt[:, :-1], "labels": tgt[:, 1:]} if bug else
             {"decoder_input_ids": m._shift_right(tgt), "labels": tgt})
    return m, lambda: m(input_ids=src, **batch), {"inputs": {"input_ids": src, **batch}}


@case("SCHED-003")
def _schedule_stepped_per_micro_batch(bug: bool) -> Case:
    from transformers import get_cosine_schedule_with_warmup

    return _scheduled(lambda o: get_cosine_schedule_with_warmup(o, 10, 400), total=400, per_step=2 if bug else 1)


@case("SCHED-003/never")
def _onecycle_not_stepped(bug: bool) -> Case:
    return _scheduled(lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=1e-3, total_steps=300), total=300,
                      per_step=0 if bug else 1)


@case("SCHED-005")
def _lambda_returns_the_lr(bug: bool) -> Case:
    peak = 3e-4

    def warmup(step: int) -> float:
        share = min(1.0, (step + 1) / 50)
        return peak * share if bug else share  # an lr where LambdaLR wants a factor

    return _scheduled(lambda o: torch.optim.lr_scheduler.LambdaLR(o, warmup), total=500)


def _resumed(restore: str) -> Case:
    """A run checkpointed after 30 steps of a warmup-cosine schedule, resumed: ``"all"`` builds the scheduler,
    loads its state, then loads the optimizer's (the order that keeps the lr); ``"optimizer"`` restores the
    optimizer only; ``"optimizer_first"`` loads the optimizer's state, then builds the scheduler (which writes its
    first lr into the groups) and loads the scheduler's state (which does not write the restored lr back)."""
    from transformers import get_cosine_schedule_with_warmup

    m = _classifier()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    sched = get_cosine_schedule_with_warmup(opt, 20, 600)
    x, y = _data()
    for _ in range(30):  # the run before the checkpoint
        opt.zero_grad()
        F.cross_entropy(m(x), y).backward()
        opt.step()
        sched.step()
    saved = {"optimizer": opt.state_dict(), "scheduler": sched.state_dict()}
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    if restore == "all":
        sched = get_cosine_schedule_with_warmup(opt, 20, 600)
        sched.load_state_dict(saved["scheduler"])
        opt.load_state_dict(saved["optimizer"])
    else:
        opt.load_state_dict(saved["optimizer"])
        sched = get_cosine_schedule_with_warmup(opt, 20, 600)
        if restore == "optimizer_first":
            sched.load_state_dict(saved["scheduler"])

    def step() -> torch.Tensor:
        opt.zero_grad()
        loss = F.cross_entropy(m(x), y)
        loss.backward()
        opt.step()
        sched.step()
        return loss

    return m, step, {"optimizer": opt, "lr_scheduler": sched, "total_steps": 600}


@case("SCHED-004")
def _resumed_optimizer_with_a_fresh_schedule(bug: bool) -> Case:
    return _resumed("optimizer" if bug else "all")


@case("SCHED-004/lr-written-back")
def _scheduler_built_after_the_optimizer_state(bug: bool) -> Case:
    return _resumed("optimizer_first" if bug else "all")


def test_sched_004_the_resume_order_really_changes_the_first_lr() -> None:
    lrs = {}
    for restore in ("all", "optimizer_first"):
        _, _, kwargs = _resumed(restore)
        lrs[restore] = kwargs["optimizer"].param_groups[0]["lr"]
    assert lrs["optimizer_first"] == 0.0 < lrs["all"]  # the warmup's first lr written back over the restored one


# --- the loop step_fn runs ------------------------------------------------------------------------------------
def _looped(*, steps: int = 1, zero_first: bool = True, scale: float = 1.0, micro: int = 1,
            sched: bool = False) -> Case:
    """A classifier step that runs ``micro`` backward passes, then ``steps`` optimizer steps."""
    m = _classifier()
    opt = torch.optim.Adam(m.parameters(), lr=1e-3)
    schedule = torch.optim.lr_scheduler.LinearLR(opt, 1.0, 0.1, total_iters=500) if sched else None
    x, y = _data()

    def step() -> torch.Tensor:
        if zero_first:
            opt.zero_grad()
        for i in range(micro):
            loss = F.cross_entropy(m(x[i::micro]), y[i::micro]) / micro * scale
            loss.backward()
        for _ in range(steps):
            opt.step()
        if schedule is not None:
            schedule.step()
        return loss

    return m, step, {"optimizer": opt, **({"lr_scheduler": schedule, "total_steps": 500} if sched else {})}


@case("LOOP-009")
def _stepped_twice(bug: bool) -> Case:
    return _looped(steps=2 if bug else 1)


@case("LOOP-010")
def _scheduled_but_never_stepped(bug: bool) -> Case:
    return _looped(steps=0 if bug else 1, sched=True)


@case("LOOP-010/cleared")
def _cleared_and_never_stepped(bug: bool) -> Case:
    return _looped(steps=0 if bug else 1)


class _TinyGAN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.g = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 8))
        self.d = nn.Sequential(nn.Linear(8, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.g(z)


def _gan_setup(seed: int) -> tuple[_TinyGAN, torch.optim.Optimizer, torch.optim.Optimizer, torch.Tensor,
                                   torch.Tensor]:
    """A GAN with an Adam optimizer per part, a latent batch and a real batch."""
    gan = _TinyGAN()
    opt_g, opt_d = (torch.optim.Adam(part.parameters(), lr=2e-4, betas=(0.5, 0.999)) for part in (gan.g, gan.d))
    g = torch.Generator().manual_seed(seed)
    return gan, opt_g, opt_d, torch.randn(8, 4, generator=g), torch.randn(8, 8, generator=g)


@case("LOOP-014")
def _generator_gradient_left_on_the_discriminator(bug: bool) -> Case:
    gan, opt_g, opt_d, z, real = _gan_setup(seed=4)
    ones, zeros = torch.ones(8, 1), torch.zeros(8, 1)

    def step() -> torch.Tensor:
        opt_g.zero_grad()
        if not bug:
            opt_d.zero_grad()
        F.binary_cross_entropy_with_logits(gan.d(gan(z)), ones).backward()  # also fills the discriminator's .grad
        opt_g.step()
        if not bug:
            opt_d.zero_grad()  # the fix: clear what the generator's loss left before the discriminator's backward
        d_loss = (F.binary_cross_entropy_with_logits(gan.d(real), ones)
                  + F.binary_cross_entropy_with_logits(gan.d(gan(z).detach()), zeros)) / 2
        d_loss.backward()
        opt_d.step()
        return d_loss

    return gan, step, {"optimizer": opt_d, "inputs": z}


def test_loop_014_is_quiet_when_one_backward_feeds_two_optimizers() -> None:
    """One loss, one backward, then a step per part: every gradient came from that one backward."""
    gan = _TinyGAN()
    opt_g, opt_d = (torch.optim.SGD(part.parameters(), lr=1e-2) for part in (gan.g, gan.d))
    z = torch.randn(8, 4, generator=torch.Generator().manual_seed(5))

    def step() -> torch.Tensor:
        opt_g.zero_grad()
        opt_d.zero_grad()
        loss = gan.d(gan(z)).pow(2).mean()
        loss.backward()
        opt_g.step()
        opt_d.step()
        return loss

    assert not audit(gan, step, optimizer=opt_d, inputs=z).by_id("LOOP-014")


@case("LOSS-017")
def _adversarial_term_scores_the_real_sample(bug: bool) -> Case:
    gan, opt_g, opt_d, z, real = _gan_setup(seed=6)
    ones, zeros = torch.ones(8, 1), torch.zeros(8, 1)

    def step() -> torch.Tensor:
        opt_g.zero_grad()
        fake = gan(z)
        recon = F.l1_loss(fake, real)
        judged = real if bug else fake  # the bug: the generator's adversarial term scores the real sample
        g_loss = recon + F.binary_cross_entropy_with_logits(gan.d(judged), ones)
        g_loss.backward()
        opt_g.step()
        opt_d.zero_grad()
        d_loss = (F.binary_cross_entropy_with_logits(gan.d(real), ones)
                  + F.binary_cross_entropy_with_logits(gan.d(fake.detach()), zeros)) / 2
        d_loss.backward()
        opt_d.step()
        return g_loss

    return gan, step, {"optimizer": opt_g, "inputs": z}


def test_loss_017_is_quiet_when_one_backward_feeds_both_steps_or_a_step_comes_later() -> None:
    """A critic and an actor term summed into one backward, then both optimizers step: each term trains a part
    that is stepped. An accumulation step that backpropagates without stepping yet judges nothing."""
    gan = _TinyGAN()
    opt_g, opt_d = (torch.optim.SGD(part.parameters(), lr=1e-2) for part in (gan.g, gan.d))
    g = torch.Generator().manual_seed(7)
    z, real = torch.randn(8, 4, generator=g), torch.randn(8, 8, generator=g)

    def joint() -> torch.Tensor:
        opt_g.zero_grad()
        opt_d.zero_grad()
        loss = F.mse_loss(gan.d(real), torch.ones(8, 1)) + F.mse_loss(gan(z), real)
        loss.backward()
        opt_g.step()
        opt_d.step()
        return loss

    def unstepped() -> torch.Tensor:
        loss = F.mse_loss(gan.d(real), torch.ones(8, 1))
        loss.backward()
        return loss

    assert not audit(gan, joint, optimizer=opt_g, inputs=z).by_id("LOSS-017")
    assert not audit(gan, unstepped, optimizer=opt_g, inputs=z).by_id("LOSS-017")


@case("LOOP-012")
def _cleared_inside_the_accumulation_loop(bug: bool) -> Case:
    m = _classifier()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    x, y = _data()

    def step() -> torch.Tensor:
        opt.zero_grad()
        for i in range(4):
            if bug:
                opt.zero_grad()
            loss = F.cross_entropy(m(x[i::4]), y[i::4]) / 4
            loss.backward()
        opt.step()
        return loss

    return m, step, {"optimizer": opt}


def test_a_two_pass_step_that_perturbs_the_weights_between_its_backwards_is_not_loop_012() -> None:
    """SAM: backward, move the weights to the adversarial point, zero_grad, backward again, restore, step."""
    m = _classifier()
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    x, y = _data()

    def step() -> torch.Tensor:
        opt.zero_grad()
        F.cross_entropy(m(x), y).backward()
        with torch.no_grad():
            shifts = [0.05 * p.grad / (p.grad.norm() + 1e-12) for p in m.parameters()]
            for p, e in zip(m.parameters(), shifts):
                p.add_(e)
        opt.zero_grad()
        loss = F.cross_entropy(m(x), y)
        loss.backward()
        with torch.no_grad():
            for p, e in zip(m.parameters(), shifts):
                p.sub_(e)
        opt.step()
        return loss

    assert not audit(m, step, optimizer=opt).by_id("LOOP-012")


@case("LOOP-011")
def _divided_by_the_window_twice(bug: bool) -> Case:
    return _looped(micro=4, scale=0.25 if bug else 1.0)


# --- the setup's own flags -------------------------------------------------------------------------------------
@case("OPT-014")
def _module_attribute_instead_of_requires_grad_(bug: bool) -> Case:
    m = _classifier()
    if bug:
        m[0].requires_grad = False  # an attribute on the module: its parameters still train
    else:
        m[0].requires_grad_(False)
    opt = torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.1)
    x, y = _data()
    return m, lambda: F.cross_entropy(m(x), y), {"optimizer": opt, "inputs": x}


@case("OPT-015")
def _weight_decay_in_the_momentum_slot(bug: bool) -> Case:
    m = _classifier()
    opt = (torch.optim.SGD(m.parameters(), 0.05, 1e-4) if bug
           else torch.optim.SGD(m.parameters(), 0.05, momentum=0.9, weight_decay=1e-4))
    x, y = _data()
    return m, lambda: F.cross_entropy(m(x), y), {"optimizer": opt, "inputs": x}


@case("LOSS-010")
def _kl_div_averaged_over_classes(bug: bool) -> Case:
    student, teacher = _classifier(), _classifier(classes=3)
    teacher.requires_grad_(False)
    opt = torch.optim.AdamW(student.parameters(), lr=1e-3)
    x, y = _data()
    kl = nn.KLDivLoss(reduction="mean" if bug else "batchmean")

    def step() -> torch.Tensor:
        soft = kl(F.log_softmax(student(x) / 2, -1), F.softmax(teacher(x) / 2, -1))
        return 0.5 * F.cross_entropy(student(x), y) + 0.5 * 4 * soft

    return student, step, {"optimizer": opt, "inputs": x}


class _Stacked(nn.Module):
    def __init__(self, registered: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        blocks = [nn.Linear(8, 8) for _ in range(2)]
        self.blocks = nn.ModuleList(blocks) if registered else blocks
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + torch.relu(block(x))
        return self.head(x)


@case("OPT-016")
def _blocks_in_a_python_list(bug: bool) -> Case:
    m = _Stacked(registered=not bug)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    x, y = _data()
    return m, lambda: F.cross_entropy(m(x), y), {"optimizer": opt, "inputs": x}


@case("OPT-017")
def _group_filter_matches_nothing(bug: bool) -> Case:
    m = _classifier()
    prefix = "encoder." if bug else "0."  # the first layer is "0.", not "encoder."
    first = [p for n, p in m.named_parameters() if n.startswith(prefix)]
    rest = [p for n, p in m.named_parameters() if not n.startswith(prefix)]
    opt = torch.optim.AdamW([{"params": first, "lr": 1e-4}, {"params": rest, "lr": 1e-3}])
    x, y = _data()
    return m, lambda: F.cross_entropy(m(x), y), {"optimizer": opt, "inputs": x}


@case("INPUT-006")
def _bos_added_twice(bug: bool) -> Case:
    model = gpt2(bos_token_id=1, eos_token_id=2, pad_token_id=0)
    batch = token_batch(seed=3)
    ids = batch["input_ids"].clone()
    ids[:, 0] = 1
    if bug:
        ids[:, 1] = 1
    batch = {"input_ids": ids, "attention_mask": batch["attention_mask"], "labels": ids.clone()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return model, lambda: model(**batch).loss, {"optimizer": opt, "inputs": batch}


class _TinyEncoder(nn.Module):
    """An nn.TransformerEncoder classifier fed the tokenizer's 0/1 attention_mask."""

    def __init__(self, cast_to_float: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, 16)
        layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)
        self.head = nn.Linear(16, 2)
        self.cast_to_float = cast_to_float

    def forward(self, ids: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        ignore = (1 - keep).float() if self.cast_to_float else keep == 0  # float 0/1 is added to the scores
        return self.head(self.encoder(self.embed(ids), src_key_padding_mask=ignore)[:, 0])


@case("INPUT-007")
def _float_keep_mask_to_attention(bug: bool) -> Case:
    model = _TinyEncoder(cast_to_float=bug)
    ids = torch.randint(1, VOCAB, (4, 10), generator=torch.Generator().manual_seed(5))
    keep = torch.ones(4, 10, dtype=torch.long)
    keep[1, 6:] = 0
    keep[3, 4:] = 0
    y = torch.tensor([0, 1, 1, 0])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return model, lambda: F.cross_entropy(model(ids, keep), y), {"optimizer": opt, "inputs": (ids, keep)}


@case("INPUT-004/foreign-id")
def _bert_padded_with_another_id_without_mask(bug: bool) -> Case:
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    model = BertForSequenceClassification(BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=32, pad_token_id=0, num_labels=2))
    lengths = (10, 6, 3, 8)
    g = torch.Generator().manual_seed(4)
    filler = 7 if bug else 0
    ids = torch.full((4, 12), filler)
    for r, n in enumerate(lengths):
        ids[r, :n] = torch.randint(10, VOCAB, (n,), generator=g)
    labels = torch.tensor([0, 1, 1, 0])
    batch: dict[str, torch.Tensor] = {"input_ids": ids, "labels": labels}
    if not bug:
        batch["attention_mask"] = (ids != 0).long()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return model, lambda: model(**batch).loss, {"optimizer": opt, "inputs": batch}


def test_a_warmup_then_decay_schedule_over_its_own_length_is_quiet() -> None:
    from transformers import get_linear_schedule_with_warmup

    model, step, kwargs = _scheduled(lambda o: get_linear_schedule_with_warmup(o, 30, 300), total=300)
    report = audit(model, step, **kwargs)
    assert not [f for f in report if f.catalog_id.startswith("SCHED-")], str(report)


def test_the_scheduler_a_step_advances_is_put_back() -> None:
    model, step, kwargs = CASES["SCHED-003"](True)
    sched, opt = kwargs["lr_scheduler"], kwargs["optimizer"]
    before, lr = sched.state_dict(), opt.param_groups[0]["lr"]
    audit(model, step, **kwargs)
    assert sched.state_dict() == before and opt.param_groups[0]["lr"] == lr


def test_a_scheduler_attached_to_the_optimizer_is_found_without_lr_scheduler() -> None:
    model, step, kwargs = CASES["SCHED-001"](True)
    del kwargs["lr_scheduler"]
    assert audit(model, step, **kwargs).by_id("SCHED-001")


@pytest.mark.parametrize("bad", [0, -5, 2.5, True, "1000"])
def test_total_steps_must_be_a_positive_whole_number(bad: Any) -> None:
    model, step, kwargs = CASES["SCHED-001"](False)
    with pytest.raises(ConfigError, match="total_steps"):
        audit(model, step, **{**kwargs, "total_steps": bad})


def test_overfitting_runs_at_the_schedules_peak_lr_and_says_so() -> None:
    from transformers import get_linear_schedule_with_warmup

    m = _classifier()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    sched = get_linear_schedule_with_warmup(opt, 100, 1000)  # lr 0 at the first step
    x, y = _data()
    report = audit(m, lambda: F.cross_entropy(m(x), y), optimizer=opt, lr_scheduler=sched, total_steps=1000,
                   steps=15)
    assert not report.by_id("LOSS-009"), str(report)  # a correct setup, overfit at lr 1e-2, not at 0
    assert opt.param_groups[0]["lr"] == 0.0


# --- what the loss supervises ---------------------------------------------------------------------------------
def _padded_lm_batch() -> dict[str, torch.Tensor]:
    batch = token_batch(seq=12)
    ids, mask = batch["input_ids"].clone(), torch.ones_like(batch["input_ids"])
    ids[1:, 8:], mask[1:, 8:] = 5, 0  # right padding with id 5
    return {"input_ids": ids, "attention_mask": mask}


@case("DATA-005")
def _custom_loss_over_padding(bug: bool) -> Case:
    model = gpt2(pad_token_id=5)
    batch = _padded_lm_batch()

    def step() -> torch.Tensor:
        logits = model(**batch).logits[:, :-1]
        target = batch["input_ids"][:, 1:]
        if not bug:  # the fix: padding positions leave the loss
            target = target.masked_fill(batch["attention_mask"][:, 1:] == 0, -100)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))

    return model, step, {"inputs": batch}


@case("DATA-005/label-pad-id")
def _seq2seq_labels_padded_with_pad_id(bug: bool) -> Case:
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    model = T5ForConditionalGeneration(T5Config(vocab_size=40, d_model=16, d_kv=4, d_ff=32, num_layers=1,
                                                num_heads=2, decoder_start_token_id=0, pad_token_id=0,
                                                eos_token_id=1))
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(2, 40, (4, 8), generator=g)
    labels = torch.randint(2, 40, (4, 6), generator=g)
    labels[:, 3:] = 0 if bug else -100  # label padding: the pad id, where -100 belongs
    labels[:, 3] = 1  # EOS
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}
    return model, lambda: model(**batch), {"inputs": batch}


class _GRULanguageModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.rnn, self.head = nn.Embedding(VOCAB, 16), nn.GRU(16, 16, batch_first=True), nn.Linear(16, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(self.emb(ids))[0])


@case("DATA-005/inferred-pad-id")
def _hand_written_lm_over_padding_nothing_declares(bug: bool) -> Case:
    # no mask, no config: only the batch shows that 0 pads the rows (padded to the longest)
    model = _GRULanguageModel()
    ids = torch.randint(1, VOCAB, (4, 10), generator=torch.Generator().manual_seed(4))
    for row, length in enumerate((10, 7, 5, 8)):
        ids[row, length:] = 0

    def step() -> torch.Tensor:
        logits, target = model(ids)[:, :-1], ids[:, 1:]
        if not bug:
            target = target.masked_fill(target == 0, -100)
        return F.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1))

    return model, step, {"inputs": ids}


def test_a_token_that_also_occurs_inside_rows_is_not_inferred_as_padding() -> None:
    model = _GRULanguageModel()
    ids = torch.randint(1, VOCAB, (4, 10), generator=torch.Generator().manual_seed(4))
    ids[:, -2:] = 3  # every row ends alike, and 3 is an ordinary token elsewhere
    ids[0, 2] = 3
    ids[1, 6:] = 3

    def step() -> torch.Tensor:
        return F.cross_entropy(model(ids)[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))

    assert not audit(model, step, inputs=ids).by_id("DATA-005")


def _packed_llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                        num_attention_heads=2, max_position_embeddings=32, attn_implementation="sdpa"))


@case("DATA-019")
def _packed_labels_without_a_separator(bug: bool) -> Case:
    model = _packed_llama()
    ids = torch.randint(1, VOCAB, (1, 18), generator=torch.Generator().manual_seed(12))
    positions = torch.cat([torch.arange(n) for n in (6, 5, 7)])[None]
    labels = ids.clone() if bug else ids.masked_fill(positions == 0, -100)
    batch = {"input_ids": ids, "position_ids": positions, "labels": labels, "use_cache": False}
    return model, lambda: model(**batch).loss, {"inputs": batch}


@case("INPUT-012")
def _packed_rows_with_an_all_ones_mask(bug: bool) -> Case:
    # three examples packed per row, position_ids restarting at each; with a 2-D all-ones attention_mask too the
    # model takes the plain causal path and each example attends the ones before it (so it does with a cache, and
    # under eager attention, which ignores packed position_ids)
    model = _packed_llama()
    ids = torch.randint(1, VOCAB, (2, 18), generator=torch.Generator().manual_seed(7))
    positions = torch.cat([torch.arange(n) for n in (6, 5, 7)]).expand(2, -1)
    labels = ids.masked_fill(positions == 0, -100)
    batch = {"input_ids": ids, "position_ids": positions, "labels": labels, "use_cache": False}
    if bug:
        batch["attention_mask"] = torch.ones_like(ids)
    return model, lambda: model(**batch).loss, {"inputs": batch}


@case("DATA-016")
def _prompt_masked_by_column_on_left_padding(bug: bool) -> Case:
    model = gpt2(pad_token_id=5)
    g = torch.Generator().manual_seed(8)
    lengths, width, prompt = (12, 9, 7), 12, 4
    ids = torch.full((3, width), 5)
    mask = torch.zeros(3, width, dtype=torch.long)
    for row, n in enumerate(lengths):
        ids[row, width - n:] = torch.randint(6, VOCAB, (n,), generator=g)
        mask[row, width - n:] = 1
    labels = ids.masked_fill(mask == 0, -100)
    if bug:
        labels[:, :prompt] = -100  # columns: on the short rows, padding
    else:
        labels[(mask == 1) & (mask.cumsum(1) - 1 < prompt)] = -100  # the first real tokens of each row
    positions = (mask.cumsum(1) - 1).clamp(min=0)  # GPT-2's absolute positions, left padding
    batch = {"input_ids": ids, "attention_mask": mask, "position_ids": positions, "labels": labels}
    return model, lambda: model(**batch), {"inputs": batch}


class _Forecaster(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.rnn, self.out = nn.LSTM(2, 16, batch_first=True), nn.Linear(16, 2)

    def forward(self, window: torch.Tensor) -> torch.Tensor:
        return self.out(self.rnn(window)[0][:, -1])


@case("DATA-017")
def _forecast_label_shifted_the_wrong_way(bug: bool) -> Case:
    # sliding windows of a two-channel series; the label is the step before the window's end, not the one after
    series = torch.randn(60, 2, generator=torch.Generator().manual_seed(9)).cumsum(0)
    starts = range(0, 40, 2)
    windows = torch.stack([series[s:s + 10] for s in starts])
    labels = torch.stack([series[s + 8] if bug else series[s + 10] for s in starts])
    m = _Forecaster()
    return m, lambda: F.mse_loss(m(windows), labels), {"inputs": windows}


def _nt_xent(z1: torch.Tensor, z2: torch.Tensor) -> torch.Tensor:
    z = F.normalize(torch.cat([z1, z2]), dim=1)
    n = z1.shape[0]
    sim = (z @ z.t() / 0.5).masked_fill(torch.eye(2 * n, dtype=torch.bool), float("-inf"))
    return F.cross_entropy(sim, torch.cat([torch.arange(n, 2 * n), torch.arange(0, n)]))


def _encoder(dropout: float = 0.0) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(dropout), nn.Linear(16, 8))


@case("DATA-018")
def _both_embeddings_from_the_first_view(bug: bool) -> Case:
    enc = _encoder()
    g = torch.Generator().manual_seed(10)
    base = torch.randn(6, 8, generator=g)
    aug1, aug2 = base + 0.1 * torch.randn(6, 8, generator=g), base.flip(-1)
    return enc, lambda: _nt_xent(enc(aug1), enc(aug1 if bug else aug2)), {"inputs": aug1}


def test_data_018_is_quiet_when_dropout_makes_the_views_or_one_forward_only_logs() -> None:
    # SimCSE: the same sentences twice, dropout as the augmentation; and a second forward read for a metric only
    enc = _encoder(dropout=0.1).train()
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(11))
    assert not audit(enc, lambda: _nt_xent(enc(x), enc(x)), inputs=x).by_id("DATA-018")
    clf, (x, y) = _classifier(), _data()

    def step() -> torch.Tensor:
        loss = F.cross_entropy(clf(x), y)
        _ = (clf(x).argmax(1) == y).float().mean()  # accuracy, from a second forward the loss never reads
        return loss

    assert not audit(clf, step, inputs=x).by_id("DATA-018")


@case("DATA-006")
def _labels_not_shifted(bug: bool) -> Case:
    model = gpt2()
    ids = token_batch(seq=12)["input_ids"]

    def step() -> torch.Tensor:
        logits = model(input_ids=ids).logits
        if bug:  # predicts the token it is given
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids.reshape(-1))
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))

    return model, step, {"inputs": {"input_ids": ids}}


@case("DATA-007")
def _batch_sorted_by_label(bug: bool) -> Case:
    m = _classifier()
    x, y = _data(n=12)
    if bug:
        y = torch.zeros_like(y)  # an unshuffled loader over a dataset sorted by class
    return m, lambda: F.cross_entropy(m(x), y), {"inputs": x}


@case("DATA-008")
def _weights_proportional_to_counts(bug: bool) -> Case:
    m = _classifier()
    x, _ = _data(n=16)
    y = torch.tensor([0] * 10 + [1] * 4 + [2] * 2)
    counts = torch.bincount(y).float()
    weights = counts / counts.sum() if bug else counts.sum() / (3 * counts)
    return m, lambda: F.cross_entropy(m(x), y, weight=weights), {"inputs": x}


class _BiEncoder(nn.Module):
    """Bag-of-tokens query and passage towers, in-batch negatives: scores[i, j] = q_i . p_j / T."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.query, self.passage = nn.EmbeddingBag(VOCAB, 16), nn.EmbeddingBag(VOCAB, 16)

    def forward(self, queries: torch.Tensor, passages: torch.Tensor) -> torch.Tensor:
        q, p = F.normalize(self.query(queries), dim=-1), F.normalize(self.passage(passages), dim=-1)
        return q @ p.t() / 0.05


def _in_batch_negatives(passages: torch.Tensor) -> Case:
    m = _BiEncoder()
    queries = torch.randint(0, VOCAB, (8, 6), generator=torch.Generator().manual_seed(1))
    return m, lambda: F.cross_entropy(m(queries, passages), torch.arange(8)), {"inputs": (queries, passages)}


@case("DATA-014")
def _one_passage_positive_of_two_queries(bug: bool) -> Case:
    passages = torch.randint(0, VOCAB, (8, 6), generator=torch.Generator().manual_seed(2))
    if bug:
        passages[5] = passages[2]  # two questions with the same answer passage, both in one batch
    return _in_batch_negatives(passages)


def test_data_014_is_quiet_on_ties_a_relu_or_a_mask_makes() -> None:
    # NT-Xent masks each sample's similarity to itself with -inf, and a ReLU'd score matrix ties at 0: neither is
    # the same item as positive and negative
    torch.manual_seed(0)
    enc = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(3))
    views = torch.cat([x + 0.1, x.flip(-1)])

    def nt_xent() -> torch.Tensor:
        z = F.normalize(enc(views), dim=1)
        sim = (z @ z.t() / 0.5).masked_fill(torch.eye(12, dtype=torch.bool), float("-inf"))
        return F.cross_entropy(sim, torch.cat([torch.arange(6, 12), torch.arange(0, 6)]))

    assert not audit(enc, nt_xent, inputs=views).by_id("DATA-014")
    head = nn.Sequential(nn.Linear(8, 16), nn.ReLU())
    y = torch.arange(12) % 16
    assert not audit(head, lambda: F.cross_entropy(head(views), y), inputs=views).by_id("DATA-014")


def test_data_014_is_quiet_when_a_mask_fill_of_minus_1e9_sits_among_the_candidates() -> None:
    # SLIP's SimCLR masks each view's similarity to itself with -1e9 (not -inf): the fill must not widen the
    # tolerance a tie is judged with, or every candidate ties the positive
    torch.manual_seed(0)
    enc = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
    views = _two_views()
    report = audit(enc, lambda: _simclr(enc(views), other_half=True), inputs=views)
    assert not report.by_id("DATA-014") and not report.by_id("DATA-020"), str(report)


def _two_views() -> torch.Tensor:
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(3))
    return torch.cat([x + 0.1 * torch.randn(6, 8, generator=torch.Generator().manual_seed(4)), x.flip(-1)])


def _simclr(z: torch.Tensor, other_half: bool, tau: float = 0.1) -> torch.Tensor:
    """SLIP's SIMCLRLoss: each anchor of the first view against the second view's and its own view's embeddings."""
    n = z.shape[0] // 2
    q_a = F.normalize(z[:n], dim=-1)
    q_b = F.normalize(z[n:] if other_half else z[:n], dim=-1)
    labels, masks = torch.arange(n), torch.eye(n) * 1e9
    logits_ab, logits_aa = q_a @ q_b.t() / tau, q_a @ q_a.t() / tau - masks
    return F.cross_entropy(torch.cat([logits_ab, logits_aa], dim=1), labels)


@case("DATA-020")
def _simclr_views_sliced_from_one_half(bug: bool) -> Case:
    torch.manual_seed(0)
    enc = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
    views = _two_views()
    return enc, lambda: _simclr(enc(views), other_half=not bug), {"inputs": views}


class _TwoHeads(nn.Module):
    """A token head (0 marks padding among its labels) and a sentence head (0 is a class) on one GRU."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.rnn = nn.Embedding(VOCAB, 16), nn.GRU(16, 16, batch_first=True)
        self.tokens, self.sentence = nn.Linear(16, VOCAB), nn.Linear(16, 2)

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.rnn(self.emb(ids))[0]
        return self.tokens(h), self.sentence(h[:, -1])


@case("DATA-015")
def _one_criterion_for_token_and_sentence_heads(bug: bool) -> Case:
    m = _TwoHeads()
    g = torch.Generator().manual_seed(6)
    tokens = torch.randint(2, VOCAB, (8, 6), generator=g)
    masked = torch.rand(8, 6, generator=g) < 0.3
    ids = tokens.masked_fill(masked, 1)  # 1: the mask token, as masked-LM pre-training feeds it
    token_labels = torch.where(masked, tokens, torch.zeros_like(tokens))  # 0: no target
    is_next = torch.tensor([1, 0, 1, 0, 0, 1, 0, 1])
    criterion = nn.CrossEntropyLoss(ignore_index=0)

    def step() -> torch.Tensor:
        tokens, sentence = m(ids)
        head_loss = criterion if bug else nn.CrossEntropyLoss()
        return criterion(tokens.reshape(-1, VOCAB), token_labels.reshape(-1)) + head_loss(sentence, is_next)

    return m, step, {"inputs": ids}


def _accumulated(divide: bool, equal_tokens: bool = True, k: int = 2) -> Case:
    m = _classifier()
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    x, y = _data(n=12)
    sizes = [6, 6] if equal_tokens else [9, 3]
    chunks = list(zip(x.split(sizes), y.split(sizes)))

    def step() -> torch.Tensor:
        opt.zero_grad()
        total = 0.0
        for xb, yb in chunks[:k]:
            loss = F.cross_entropy(m(xb), yb)
            (loss / k if divide else loss).backward()
            total += float(loss)
        opt.step()
        return loss

    return m, step, {"optimizer": opt, "inputs": x}


@case("LOOP-004")
def _accumulated_losses_summed(bug: bool) -> Case:
    return _accumulated(divide=not bug)


@case("LOOP-004/reported-mean")
def _preference_losses_accumulated_undivided(bug: bool) -> Case:
    # a pairwise ranking loss (nothing the supervision measurement weighs per class), accumulated over 3
    # micro-batches; the step reports the mean of the undivided micro-batch losses, as a logging loop does
    m = _classifier(classes=1)
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    x, _ = _data(n=12)
    pairs = list(zip(x[:6].split(2), x[6:].split(2)))

    def step() -> torch.Tensor:
        opt.zero_grad()
        losses = []
        for better, worse in pairs:
            loss = -F.logsigmoid(m(better) - m(worse)).mean()
            (loss if bug else loss / len(pairs)).backward()
            losses.append(loss.detach())
        opt.step()
        return torch.stack(losses).mean()

    return m, step, {"optimizer": opt, "inputs": x}


@case("LOOP-004/graphs")
def _micro_batch_means_backpropagated_undivided(bug: bool) -> Case:
    """Four micro-batches of a reconstruction + sparsity objective, each mean loss backpropagated as it is, then
    clipping and one step; the step returns the detached loss of a fresh forward, which says nothing about the
    backpropagated sum. The twin divides each micro-batch's loss by 4."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
    opt = torch.optim.Adam(m.parameters(), lr=1e-3)
    x = torch.randn(4, 6, 8, generator=torch.Generator().manual_seed(5))

    def objective(batch: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(m(batch), batch) + 1e-2 * m[0](batch).abs().sum(-1).mean()

    def step() -> torch.Tensor:
        for batch in x:
            loss = objective(batch)
            (loss if bug else loss / len(x)).backward()
        nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        return objective(x[-1]).detach()

    return m, step, {"optimizer": opt, "inputs": x[0]}


@case("LOOP-004/weighted-terms-under-a-wrapper")
def _weighted_micro_batch_losses_through_a_backward_wrapper(bug: bool) -> Case:
    """A trainer-style step: three micro-batches, each a weighted sum of two mean terms, backpropagated through a
    wrapper that divides by its own accumulation count (1 here, as Accelerate's is under a Trainer that divides
    itself); the trainer steps the optimizer outside step_fn. The bug skips the trainer's division by 3."""
    m = _classifier()
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    x, y = _data(n=12)

    def wrapper_backward(loss: torch.Tensor, accumulation: int = 1) -> None:
        (loss / accumulation).backward()

    def step() -> None:
        for xb, yb in zip(x.split(4), y.split(4)):
            out = m(xb)
            loss = 0.5 * F.cross_entropy(out, yb) + 0.5 * out.pow(2).mean()
            wrapper_backward(loss if bug else loss / 3)

    return m, step, {"optimizer": opt, "inputs": x}


def test_loop_004_is_quiet_for_two_tasks_on_their_own_batches_each_through_its_own_head() -> None:
    """Multi-task learning: each task's batch goes through the shared trunk and its own head, and its mean loss is
    backpropagated as it is before one step; the gradients of different objectives are meant to add up (the
    passes reach different heads: not micro-batches of one objective)."""
    class TwoTasks(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.trunk = nn.Sequential(nn.Linear(8, 16), nn.ReLU())
            self.heads = nn.ModuleDict({"a": nn.Linear(16, 3), "b": nn.Linear(16, 3)})

        def forward(self, x: torch.Tensor, task: str) -> torch.Tensor:
            return self.heads[task](self.trunk(x))

    model = TwoTasks()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(9)
    tasks = [("a", torch.randn(6, 8, generator=g), torch.randint(0, 3, (6,), generator=g)),
             ("b", torch.randn(6, 8, generator=g), torch.randint(0, 3, (6,), generator=g))]

    def step() -> None:
        opt.zero_grad()
        for head, x, y in tasks:
            F.cross_entropy(model(x, head), y).backward()
        opt.step()

    assert not audit(model, step, optimizer=opt, inputs=tasks[0][1]).by_id("LOOP-004")


def test_loop_004_is_quiet_for_two_objectives_of_one_batch_backpropagated_one_after_the_other() -> None:
    """Two tasks of one batch, each with its own forward and backward before one step: the gradients are meant
    to add up (not micro-batches: both forwards read the same tensors)."""
    m = _classifier()
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    x, y = _data(n=12)

    def step() -> None:
        opt.zero_grad()
        F.cross_entropy(m(x), y).backward()
        m(x).pow(2).mean().backward()
        opt.step()

    assert not audit(m, step, optimizer=opt, inputs=x).by_id("LOOP-004")


def test_loop_004_is_quiet_for_loss_terms_of_one_forward_backpropagated_one_by_one() -> None:
    # two terms of one forward, each backpropagated (retain_graph) and the mean reported: not micro-batches
    m = _classifier()
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    x, y = _data(n=12)

    def step() -> torch.Tensor:
        opt.zero_grad()
        out = m(x)
        terms = [F.cross_entropy(out, y), out.pow(2).mean()]
        terms[0].backward(retain_graph=True)
        terms[1].backward()
        opt.step()
        return torch.stack([t.detach() for t in terms]).mean()

    assert not audit(m, step, optimizer=opt, inputs=x).by_id("LOOP-004")


@case("LOOP-005")
def _micro_batch_means_of_different_sizes(bug: bool) -> Case:
    if not bug:  # the fix: one mean over the whole step (sum per micro-batch over the step's count)
        m = _classifier()
        opt = torch.optim.SGD(m.parameters(), lr=0.01)
        x, y = _data(n=12)
        chunks = list(zip(x.split([9, 3]), y.split([9, 3])))

        def step() -> torch.Tensor:
            opt.zero_grad()
            for xb, yb in chunks:
                loss = F.cross_entropy(m(xb), yb, reduction="sum") / 12
                loss.backward()
            opt.step()
            return loss

        return m, step, {"optimizer": opt, "inputs": x}
    return _accumulated(divide=True, equal_tokens=False)


def test_a_correct_padded_causal_lm_batch_supervises_no_padding() -> None:
    model = gpt2(pad_token_id=5)
    batch = _padded_lm_batch()
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    report = audit(model, lambda: model(**batch, labels=labels), inputs={**batch, "labels": labels})
    assert not report.by_id("DATA-005") and not report.by_id("DATA-006"), str(report)


def test_a_balanced_weighting_and_small_batches_are_no_one_class_finding() -> None:
    m = _classifier(classes=2)
    x, _ = _data(n=4)
    y = torch.zeros(4, dtype=torch.long)  # four of one class out of two: chance 1 in 8, not a finding
    assert not audit(m, lambda: F.cross_entropy(m(x), y)).by_id("DATA-007")


@case("DATA-009")
def _class_weights_at_batch_size_one(bug: bool) -> Case:
    m = _classifier(classes=2)
    x, _ = _data(n=1 if bug else 8)
    y = torch.ones(1 if bug else 8, dtype=torch.long)
    if not bug:
        y[::2] = 0
    return m, lambda: F.cross_entropy(m(x), y, weight=torch.tensor([1.0, 10.0])), {"inputs": x}


# --- what the update does -------------------------------------------------------------------------------------
class _Backbone(nn.Module):
    def __init__(self, no_grad: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.backbone = nn.Linear(8, 16)
        self.head = nn.Linear(16, 3)
        self.no_grad = no_grad

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.no_grad:
            with torch.no_grad():
                h = self.backbone(x)
        else:
            h = self.backbone(x)
        return self.head(torch.relu(h))


class _DecayAll(torch.optim.SGD):
    """A wrapper applying decoupled weight decay to every tensor that requires grad (as some repos do)."""

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                if p.requires_grad:
                    p.mul_(1 - 0.01)
        return super().step(closure)


@case("OPT-008")
def _no_grad_backbone_decayed(bug: bool) -> Case:
    m = _Backbone(no_grad=bug)
    if not bug:
        m.backbone.requires_grad_(False)
    opt = _DecayAll(m.parameters(), lr=0.01)
    x, y = _data()
    return m, lambda: F.cross_entropy(m(x), y), {"optimizer": opt}


def _new_token_row(weight_decay: float, write_back: bool) -> Case:
    """Textual inversion: only the new token's embedding row may train; the others' gradient is zeroed after
    backward, and ``write_back`` puts their original values back after the optimizer step (diffusers' fix)."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Embedding(20, 8), nn.Flatten(), nn.Linear(32, 2))
    m[2].requires_grad_(False)
    opt = torch.optim.AdamW(m[0].parameters(), lr=1e-2, weight_decay=weight_decay)
    ids = torch.tensor([[1, 2, 3, 19], [4, 5, 19, 6]])
    keep = torch.arange(20) != 19  # only the new token's row may train
    original = m[0].weight.detach().clone()

    def step() -> torch.Tensor:
        opt.zero_grad()
        loss = F.cross_entropy(m(ids), torch.tensor([0, 1]))
        loss.backward()
        m[0].weight.grad[keep] = 0
        opt.step()
        if write_back:
            with torch.no_grad():
                m[0].weight[keep] = original[keep]
        return loss

    return m, step, {"optimizer": opt, "inputs": ids}


@case("OPT-008/zeroed-rows")
def _embedding_rows_zeroed_after_backward(bug: bool) -> Case:
    return _new_token_row(0.1 if bug else 0.0, write_back=False)


def test_opt_008_leaves_rows_the_step_writes_back_after_its_optimizer_step_alone() -> None:
    """The decay moves the zeroed rows in the optimizer step, and the step itself writes them back right after:
    the step, as a whole, leaves them where they were."""
    model, step, kwargs = _new_token_row(0.1, write_back=True)
    assert not audit(model, step, **kwargs).by_id("OPT-008")


@case("AMP-004")
def _clip_before_unscale(bug: bool) -> Case:
    m = _classifier()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16)
    x, y = _data()

    def step() -> torch.Tensor:
        opt.zero_grad()
        loss = F.cross_entropy(m(x), y)
        scaler.scale(loss).backward()
        if not bug:
            scaler.unscale_(opt)
        nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        return loss

    return m, step, {"optimizer": opt, "scaler": scaler}


# --- what each loss receives, against its function's domain ---------------------------------------------------
class _FrameTagger(nn.Module):
    """Per-frame class logits (T, N, C) from a GRU, for CTC."""

    def __init__(self, classes: int = 6) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.rnn = nn.GRU(8, 16)
        self.out = nn.Linear(16, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.rnn(x)[0])


@case("LOSS-011")
def _nll_over_the_batch_dim(bug: bool) -> Case:
    m = _classifier()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    x, y = _data()
    return m, lambda: F.nll_loss(F.log_softmax(m(x), dim=0 if bug else 1), y), {"optimizer": opt, "inputs": x}


@case("LOSS-011/ctc-logits")
def _ctc_on_raw_logits(bug: bool) -> Case:
    m = _FrameTagger()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(2)
    frames, targets = torch.randn(12, 3, 8, generator=g), torch.randint(1, 6, (3, 4), generator=g)
    lengths, target_lengths = torch.full((3,), 12), torch.full((3,), 4)

    def loss() -> torch.Tensor:
        out = m(frames)
        return F.ctc_loss(out if bug else out.log_softmax(-1), targets, lengths, target_lengths)

    return m, loss, {"optimizer": opt, "inputs": frames}


@case("LOSS-012")
def _bce_on_signed_labels(bug: bool) -> Case:
    m = _classifier(classes=1)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    x, y = _data(classes=2)
    target = (y.float() * 2 - 1) if bug else y.float()  # -1/+1 labels from an SVM-style dataset
    return m, lambda: F.binary_cross_entropy_with_logits(m(x).squeeze(-1), target), {"optimizer": opt, "inputs": x}


def _distilled(build: Callable[[nn.Module, nn.Module, torch.Tensor], torch.Tensor]) -> Case:
    student, teacher = _classifier(), _classifier()
    teacher.requires_grad_(False)
    opt = torch.optim.AdamW(student.parameters(), lr=1e-3)
    x, y = _data()
    return student, lambda: F.cross_entropy(student(x), y) + build(student, teacher, x), {"optimizer": opt,
                                                                                            "inputs": x}


@case("LOSS-012/kl-log-target")
def _kl_div_log_target_without_the_flag(bug: bool) -> Case:
    def kl(student: nn.Module, teacher: nn.Module, x: torch.Tensor) -> torch.Tensor:
        t = teacher(x)
        return F.kl_div(F.log_softmax(student(x), -1), F.log_softmax(t, -1) if bug else F.softmax(t, -1),
                        reduction="batchmean")

    return _distilled(kl)


@case("LOSS-013")
def _kl_div_arguments_swapped(bug: bool) -> Case:
    def kl(student: nn.Module, teacher: nn.Module, x: torch.Tensor) -> torch.Tensor:
        s, t = student(x), teacher(x)
        if bug:  # (target, input): KL(student || teacher)
            return F.kl_div(F.log_softmax(t, -1), F.softmax(s, -1), reduction="batchmean")
        return F.kl_div(F.log_softmax(s, -1), F.softmax(t, -1), reduction="batchmean")

    return _distilled(kl)


@case("LOSS-014")
def _relu_before_cross_entropy(bug: bool) -> Case:
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3)]
    m = nn.Sequential(*layers, *([nn.ReLU()] if bug else []))
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    x, y = _data()
    return m, lambda: F.cross_entropy(m(x), y), {"optimizer": opt, "inputs": x}


@case("LOSS-015")
def _sigmoid_head_for_unscaled_scores(bug: bool) -> Case:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1), nn.Sigmoid())
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    x, _ = _data()
    scores = torch.linspace(0, 100, 16)  # ratings on a 0..100 scale
    target = scores if bug else scores / 100
    return m, lambda: F.mse_loss(m(x).squeeze(-1), target), {"optimizer": opt, "inputs": x}


@case("AMP-005")
def _cross_entropy_on_bf16_logits(bug: bool) -> Case:
    m = _classifier()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    x, y = _data()

    def loss() -> torch.Tensor:
        logits = m(x).to(torch.bfloat16)  # the cast a bf16 compute policy leaves on the logits
        return F.cross_entropy(logits if bug else logits.float(), y)

    return m, loss, {"optimizer": opt, "inputs": x}


def test_amp_005_is_quiet_under_autocast() -> None:
    m = _classifier()
    x, y = _data()

    def loss() -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return F.cross_entropy(m(x), y)  # autocast runs cross_entropy in float32

    assert not audit(m, loss).by_id("AMP-005")


@case("LOOP-013")
def _clip_after_step(bug: bool) -> Case:
    m = _classifier()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    x, y = _data()

    def step() -> torch.Tensor:
        opt.zero_grad()
        loss = F.cross_entropy(m(x), y)
        loss.backward()
        if not bug:
            nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        opt.step()
        if bug:
            nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        return loss

    return m, step, {"optimizer": opt}


class _ActorCritic(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.torso, self.policy, self.value = nn.Linear(8, 16), nn.Linear(16, 3), nn.Linear(16, 1)


@case("LOOP-013/other-optimizer")
def _clip_of_the_other_optimizers_head(bug: bool) -> Case:
    # two optimizers: the policy update clips the value head (the critic optimizer's) instead of its own tensors
    m = _ActorCritic()
    critic = torch.optim.SGD([*m.torso.parameters(), *m.value.parameters()], lr=0.01)
    actor = torch.optim.SGD([*m.torso.parameters(), *m.policy.parameters()], lr=0.01)
    x, y = _data()
    returns = torch.randn(16)

    def step() -> torch.Tensor:
        critic.zero_grad()
        F.mse_loss(m.value(torch.relu(m.torso(x))).squeeze(1), returns).backward()
        nn.utils.clip_grad_norm_(m.value.parameters(), 0.5)  # a generator, as users pass it
        critic.step()
        actor.zero_grad()
        loss = F.cross_entropy(m.policy(torch.relu(m.torso(x))), y)
        loss.backward()
        nn.utils.clip_grad_norm_((m.value if bug else m.policy).parameters(), 0.5)
        actor.step()
        return loss

    return m, step, {"optimizer": actor}


def test_clipping_a_generator_still_clips_under_the_audit() -> None:
    m, step, kwargs = CASES["LOOP-013/other-optimizer"](False)
    seen: list[float] = []
    kwargs["optimizer"].register_step_pre_hook(
        lambda *_: seen.append(float(torch.linalg.vector_norm(
            torch.stack([p.grad.norm() for p in m.policy.parameters()])))))
    audit(m, step, **kwargs)
    assert seen and max(seen) <= 0.5 + 1e-4


def test_a_clip_of_no_tensors_is_not_a_clip_of_another_optimizers_tensors() -> None:
    # clip_grad_norm_([p for p in params if p.grad is not None]) may well get an empty list
    from guardtower.preflight.loop import _clip_reach

    events = ["backward", "clip", "step"]
    assert _clip_reach(events, [set()], [{1, 2}], [{1, 2}, {3}]) is None
    assert _clip_reach(events, [{3}], [{1, 2}], [{1, 2}, {3}]) == "elsewhere"


def test_clipping_the_half_precision_copies_of_master_weights_is_not_loop_013() -> None:
    # the optimizer steps fp32 master copies; the loop clips the model's own gradients, then copies them over
    m = _classifier()
    master = [p.detach().clone().requires_grad_(True) for p in m.parameters()]
    opt = torch.optim.SGD(master, lr=0.1)
    x, y = _data()

    def step() -> torch.Tensor:
        m.zero_grad()
        loss = F.cross_entropy(m(x), y)
        loss.backward()
        nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        for w, p in zip(master, m.parameters()):
            w.grad = p.grad.detach().clone()
        opt.step()
        with torch.no_grad():
            for w, p in zip(master, m.parameters()):
                p.copy_(w)
        return loss

    assert not audit(m, step, optimizer=opt).by_id("LOOP-013")


def _llama(**overrides: Any) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
               num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return LlamaForCausalLM(LlamaConfig(**{**cfg, **overrides})).train()


@case("DATA-010")
def _sft_examples_without_eos(bug: bool) -> Case:
    model = _llama()
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(3, VOCAB, (3, 10), generator=g)
    mask = torch.ones_like(ids)
    ids[:, 0] = 1  # BOS, as the tokenizer adds it
    for row, length in enumerate((10, 7, 5)):
        if not bug:
            ids[row, length - 1] = 2  # the EOS a tokenizer with add_eos_token=True appends
        ids[row, length:] = 0
        mask[row, length:] = 0
    batch = {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return model, lambda: model(**batch).loss, {"optimizer": opt, "inputs": batch}


@case("DATA-011")
def _completion_truncated_away(bug: bool) -> Case:
    model = _llama()
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(3, VOCAB, (3, 12), generator=g)
    ids[:, 0], ids[:, -1] = 1, 2
    labels = ids.clone()
    labels[:, :6] = -100  # completion-only: the prompt is masked
    if bug:
        labels[1] = -100  # row 1's prompt filled max_length: its completion was truncated away
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return model, lambda: model(**batch).loss, {"optimizer": opt, "inputs": batch}


class _Items(torch.utils.data.Dataset[tuple[torch.Tensor, torch.Tensor]]):
    def __init__(self, ignore_index: bool) -> None:
        self.x, self.y = _data()
        self.ignore_index = ignore_index

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        j = 0 if self.ignore_index else i  # the bug: a cached first item
        return self.x[j], self.y[j]


@case("DATA-012")
def _dataset_ignores_its_index(bug: bool) -> Case:
    m = _classifier()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    x, y = next(iter(torch.utils.data.DataLoader(_Items(ignore_index=bug), batch_size=8)))
    return m, lambda: F.cross_entropy(m(x), y), {"optimizer": opt, "inputs": x}


class _TinyLM(nn.Module):
    """A hand-written decoder-only LM: token + position embeddings, one encoder layer, a head."""

    def __init__(self, causal: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.tok, self.pos = nn.Embedding(VOCAB, 16), nn.Embedding(32, 16)
        self.block = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.1, batch_first=True)
        self.head = nn.Linear(16, VOCAB)
        self.causal = causal

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok(ids) + self.pos(torch.arange(ids.shape[1]))
        mask = nn.Transformer.generate_square_subsequent_mask(ids.shape[1]) if self.causal else None
        return self.head(self.block(x, src_mask=mask, is_causal=self.causal))


@case("INPUT-010")
def _decoder_without_a_causal_mask(bug: bool) -> Case:
    m = _TinyLM(causal=not bug)
    ids = torch.randint(0, VOCAB, (4, 12), generator=torch.Generator().manual_seed(8))
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)

    def loss() -> torch.Tensor:
        logits = m(ids[:, :-1])
        return F.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1))

    return m, loss, {"optimizer": opt, "inputs": ids}


class _PaddedEmbedder(nn.Module):
    """Token embedding with padding_idx, mean-pooled over the non-padding positions, and a classifier."""

    def __init__(self, padding_idx: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, 16, padding_idx=padding_idx)
        self.head = nn.Linear(16, 2)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        keep = (ids != 1).float().unsqueeze(-1)
        return self.head((self.embed(ids) * keep).sum(1) / keep.sum(1))


@case("INPUT-008")
def _padding_idx_on_the_unk_token(bug: bool) -> Case:
    m = _PaddedEmbedder(padding_idx=0 if bug else 1)  # the vocabulary pads with 1; 0 is <unk>
    ids = torch.randint(2, VOCAB, (4, 9), generator=torch.Generator().manual_seed(6))
    ids[0, 3] = ids[2, 5] = 0  # out-of-vocabulary words
    ids[1, 6:] = ids[3, 4:] = 1
    y = torch.tensor([0, 1, 1, 0])
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    return m, lambda: F.cross_entropy(m(ids), y), {"optimizer": opt, "inputs": ids}


class _ConvClassifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.features = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


_MEAN, _STD = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1), torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1)


def _images(scale: float) -> Case:
    g = torch.Generator().manual_seed(7)
    pixels = (_MEAN + _STD * torch.randn(4, 3, 12, 12, generator=g)).clamp(0, 1).mul(255).round()  # uint8 values
    x = (pixels / scale - _MEAN) / _STD if scale else pixels
    m = _ConvClassifier()
    opt = torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9)
    y = torch.tensor([0, 1, 2, 0])
    return m, lambda: F.cross_entropy(m(x), y), {"optimizer": opt, "inputs": x}


@case("INPUT-009")
def _raw_pixels(bug: bool) -> Case:
    return _images(0.0 if bug else 255.0)


@case("INPUT-009/twice")
def _pixels_divided_by_255_twice(bug: bool) -> Case:
    return _images(255.0 * 255.0 if bug else 255.0)


@case("INPUT-009/tabular")
def _unscaled_tabular_features(bug: bool) -> Case:
    from sklearn.datasets import load_breast_cancer

    data = load_breast_cancer()
    x = torch.tensor(data.data[:32], dtype=torch.float32)
    if not bug:
        x = (x - x.mean(0)) / x.std(0)
    y = torch.tensor(data.target[:32])
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(30, 16), nn.ReLU(), nn.Linear(16, 2))
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    return m, lambda: F.cross_entropy(m(x), y), {"optimizer": opt, "inputs": x}


@case("OPT-018")
def _adam_betas_swapped(bug: bool) -> Case:
    m = _classifier()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3, betas=(0.999, 0.9) if bug else (0.9, 0.999))
    x, y = _data()
    return m, lambda: F.cross_entropy(m(x), y), {"optimizer": opt, "inputs": x}


@case("MODE-007")
def _keep_prob_as_drop_prob(bug: bool) -> Case:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.9 if bug else 0.1), nn.Linear(16, 3))
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    x, y = _data()
    return m, lambda: F.cross_entropy(m(x), y), {"optimizer": opt, "inputs": x}


@case("OPT-019")
def _one_block_listed_n_times(bug: bool) -> Case:
    torch.manual_seed(0)
    blocks = [nn.Linear(8, 8)] * 3 if bug else [nn.Linear(8, 8) for _ in range(3)]
    m = nn.Sequential(*blocks, nn.ReLU(), nn.Linear(8, 3))
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    x, y = _data()
    return m, lambda: F.cross_entropy(m(x), y), {"optimizer": opt, "inputs": x}


class _SkipProjection(nn.Module):
    """A residual block that widens its input; the skip path needs a projection to the new width."""

    def __init__(self, built_in_forward: bool) -> None:
        super().__init__()
        self.built_in_forward = built_in_forward
        self.body = nn.Linear(8, 12)
        self.skip = None if built_in_forward else nn.Linear(8, 12)
        self.head = nn.Linear(12, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skip = nn.Linear(8, 12) if self.built_in_forward else self.skip  # a new random layer on every call
        assert skip is not None
        return self.head(torch.tanh(self.body(x)) + skip(x))


@case("OPT-020")
def _layer_built_in_forward(bug: bool) -> Case:
    torch.manual_seed(0)
    m = _SkipProjection(built_in_forward=bug)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    x, y = _data()
    return m, sgd_step(m, opt, lambda: F.cross_entropy(m(x), y)), {"optimizer": opt, "inputs": x}


def test_opt_020_is_quiet_for_a_layer_built_once_on_the_first_call() -> None:
    class Lazy(nn.Module):  # built on the first call and kept (then handed to the optimizer): not thrown away
        def __init__(self) -> None:
            super().__init__()
            self.proj: nn.Module | None = None

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if self.proj is None:
                self.proj = nn.Linear(x.shape[-1], 3)
            return self.proj(x)

    torch.manual_seed(0)
    m, (x, y) = Lazy(), _data()
    assert not audit(m, lambda: F.cross_entropy(m(x), y)).by_id("OPT-020")  # the step builds it, the model keeps it
    assert isinstance(m.proj, nn.Linear)


class _MeanTeacher(nn.Module):
    """A student and its EMA teacher in one module (the teacher frozen, with BatchNorm buffers it copies)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.student = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))
        self.teacher = copy.deepcopy(self.student).requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.student(x)


def _ema_step(update: Callable[[_MeanTeacher], None]) -> Case:
    m = _MeanTeacher()
    opt = torch.optim.AdamW(m.student.parameters(), lr=1e-2)
    x, y = _data()

    def step() -> torch.Tensor:
        opt.zero_grad()
        with torch.no_grad():
            target = m.teacher(x).softmax(-1)
        loss = F.cross_entropy(m(x), y) + F.kl_div(m(x).log_softmax(-1), target, reduction="batchmean")
        loss.backward()
        opt.step()
        with torch.no_grad():
            update(m)
        return loss

    return m, step, {"optimizer": opt, "inputs": x}


@case("OPT-021")
def _ema_pushed_away_from_the_weights(bug: bool) -> Case:
    def update(m: _MeanTeacher) -> None:
        for t, s in zip(m.teacher.parameters(), m.student.parameters()):
            if bug:
                t.add_((t - s) * 0.01)  # the sign flipped: s pushed away from the student
            else:
                t.sub_((t - s) * 0.01)
        for t, s in zip(m.teacher.buffers(), m.student.buffers()):
            t.copy_(s)

    return _ema_step(update)


@case("OPT-021/decay-without-its-other-term")
def _ema_decayed_toward_zero(bug: bool) -> Case:
    def update(m: _MeanTeacher) -> None:
        teacher, student = list(m.teacher.parameters()), list(m.student.parameters())
        torch._foreach_mul_(teacher, 0.99)
        if not bug:  # the bug: the (1 - decay) * p term is missing, the teacher shrinks toward zero
            torch._foreach_add_(teacher, student, alpha=0.01)

    return _ema_step(update)


@case("OPT-023")
def _ema_updated_on_every_micro_batch(bug: bool) -> Case:
    """Four micro-batches per optimizer step; the bug updates the mean teacher after each of them, the clean step
    once, after the optimizer step."""
    m = _MeanTeacher()
    opt = torch.optim.AdamW(m.student.parameters(), lr=1e-2)
    x, y = _data()

    def ema() -> None:
        with torch.no_grad():
            for t, s in zip(m.teacher.parameters(), m.student.parameters()):
                t.lerp_(s, 0.01)

    def step() -> torch.Tensor:
        total = torch.zeros(())
        for k in range(4):
            loss = F.cross_entropy(m(x[k::4]), y[k::4]) / 4
            loss.backward()
            total = total + loss.detach()
            if k == 3:
                opt.step()
                opt.zero_grad()
            if bug or k == 3:
                ema()
        return total

    return m, step, {"optimizer": opt, "inputs": x}


def test_opt_023_is_quiet_when_each_of_several_optimizer_steps_updates_the_copy_once() -> None:
    # a step_fn that is an epoch of four updates, an EMA after each: four windows, four optimizer steps
    m = _MeanTeacher()
    opt = torch.optim.AdamW(m.student.parameters(), lr=1e-2)
    x, y = _data()

    def epoch() -> torch.Tensor:
        for k in range(4):
            opt.zero_grad()
            loss = F.cross_entropy(m(x[k::4]), y[k::4])
            loss.backward()
            opt.step()
            with torch.no_grad():
                for t, s in zip(m.teacher.parameters(), m.student.parameters()):
                    t.lerp_(s, 0.01)
        return loss

    assert not audit(m, epoch, optimizer=opt, inputs=x).by_id("OPT-023")


@case("MODE-009")
def _ema_teacher_in_eval_mode_skips_its_buffers(bug: bool) -> Case:
    def update(m: _MeanTeacher) -> None:
        m.teacher.eval()  # the teacher only makes targets
        for t, s in zip(m.teacher.parameters(), m.student.parameters()):
            t.data.mul_(0.99).add_(s.data, alpha=0.01)  # .data: no version counter moves
        if not bug:  # the fix: the running statistics follow too
            for t, s in zip(m.teacher.buffers(), m.student.buffers()):
                t.data.lerp_(s.data.to(t.dtype), 0.01) if t.is_floating_point() else t.data.copy_(s.data)

    m, step, kwargs = _ema_step(update)
    m.teacher.eval()
    return m, step, kwargs


def test_mode_009_is_quiet_for_a_frozen_backbone_in_eval_mode_that_nothing_updates() -> None:
    m = _MeanTeacher()
    m.teacher.eval()
    opt = torch.optim.AdamW(m.student.parameters(), lr=1e-2)
    x, y = _data()
    step = sgd_step(m, opt, lambda: F.cross_entropy(m(x) + m.teacher(x), y))
    assert not audit(m, step, optimizer=opt, inputs=x).by_id("MODE-009")


@pytest.mark.parametrize("update", [
    lambda m: [t.lerp_(s, 0.5) for t, s in zip(m.teacher.parameters(), m.student.parameters())],
    lambda m: m.teacher.load_state_dict(m.student.state_dict()),  # a hard target-network copy
    lambda m: [t.copy_(b) for t, b in zip(m.teacher.buffers(), m.student.buffers())],  # buffers only
    lambda m: [p.grad.mul_(2.0) for p in m.student.parameters() if p.grad is not None],  # a gradient, by hand
    lambda m: [p.mul_(0.999) for p in m.student.parameters()],  # weight decay on the weights themselves
], ids=["lerp", "hard-copy", "buffers", "grad", "own-decay"])
def test_opt_021_is_quiet_for_updates_that_move_a_copy_toward_its_weights(update: Callable[[Any], Any]) -> None:
    model, step, kwargs = _ema_step(update)
    assert not audit(model, step, **kwargs).by_id("OPT-021")


def test_opt_021_judges_an_averaged_model_and_a_velocity_buffer_quietly() -> None:
    """torch's own AveragedModel (an EMA of the weights) moves toward them; a hand-written momentum buffer has
    the weights' shape but is no copy of them."""
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    m = _classifier()
    averaged = AveragedModel(m, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    velocity = [torch.zeros_like(p) for p in m.parameters()]
    opt = torch.optim.SGD(m.parameters(), lr=1e-2)
    x, y = _data()

    def step() -> torch.Tensor:
        opt.zero_grad()
        loss = F.cross_entropy(m(x), y)
        loss.backward()
        opt.step()
        averaged.update_parameters(m)
        with torch.no_grad():
            for v, p in zip(velocity, m.parameters()):
                v.mul_(0.9).add_(p.grad)
        return loss

    report = audit(m, step, optimizer=opt, inputs=x)
    assert not report.by_id("OPT-021")


class _PolicyValue(nn.Module):
    def __init__(self, actions: int = 4, continuous: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.trunk = nn.Sequential(nn.Linear(8, 32), nn.Tanh())
        self.policy = nn.Linear(32, actions)
        self.value = nn.Linear(32, 1)
        self.log_std = nn.Parameter(torch.zeros(actions)) if continuous else None

    def forward(self, obs: torch.Tensor) -> tuple[torch.distributions.Distribution, torch.Tensor]:
        h = self.trunk(obs)
        if self.log_std is not None:
            return torch.distributions.Normal(self.policy(h), self.log_std.exp()), self.value(h).squeeze(-1)
        return torch.distributions.Categorical(logits=self.policy(h)), self.value(h).squeeze(-1)


_OBS = torch.randn(16, 8, generator=torch.Generator().manual_seed(21))
_RETURNS = torch.randn(16, generator=torch.Generator().manual_seed(22))


@case("LOSS-018")
def _advantage_left_attached_to_the_value_head(bug: bool) -> Case:
    m = _PolicyValue()
    opt = torch.optim.Adam(m.parameters(), lr=3e-4)
    actions = torch.arange(16) % 4

    def loss_fn() -> torch.Tensor:
        dist, values = m(_OBS)
        advantage = _RETURNS - values
        weight = advantage if bug else advantage.detach()
        return -(dist.log_prob(actions) * weight).mean() + 0.5 * advantage.pow(2).mean()

    return m, sgd_step(m, opt, loss_fn), {"optimizer": opt, "inputs": _OBS}


@case("LOSS-018/ppo-ratio")
def _ppo_ratio_times_an_attached_advantage(bug: bool) -> Case:
    m = _PolicyValue(continuous=True)
    opt = torch.optim.Adam(m.parameters(), lr=3e-4)
    actions = torch.randn(16, 4, generator=torch.Generator().manual_seed(23))
    with torch.no_grad():
        old = m(_OBS)[0].log_prob(actions).sum(-1)

    def loss_fn() -> torch.Tensor:
        dist, values = m(_OBS)
        advantage = _RETURNS - values
        if not bug:
            advantage = advantage.detach()
        ratio = (dist.log_prob(actions).sum(-1) - old).exp()
        clipped = torch.min(ratio * advantage, ratio.clamp(0.8, 1.2) * advantage)
        return -clipped.mean() + F.mse_loss(values, _RETURNS) - 0.01 * dist.entropy().mean()

    return m, sgd_step(m, opt, loss_fn), {"optimizer": opt, "inputs": _OBS}


def test_loss_018_is_quiet_for_gates_teachers_entropy_and_a_learned_temperature() -> None:
    """A mixture's gates weight its experts' log-probabilities and are meant to learn from them (they are never
    negative); a teacher's probabilities carry no gradient; an entropy bonus and SAC's alpha are no weights of a
    policy-gradient term."""
    torch.manual_seed(0)
    gate, experts = nn.Linear(8, 3), nn.ModuleList(nn.Linear(8, 5) for _ in range(3))
    student, teacher = nn.Linear(8, 5), nn.Linear(8, 5).requires_grad_(False)
    log_alpha = nn.Parameter(torch.zeros(1))
    model = nn.ModuleDict({"gate": gate, "experts": experts, "student": student,
                           "alpha": nn.ParameterList([log_alpha])})
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x, y = _OBS, torch.arange(16) % 5

    def loss_fn() -> torch.Tensor:
        weights = gate(x).softmax(-1)
        picked = torch.stack([F.log_softmax(e(x), -1).gather(1, y[:, None]).squeeze(1) for e in experts], -1)
        mixture = -(weights * picked).sum(-1).mean()
        logp = F.log_softmax(student(x), -1)
        distill = -(teacher(x).softmax(-1) * logp).sum(-1).mean()
        entropy = (logp.exp() * logp).sum(-1).mean()
        alpha_loss = -(log_alpha * (logp.max(-1).values + 1.0).detach()).mean()
        return mixture + distill + 0.01 * entropy + alpha_loss

    assert not audit(model, sgd_step(model, opt, loss_fn), optimizer=opt, inputs=x).by_id("LOSS-018")


@case("LOSS-019")
def _kl_to_the_reference_subtracted(bug: bool) -> Case:
    torch.manual_seed(0)
    policy, reference = nn.Linear(8, 5), nn.Linear(8, 5).requires_grad_(False)
    reference.load_state_dict(policy.state_dict())
    model = nn.ModuleDict({"policy": policy, "reference": reference})
    opt = torch.optim.SGD(policy.parameters(), lr=0.1)
    x, y = _OBS, torch.arange(16) % 5

    def loss_fn() -> torch.Tensor:
        logits = policy(x)
        kl = F.kl_div(F.log_softmax(logits, -1), F.log_softmax(reference(x), -1), log_target=True,
                      reduction="batchmean")
        return F.cross_entropy(logits, y) + (-0.1 if bug else 0.1) * kl  # the bug: the penalty is subtracted

    return model, sgd_step(model, opt, loss_fn), {"optimizer": opt, "inputs": x}


def test_loss_019_is_quiet_for_distances_pushed_apart_an_entropy_bonus_and_an_attack_on_the_input() -> None:
    """Subtracting a loss that compares two outputs of the model (a negative pushed away, an entropy written as a
    cross-entropy with its own probabilities) is a design; an attack that ascends a loss on its own perturbation,
    with its own optimizer, moves no weight."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 5))
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    x, y = _OBS, torch.arange(16) % 5
    delta = torch.zeros_like(x, requires_grad=True)
    attack = torch.optim.SGD([delta], lr=0.01)

    def step() -> torch.Tensor:
        attack.zero_grad()
        (-F.cross_entropy(net(x + delta), y)).backward()
        attack.step()
        opt.zero_grad()
        logits = net(x + delta.detach())
        emb = net[:2](x)
        anchor, positive, negative = emb[:5], emb[5:10], emb[10:15]
        triplet = F.relu(F.mse_loss(anchor, positive) - F.mse_loss(anchor, negative) + 1.0)
        entropy = F.cross_entropy(logits, logits.softmax(-1))
        loss = F.cross_entropy(logits, y) + triplet - 0.01 * entropy
        loss.backward()
        opt.step()
        return loss

    assert not audit(net, step, optimizer=opt, inputs=x).by_id("LOSS-019")


def test_loss_019_clean_twin_reports_nothing_at_all() -> None:
    model, step, kwargs = CASES["LOSS-019"](False)
    assert not audit(model, step, **kwargs).by_id("LOSS-019")


@case("INIT-001")
def _constant_initialisation(bug: bool) -> Case:
    m = _classifier()
    if bug:
        for layer in (m[0], m[2]):
            nn.init.constant_(layer.weight, 0.1)
            nn.init.zeros_(layer.bias)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    x, y = _data()
    return m, lambda: F.cross_entropy(m(x), y), {"optimizer": opt, "inputs": x}


def test_init_001_leaves_a_zero_initialised_output_layer_alone() -> None:
    m = _classifier()
    nn.init.zeros_(m[2].weight)  # zero-init head: its rows' gradients differ, so the units separate
    x, y = _data()
    assert not audit(m, lambda: F.cross_entropy(m(x), y)).by_id("INIT-001")


def test_adamw_weight_decay_on_a_lora_model_is_not_moving_without_gradient() -> None:
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(gpt2(), LoraConfig(r=2, lora_alpha=4, target_modules=["c_attn"], lora_dropout=0.0))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3, weight_decay=0.1)
    batch = token_batch(seq=12)

    def step() -> torch.Tensor:
        opt.zero_grad()
        loss = model(**batch, labels=batch["input_ids"]).loss
        loss.backward()
        opt.step()
        return loss

    assert not audit(model, step, optimizer=opt).by_id("OPT-008")


@case("OPT-022/helper-unfreezes-the-encoder")
def _encoder_unfrozen_by_a_helper(bug: bool) -> Case:
    """A frozen pretrained encoder under a trained head; the step's helper that readies the model for training
    unfreezes every parameter (the fix: only the head), and the optimizer was built over all of them."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
    model[0].requires_grad_(False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = torch.randn(16, 8, generator=torch.Generator().manual_seed(1)), torch.arange(16) % 3

    def ready() -> None:
        model.train()
        (model if bug else model[2]).requires_grad_(True)

    def step() -> torch.Tensor:
        ready()
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return loss

    return model, step, {"optimizer": opt, "inputs": x}


@case("OPT-022/peft-disable-adapter")
def _adapter_unfrozen_by_disable_adapter(bug: bool) -> Case:
    """A LoRA policy loaded frozen (inference_mode=True) under a trained value head, with a reference pass of the
    base model inside ``disable_adapter()``: leaving it makes the adapter trainable (peft issue 3447); the fix
    restores the adapter frozen after the context."""
    from peft import LoraConfig, get_peft_model

    class ValueModel(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            base = gpt2(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # a frozen part without dropout
            self.policy = get_peft_model(base, LoraConfig(r=2, lora_alpha=4, target_modules=["c_attn"], lora_dropout=0.0,
                                                          inference_mode=True, init_lora_weights=False))
            self.head = nn.Linear(self.policy.config.n_embd, 1)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.head(self.policy(input_ids=ids, output_hidden_states=True).hidden_states[-1]).squeeze(-1)

    model = ValueModel()
    ids = token_batch(seq=12)["input_ids"]
    returns = torch.randn(ids.shape, generator=torch.Generator().manual_seed(2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def loss() -> torch.Tensor:
        with model.policy.disable_adapter(), torch.no_grad():
            reference = model.head(model.policy(input_ids=ids, output_hidden_states=True).hidden_states[-1])
        if not bug:
            model.policy.set_adapter("default", inference_mode=True)
        value = model(ids)
        return F.mse_loss(value, returns) + 0.1 * F.mse_loss(value, reference.squeeze(-1))

    return model, sgd_step(model, opt, loss), {"optimizer": opt, "inputs": {"input_ids": ids}}


def test_opt_022_leaves_a_step_that_freezes_a_part_for_one_phase_and_unfreezes_it_alone() -> None:
    """A GAN's generator step freezes the discriminator and unfreezes it afterwards: the step ends as it began."""
    torch.manual_seed(0)
    gen, disc = nn.Linear(4, 8), nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
    model = nn.ModuleDict({"gen": gen, "disc": disc})
    opt_g, opt_d = torch.optim.Adam(gen.parameters(), lr=1e-3), torch.optim.Adam(disc.parameters(), lr=1e-3)
    z, real = torch.randn(8, 4), torch.randn(8, 8)

    def step() -> torch.Tensor:
        disc.requires_grad_(False)  # the generator's phase
        opt_g.zero_grad()
        g_loss = F.softplus(-disc(gen(z))).mean()
        g_loss.backward()
        opt_g.step()
        disc.requires_grad_(True)  # the discriminator's phase
        opt_d.zero_grad()
        d_loss = F.softplus(-disc(real)).mean() + F.softplus(disc(gen(z).detach())).mean()
        d_loss.backward()
        opt_d.step()
        return g_loss + d_loss

    report = audit(model, step, optimizer=opt_g)
    assert not report.by_id("OPT-022"), str(report)
    assert all(p.requires_grad for p in model.parameters())  # the audit hands every flag back as it found it


def test_lora_002_is_info_for_a_peft_model_kept_frozen_under_a_trained_head() -> None:
    """The peft model is a component, frozen whole, and something outside it trains: a fixed backbone, not a
    forgotten is_trainable; the same peft model audited on its own, frozen, is still a FAIL."""
    model, step, kwargs = CASES["OPT-022/peft-disable-adapter"](False)
    found = audit(model, step, **kwargs).by_id("LORA-002")
    assert [f.severity for f in found] == [Severity.INFO] and "fixed backbone" in found[0].message
    policy = model.policy
    ids = kwargs["inputs"]["input_ids"]
    alone = audit(policy, lambda: policy(input_ids=ids, labels=ids).loss, inputs={"input_ids": ids})
    assert [f.severity for f in alone.by_id("LORA-002")] == [Severity.ERROR]


# --- severity from consequence --------------------------------------------------------------------------------
def test_grad_001_is_info_for_an_architectures_part_that_never_ran() -> None:
    from transformers import BertConfig, BertModel

    class Encoder(nn.Module):  # BertModel as an encoder: its own pooling, the library's pooler never runs
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.bert = BertModel(BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1,
                                             num_attention_heads=2, intermediate_size=32))
            self.head = nn.Linear(16, 3)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.head(self.bert(input_ids=ids).last_hidden_state.mean(1))

    m = Encoder()
    ids = torch.randint(0, 50, (6, 5), generator=torch.Generator().manual_seed(0))
    report = audit(m, lambda: F.cross_entropy(m(ids), torch.arange(6) % 3))
    findings = report.by_id("GRAD-001")
    assert findings and all(f.severity == Severity.INFO and f.details.get("unused_part") for f in findings), str(report)
    assert all(p.startswith("bert.pooler.") for f in findings for p in f.details["params"])


def test_grad_001_stays_a_failure_for_a_users_head_that_never_ran() -> None:
    m = _Backbone(no_grad=False)
    m.add_module("orphan", nn.Linear(4, 4))
    x, y = _data()
    (finding,) = audit(m, lambda: F.cross_entropy(m(x), y)).by_id("GRAD-001")
    assert finding.severity == Severity.ERROR and finding.details["params"] == ["orphan.weight", "orphan.bias"]


class _VQ(nn.Module):
    """A VQ-VAE whose step calls its parts and its own ``quantize``, never its forward; ``codebook`` is its own."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder, self.decoder = nn.Linear(12, 4), nn.Linear(4, 12)
        self.codebook = nn.Parameter(torch.randn(8, 4, generator=torch.Generator().manual_seed(5)))
        self.unused_scale = nn.Parameter(torch.ones(()))  # held, read by nothing

    def quantize(self, z: torch.Tensor, straight_through_first: bool) -> tuple[torch.Tensor, torch.Tensor]:
        q = self.codebook[torch.cdist(z, self.codebook).argmin(-1)]
        if straight_through_first:  # the bug: the codebook loss then reads a tensor with no path to the codebook
            q = z + (q - z).detach()
            return q, F.mse_loss(q, z.detach())
        return z + (q - z).detach(), F.mse_loss(q, z.detach())


def _vq_step(straight_through_first: bool) -> Case:
    torch.manual_seed(0)
    m, x = _VQ(), torch.rand(16, 12, generator=torch.Generator().manual_seed(6))

    def step() -> torch.Tensor:
        q, vq_loss = m.quantize(m.encoder(x), straight_through_first)
        return F.mse_loss(m.decoder(q), x) + vq_loss

    return m, step, {"inputs": x}


def test_grad_001_fails_for_a_parameter_a_method_reads_when_its_module_forward_never_ran() -> None:
    # the loss reads the codebook's values (through the quantized vectors) but no gradient reaches it: cut; the
    # scale nothing reads is an unused part (INFO), on both sides
    found = {}
    for bug in (True, False):
        m, step, kwargs = _vq_step(bug)
        found[bug] = {(f.severity, tuple(f.details["params"])) for f in audit(m, step, **kwargs).by_id("GRAD-001")}
    assert found[True] == {(Severity.ERROR, ("codebook",)), (Severity.INFO, ("unused_scale",))}
    assert found[False] == {(Severity.INFO, ("unused_scale",))}


def test_grad_001_value_reads_start_each_run_from_the_same_frozen_copies() -> None:
    """The step calls the model's parts and moves an EMA copy of them itself (BYOL's target); the head it never
    calls is an unused part. Each value-read run must not inherit the copy the previous runs moved, or every
    candidate looks read (its loss differs because the target moved)."""

    class Online(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body, self.fc = nn.Linear(8, 8), nn.Linear(8, 3)  # fc: the classifier the step never calls

    torch.manual_seed(0)
    m = nn.Module()
    m.online = Online()
    m.target = copy.deepcopy(m.online.body).requires_grad_(False)
    opt = torch.optim.Adam(m.online.parameters(), lr=1e-2)
    x = torch.randn(6, 8)

    def step() -> torch.Tensor:
        with torch.no_grad():
            target = m.target(x)
        loss = F.mse_loss(m.online.body(x), target + 1.0)
        opt.zero_grad()
        loss.backward()
        opt.step()
        with torch.no_grad():
            for t, o in zip(m.target.parameters(), m.online.body.parameters()):
                t.lerp_(o, 0.1)
        return loss

    findings = audit(m, step, optimizer=opt, inputs=x).by_id("GRAD-001")
    assert [(f.severity, f.details["params"]) for f in findings] == [(Severity.INFO, ["online.fc.weight",
                                                                                     "online.fc.bias"])]
    assert not opt.state  # the runs' optimizer steps wrote into scratch state, never the optimizer's own


def test_grad_001_is_info_for_a_backbones_head_the_step_skips_by_calling_its_features() -> None:
    class Backbone(nn.Module):  # timm-style: forward = head(features(x)); self-supervised steps call features
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Linear(8, 16)
            self.fc = nn.Linear(16, 10)

        def features(self, x: torch.Tensor) -> torch.Tensor:
            return torch.relu(self.body(x))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(self.features(x))

    class Contrastive(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = Backbone()
            self.projector = nn.Linear(16, 4)

        def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            za, zb = (F.normalize(self.projector(self.net.features(v)), dim=-1) for v in (a, b))
            return F.cross_entropy(za @ zb.t() / 0.1, torch.arange(len(a)))

    torch.manual_seed(0)
    m, (x, _) = Contrastive(), _data()
    (finding,) = audit(m, lambda: m(x, x + 0.1 * torch.randn_like(x))).by_id("GRAD-001")
    assert finding.severity == Severity.INFO and finding.details["params"] == ["net.fc.weight", "net.fc.bias"]


class _Policy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.torso, self.actor, self.critic = nn.Linear(8, 16), nn.Linear(16, 3), nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.relu(self.torso(x))
        return self.actor(h), self.critic(h)


@pytest.mark.parametrize("cut", [False, True])
def test_grad_001_is_info_for_a_head_whose_output_the_step_discards_and_a_failure_when_the_loss_reads_it_cut(
        cut: bool) -> None:
    # distilling a policy on its actions alone discards its critic's output; a value loss through float() reads it
    # with the graph cut
    m, (x, y) = _Policy(), _data()

    def loss() -> torch.Tensor:
        logits, value = m(x)
        actions = F.cross_entropy(logits, y)
        return actions * (1.0 + float(value.mean().abs())) if cut else actions

    report = audit(m, loss)
    (finding,) = report.by_id("GRAD-001")
    assert finding.details["params"] == ["critic.weight", "critic.bias"]
    assert finding.severity == (Severity.ERROR if cut else Severity.INFO), str(report)
    assert any("values of one gradient-less module or parameter changed" in n for n in report.notes)


class _Energy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.mlp = nn.Sequential(nn.Linear(3, 16), nn.Tanh(), nn.Linear(16, 1))

    def forward(self, pos: torch.Tensor) -> torch.Tensor:
        return self.mlp(pos).sum()


@pytest.mark.parametrize("cut", [False, True])
def test_grad_001_is_info_for_a_bias_a_force_loss_drops_and_a_failure_when_the_loss_reads_it_cut(cut: bool) -> None:
    # forces are -dE/dpos: the energy's last bias shifts E by a constant and drops out of the derivative; a loss
    # that reads it through float() (an energy term with the graph cut) does depend on it
    m = _Energy()
    g = torch.Generator().manual_seed(5)
    pos, target = torch.randn(6, 3, generator=g), torch.randn(6, 3, generator=g)

    def loss() -> torch.Tensor:
        p = pos.clone().requires_grad_(True)
        energy = m(p)
        forces = -torch.autograd.grad(energy, p, create_graph=True)[0]
        loss = F.mse_loss(forces, target)
        return loss * (1.0 + 0.01 * float(m.mlp[2].bias.abs().sum())) if cut else loss

    report = audit(m, loss)
    (finding,) = report.by_id("GRAD-001")
    assert finding.details["params"] == ["mlp.2.bias"]
    assert finding.severity == (Severity.ERROR if cut else Severity.INFO), str(report)


def test_grad_001_is_info_for_a_library_models_own_parameter_the_loss_bypasses() -> None:
    # a CLIP loss built from the embeddings with a fixed temperature never reads CLIPModel.logit_scale
    from transformers import CLIPConfig, CLIPModel

    torch.manual_seed(0)
    m = CLIPModel(CLIPConfig(
        text_config=dict(vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, max_position_embeddings=16),
        vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                           image_size=16, patch_size=8), projection_dim=8)).train()
    ids, pixels = torch.randint(3, 50, (4, 8)), torch.randn(4, 3, 16, 16)

    def loss() -> torch.Tensor:
        out = m(input_ids=ids, pixel_values=pixels)
        sim = F.normalize(out.image_embeds, dim=-1) @ F.normalize(out.text_embeds, dim=-1).T / 0.07
        return F.cross_entropy(sim, torch.arange(4))

    (finding,) = audit(m, loss).by_id("GRAD-001")
    assert finding.severity == Severity.INFO and finding.details["params"] == ["logit_scale"]


def test_grad_001_stays_a_failure_for_a_module_that_ran_under_no_grad() -> None:
    m = _Backbone(no_grad=True)
    x, y = _data()
    (finding,) = [f for f in audit(m, lambda: F.cross_entropy(m(x), y)).by_id("GRAD-001")]
    assert finding.severity == Severity.ERROR


def test_a_target_network_no_optimizer_holds_and_no_gradient_reaches_is_info() -> None:
    import copy

    class Agent(nn.Module):  # DQN-style: the target copy still requires grad, is used under no_grad, not optimized
        def __init__(self) -> None:
            super().__init__()
            self.online = _classifier()
            self.target = copy.deepcopy(self.online)

    m = Agent()
    opt = torch.optim.Adam(m.online.parameters(), lr=1e-3)
    x, y = _data()

    def td_loss() -> torch.Tensor:
        with torch.no_grad():
            bootstrap = m.target(x).max(-1).values
        return F.mse_loss(m.online(x).gather(1, y[:, None]).squeeze(1), bootstrap)

    report = audit(m, td_loss, optimizer=opt)
    for cid in ("GRAD-001", "OPT-001"):
        (finding,) = report.by_id(cid)
        assert finding.severity == Severity.INFO and finding.details["params"][0].startswith("target."), str(report)
    # the same copy left out of the optimizer while the loss does reach it: a part that should train and never will
    report = audit(m, lambda: F.cross_entropy(m.online(x) + m.target(x), y), optimizer=opt)
    (finding,) = report.by_id("OPT-001")
    assert finding.severity == Severity.ERROR and not report.by_id("GRAD-001")


def test_mode_003_ignores_the_buffers_an_eval_mode_teachers_ema_copies() -> None:
    # a mean teacher kept in eval mode makes pseudo-labels; its EMA (under .data, no version bump) also averages
    # the BatchNorm statistics: they move, but by the copy, not by a forward in train mode
    class MeanTeacher(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.student = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))
            self.teacher = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))
            self.teacher.load_state_dict(self.student.state_dict())
            self.teacher.requires_grad_(False)

    m, (x, y) = MeanTeacher().train(), _data()
    m.teacher.eval()
    opt = torch.optim.SGD(m.student.parameters(), lr=0.1)

    def step() -> torch.Tensor:
        with torch.no_grad():
            pseudo = m.teacher(x).argmax(1)
        opt.zero_grad()
        loss = F.cross_entropy(m.student(x), y) + F.cross_entropy(m.student(x), pseudo)
        loss.backward()
        opt.step()
        with torch.no_grad():
            for t, s in zip([*m.teacher.parameters(), *m.teacher.buffers()],
                            [*m.student.parameters(), *m.student.buffers()]):
                if t.is_floating_point():
                    t.data.mul_(0.9).add_(s.data * 0.1)
        return loss

    assert not audit(m, step, optimizer=opt).by_id("MODE-003")


def test_a_momentum_encoder_the_step_updates_itself_may_run_in_train_mode() -> None:
    import copy

    class Byol(nn.Module):  # the target encoder: frozen, BatchNorm in train mode, an EMA of the online one
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.online = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 8))
            self.target = copy.deepcopy(self.online).requires_grad_(False)

    m = Byol()
    opt = torch.optim.Adam(m.online.parameters(), lr=1e-3)
    x, _ = _data()

    def step(ema: bool) -> torch.Tensor:
        opt.zero_grad()
        with torch.no_grad():
            target = F.normalize(m.target(x + 0.1), dim=-1)
        loss = (2 - 2 * (F.normalize(m.online(x), dim=-1) * target).sum(-1)).mean()
        loss.backward()
        opt.step()
        if ema:
            with torch.no_grad():
                for online, copied in zip(m.online.parameters(), m.target.parameters()):
                    copied.lerp_(online, 0.01)
        return loss

    assert not audit(m, lambda: step(True), optimizer=opt).by_id("MODE-003")
    # the same copy that the step never updates is a frozen feature extractor, whose statistics should stay put
    (finding,) = audit(m, lambda: step(False), optimizer=opt).by_id("MODE-003")
    assert finding.severity == Severity.WARN and finding.details["modules"] == ["target"]


def test_opt_002_is_info_without_optimizer_state_and_warn_with_it() -> None:
    m = _classifier()
    m[0].requires_grad_(False)
    opt = torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9)
    x, y = _data()
    (fresh,) = audit(m, lambda: F.cross_entropy(m(x), y), optimizer=opt).by_id("OPT-002")
    assert fresh.severity == Severity.INFO
    m[0].requires_grad_(True)
    F.cross_entropy(m(x), y).backward()
    opt.step()  # momentum buffers for every tensor
    m[0].requires_grad_(False)
    (stale,) = audit(m, lambda: F.cross_entropy(m(x), y), optimizer=opt).by_id("OPT-002")
    assert stale.severity == Severity.WARN and stale.details["with_state"]


# --- samples that read each other, when step_fn runs the backward itself ---------------------------------------
def _user_step(m: nn.Module, loss_fn: Callable[[], torch.Tensor]) -> Case:
    opt = torch.optim.Adam(m.parameters(), lr=1e-3)
    return m, sgd_step(m, opt, loss_fn), {"optimizer": opt}


class _LastStepHead(nn.Module):
    """An LSTM over (batch, seq, feature) input and a head on each sample's last time step."""

    def __init__(self, batch_first: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lstm = nn.LSTM(8, 16, batch_first=batch_first)
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(x)
        return self.head(out[:, -1])


@case("INPUT-002/seq-first-lstm-own-backward")
def _lstm_reads_the_batch_as_time(bug: bool) -> Case:
    # without batch_first=True the LSTM runs along the batch: out[:, -1] is then the last *sample* of each step
    m = _LastStepHead(batch_first=not bug)
    x = torch.randn(6, 5, 8, generator=torch.Generator().manual_seed(1))  # (batch, seq, feature)
    y = torch.randn(6, 3)
    return _user_step(m, lambda: F.mse_loss(m(x), y))


def test_input_002_own_pass_is_quiet_on_a_similarity_matrix_and_on_batchnorm() -> None:
    class _DualEncoder(nn.Module):  # returns the batch x batch similarities: every row reads every sample
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.a, self.b = nn.Linear(8, 16), nn.Linear(8, 16)

        def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
            return F.normalize(self.a(x), dim=-1) @ F.normalize(self.b(z), dim=-1).T / 0.07

    g = torch.Generator().manual_seed(2)
    x, z = torch.randn(6, 8, generator=g), torch.randn(6, 8, generator=g)
    dual = _DualEncoder()
    model, step, kwargs = _user_step(dual, lambda: F.cross_entropy(dual(x, z), torch.arange(6)))
    report = audit(model, step, **kwargs)
    assert not report.by_id("INPUT-002")
    cnn = SmallCNN()
    images, labels = torch.randn(4, 3, 8, 8, generator=g), torch.arange(4) % 5
    model, step, kwargs = _user_step(cnn, lambda: F.cross_entropy(cnn(images), labels))
    report = audit(model, step, **kwargs)
    assert not report.by_id("INPUT-002")  # the own pass runs in eval mode: BatchNorm reads running statistics
    assert any("reads only its own input" in n for n in report.notes)


def test_input_002_probes_the_last_sample_of_a_causal_mix_along_the_batch() -> None:
    class _CumulativeMix(nn.Module):  # sample i reads samples 0..i: sample 0 alone looks independent
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.fc = nn.Linear(8, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(x.cumsum(0))

    m = _CumulativeMix()
    x, y = torch.randn(5, 8), torch.randn(5, 2)
    (finding,) = audit(m, lambda: F.mse_loss(m(x), y)).by_id("INPUT-002")
    assert finding.severity == Severity.WARN and finding.details["leaking_samples"] == [1, 2, 3]


class _TimeFirstTagger(nn.Module):
    """A sequence-first encoder and LSTM (the torch default) over ``(time, batch, feature)`` input, one prediction
    per time step and sample: ``(time, batch, classes)``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0)
        self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.lstm = nn.LSTM(16, 16, bidirectional=True)
        self.head = nn.Linear(32, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.lstm(self.enc(x))[0])


class _ImageColumnsRNN(nn.Module):
    """CRNN-style: conv features of each image column, read left to right by a bidirectional LSTM; the
    prediction is ``(width, batch, classes)``, as CTC takes it."""

    def __init__(self, batch_first: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(1, 8, 3, padding=1)
        self.rnn = nn.LSTM(8 * 4, 16, bidirectional=True, batch_first=batch_first)
        self.head = nn.Linear(32, 6)
        self.batch_first = batch_first

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        f = torch.relu(self.conv(images))  # (b, c, h, w)
        cols = f.flatten(1, 2).permute(2, 0, 1)  # (w, b, c*h): time first
        # the bug: batch_first=True read on time-first features runs the recurrence along the batch
        return self.head(self.rnn(cols)[0])


def test_input_002_finds_the_batch_axis_of_the_prediction_and_reads_time_first_inputs() -> None:
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(7, 4, 16, generator=g), torch.randint(0, 5, (7, 4), generator=g)
    tagger = _TimeFirstTagger()
    model, step, kwargs = _user_step(tagger, lambda: F.cross_entropy(tagger(x).reshape(-1, 5), y.reshape(-1)))
    assert not audit(model, step, inputs=x, **kwargs).by_id("INPUT-002")  # time first, as its layers expect
    images = torch.randn(3, 1, 4, 10, generator=g)
    for bug in (True, False):
        crnn = _ImageColumnsRNN(batch_first=bug)
        model, step, kwargs = _user_step(crnn, lambda: crnn(images).logsumexp(-1).mean())
        found = audit(model, step, inputs=images, **kwargs).by_id("INPUT-002")
        assert bool(found) == bug and (not bug or found[0].severity == Severity.WARN)


# --- labels that collapsed to one class over every position ------------------------------------------------------
class _TinySegmenter(nn.Module):
    def __init__(self, classes: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, classes, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def _segmentation(classes: int, masks: torch.Tensor) -> Case:
    m = _TinySegmenter(classes)
    images = torch.rand(4, 3, 8, 8, generator=torch.Generator().manual_seed(4))
    return _user_step(m, lambda: F.cross_entropy(m(images), masks))


@case("DATA-007/segmentation-mask-through-to-tensor")
def _mask_scaled_then_truncated(bug: bool) -> Case:
    ids = torch.randint(0, 3, (4, 8, 8), generator=torch.Generator().manual_seed(5))
    masks = (ids.float() / 255).long() if bug else ids  # ToTensor on the class-id mask: every id becomes 0
    return _segmentation(3, masks)


def test_data_007_leaves_a_binary_mask_of_background_alone() -> None:
    # a batch with no foreground pixel at all is common in defect or lesion segmentation: not a finding
    model, step, kwargs = _segmentation(2, torch.zeros(4, 8, 8, dtype=torch.long))
    assert not audit(model, step, **kwargs).by_id("DATA-007")


# --- a loss term without gradient --------------------------------------------------------------------------------
class _StudentTeacher(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.student = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        self.teacher = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4)).requires_grad_(False).eval()

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.student(x), self.teacher(x)


@case("LOSS-016")
def _distillation_against_itself(bug: bool) -> Case:
    m = _StudentTeacher()
    x, y = torch.randn(8, 8, generator=torch.Generator().manual_seed(6)), torch.arange(8) % 4

    def loss() -> torch.Tensor:
        student, teacher = m(x)
        learner = teacher if bug else student  # the KL's input taken from the teacher: KL(t || t) = 0
        kd = F.kl_div(F.log_softmax(learner / 2, -1), F.log_softmax(teacher / 2, -1), reduction="batchmean",
                      log_target=True)
        return F.cross_entropy(student, y) + 0.5 * kd

    return _user_step(m, loss)


def test_loss_016_ignores_a_logged_metric_and_an_accumulator_that_starts_at_zero() -> None:
    m = _StudentTeacher()
    x, y = torch.randn(8, 8, generator=torch.Generator().manual_seed(7)), torch.arange(8) % 4
    logged: list[float] = []

    def loss() -> torch.Tensor:
        student, teacher = m(x)
        logged.append(float(F.cross_entropy(teacher, y)))  # the teacher's loss, a metric: not added to the loss
        total = torch.zeros(())
        for term in (F.cross_entropy(student, y), F.mse_loss(student, teacher)):
            total = total + term
        return total

    model, step, kwargs = _user_step(m, loss)
    assert not audit(model, step, **kwargs).by_id("LOSS-016")


# --- dropout that ignores eval mode --------------------------------------------------------------------------------
class _FunctionalDropout(nn.Module):
    def __init__(self, follows_mode: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 3)
        self.follows_mode = follows_mode

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.fc1(x))
        h = F.dropout(h, 0.3, training=self.training) if self.follows_mode else F.dropout(h, 0.3)
        return self.fc2(h)


@case("MODE-008")
def _dropout_left_on(bug: bool) -> Case:
    m = _FunctionalDropout(follows_mode=not bug)
    x, y = _data()
    return m, lambda: F.cross_entropy(m(x), y), {}


# --- a row's prediction against its padding -------------------------------------------------------------------
_PAD = 0


def _padded_ids() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(1, 30, (6, 10), generator=torch.Generator().manual_seed(0))
    for row, length in enumerate((10, 8, 7, 5, 9, 4)):
        ids[row, length:] = _PAD
    return ids, (ids != _PAD).long()  # an HF-style attention mask: 1 at real tokens


class _MaskedEncoder(nn.Module):
    """A hand-written transformer classifier that takes an HF-style mask and mean-pools the real tokens."""

    def __init__(self, mask_as: str, pool_padding: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.mask_as, self.pool_padding = mask_as, pool_padding
        self.emb = nn.Embedding(30, 16, padding_idx=_PAD)
        layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.1, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(16, 3)

    def forward(self, ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        # key_padding_mask is True at padding: the HF mask passed as it is masks the real tokens instead
        kpm = attention_mask.bool() if self.mask_as == "hf" else attention_mask == 0
        h = self.enc(self.emb(ids), src_key_padding_mask=kpm)
        if self.pool_padding:
            return self.head(h.mean(1))
        m = attention_mask.unsqueeze(-1).float()
        return self.head((h * m).sum(1) / m.sum(1))


def _padding_case(model: nn.Module) -> Case:
    ids, mask = _padded_ids()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return model, sgd_step(model, opt, lambda: F.cross_entropy(model(ids, mask), torch.arange(6) % 3)), \
        {"optimizer": opt, "inputs": (ids, mask)}


@case("INPUT-011/inverted-key-padding-mask")
def _inverted_key_padding_mask(bug: bool) -> Case:
    return _padding_case(_MaskedEncoder("hf" if bug else "padding"))


@case("INPUT-011/mean-over-padding")
def _mean_pooled_over_padding(bug: bool) -> Case:
    return _padding_case(_MaskedEncoder("padding", pool_padding=bug))


class _LossInForward(nn.Module):
    """A decoder that computes its own next-token loss on the shifted tokens (the loss is all it returns)."""

    def __init__(self, ignore_index: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.ignore_index = ignore_index
        self.emb, self.rnn, self.out = nn.Embedding(30, 16), nn.GRU(16, 16, batch_first=True), nn.Linear(16, 30)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        logits = self.out(self.rnn(self.emb(ids[:, :-1]))[0])
        return F.cross_entropy(logits.transpose(1, 2), ids[:, 1:], ignore_index=self.ignore_index)


@case("DATA-005/loss-inside-forward")
def _padding_predicted_inside_forward(bug: bool) -> Case:
    model = _LossInForward(ignore_index=-100 if bug else _PAD)  # the fix: ignore the pad id the batch uses
    ids, mask = _padded_ids()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return model, sgd_step(model, opt, lambda: model(ids, mask.bool())), {"optimizer": opt, "inputs": (ids, mask)}


class _NextToken(nn.Module):
    """A small decoder returning next-token logits (no loss of its own)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.rnn, self.out = nn.Embedding(30, 16), nn.GRU(16, 16, batch_first=True), nn.Linear(16, 30)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.out(self.rnn(self.emb(ids))[0])


@case("DATA-005/per-token-mask-of-the-inputs")
def _padding_weighted_by_the_inputs_mask(bug: bool) -> Case:
    """A per-token loss weighted by a mask: the inputs' mask where the shifted targets need theirs (``mask[:, :-1]``)
    weights each row's last real position, whose target is padding; the twin (``mask[:, 1:]``) has the same
    padded targets and ignore_index, and weights them 0."""
    model = _NextToken()
    ids, mask = _padded_ids()

    def loss() -> torch.Tensor:
        logits = model(ids, mask)[:, :-1]
        per_token = F.cross_entropy(logits.reshape(-1, 30), ids[:, 1:].reshape(-1), reduction="none")
        weight = (mask[:, :-1] if bug else mask[:, 1:]).reshape(-1).float()
        return (per_token * weight).sum() / weight.sum()

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return model, sgd_step(model, opt, loss), {"optimizer": opt, "inputs": {"input_ids": ids, "attention_mask": mask}}


@case("DATA-004/measured")
def _labels_shifted_before_a_loss_that_shifts(bug: bool) -> Case:
    """The collator shifts the labels (labels = ids[:, 1:]) and the loss helper shifts again (logits[:, :-1]
    against labels[:, 1:]): position t learns the token at t+2. The batch holds no labels tensor for the static
    DATA-004 to read; the twin passes labels = ids and lets the helper shift."""
    model = _NextToken()
    ids, _ = _padded_ids()
    ids = torch.randint(1, 30, ids.shape, generator=torch.Generator().manual_seed(6))  # no padding
    labels = ids[:, 1:] if bug else ids

    def loss() -> torch.Tensor:
        logits = model(ids, torch.ones_like(ids))[:, : labels.shape[1]]
        return F.cross_entropy(logits[:, :-1].reshape(-1, 30), labels[:, 1:].reshape(-1))

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return model, sgd_step(model, opt, loss), {"optimizer": opt, "inputs": {"input_ids": ids}}


def test_input_011_leaves_a_causal_model_and_a_unidirectional_rnn_on_right_padding_alone() -> None:
    class Tagger(nn.Module):  # real positions come before the padding: nothing reads it
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.emb, self.rnn, self.out = nn.Embedding(30, 16, padding_idx=_PAD), nn.GRU(16, 16, batch_first=True), \
                nn.Linear(16, 5)

        def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            return self.out(self.rnn(self.emb(ids))[0]) * mask.unsqueeze(-1)

    m = Tagger()
    ids, mask = _padded_ids()
    tags = torch.randint(0, 5, ids.shape, generator=torch.Generator().manual_seed(1)).masked_fill(mask == 0, -100)
    report = audit(m, lambda: F.cross_entropy(m(ids, mask).transpose(1, 2), tags), inputs=(ids, mask))
    assert not report.by_id("INPUT-011") and any("padded row" in n for n in report.notes), str(report)


# --- what another optimizer, a non-shifting causal LM and a per-epoch decay mean ---------------------------------
def test_sched_003_leaves_a_decay_without_a_length_stepped_per_epoch_alone() -> None:
    # ExponentialLR has no planned length: not stepped in the step, it is stepped per epoch (say 50 of 10 batches)
    model, step, kwargs = _scheduled(lambda o: torch.optim.lr_scheduler.ExponentialLR(o, 0.99), total=500, per_step=0)
    assert not audit(model, step, **kwargs).by_id("SCHED-003")


class _TwoPlayers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.g, self.d = nn.Linear(8, 8), nn.Linear(8, 1)


@case("OPT-001/second-optimizer-misses-a-part")
def _gan_with_two_optimizers(bug: bool) -> Case:
    m = _TwoPlayers()
    opt_g = torch.optim.Adam(m.g.parameters(), lr=1e-3)
    opt_d = torch.optim.Adam([m.d.weight] if bug else list(m.d.parameters()), lr=1e-3)  # bug: d.bias in neither
    z, real = torch.randn(6, 8), torch.randn(6, 8)

    def step() -> torch.Tensor:
        opt_d.zero_grad()
        d_loss = F.softplus(-m.d(real)).mean() + F.softplus(m.d(m.g(z).detach())).mean()
        d_loss.backward()
        opt_d.step()
        opt_g.zero_grad()
        g_loss = F.softplus(-m.d(m.g(z))).mean()
        g_loss.backward()
        opt_g.step()
        return g_loss

    return m, step, {"optimizer": opt_g}  # the generator's: the other optimizer is seen stepping


def test_data_004_trusts_the_measured_shift_not_the_class_name() -> None:
    from transformers import MBartConfig, MBartForCausalLM

    torch.manual_seed(0)
    cfg = MBartConfig(vocab_size=40, d_model=32, decoder_layers=1, decoder_attention_heads=2, decoder_ffn_dim=32,
                      encoder_layers=1, encoder_attention_heads=2, encoder_ffn_dim=32, max_position_embeddings=32,
                      pad_token_id=1, bos_token_id=0, eos_token_id=2, dropout=0.0)
    m = MBartForCausalLM(cfg)
    ids = torch.randint(3, 40, (4, 12), generator=torch.Generator().manual_seed(8))
    shifted = torch.cat([ids[:, 1:], torch.full((4, 1), -100)], dim=1)  # MBartForCausalLM does not shift labels
    report = audit(m, lambda: m(input_ids=ids, labels=shifted).loss)
    assert not [f for f in report if f.catalog_id in ("DATA-004", "DATA-006") and f.severity >= Severity.WARN]
    assert report.by_id("DATA-006") == [] and audit(m, lambda: m(input_ids=ids, labels=ids).loss).by_id("DATA-006")


def test_data_002_checks_a_loss_that_masks_padding_itself_also_when_step_fn_runs_backward() -> None:
    class _MaskedTagger(nn.Module):  # the loss multiplies padding out, so labels there do not matter
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.emb, self.out = nn.Embedding(20, 16, padding_idx=0), nn.Linear(16, 5)

        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            nll = F.cross_entropy(self.out(self.emb(input_ids)).transpose(1, 2), labels, reduction="none")
            return (nll * attention_mask).sum() / attention_mask.sum()

    m = _MaskedTagger()
    mask = torch.tensor([[1] * 8, [1] * 5 + [0] * 3, [1] * 6 + [0] * 2])
    ids = torch.randint(1, 20, (3, 8), generator=torch.Generator().manual_seed(9)) * mask
    batch = {"input_ids": ids, "attention_mask": mask, "labels": torch.randint(0, 5, (3, 8)) * mask}
    model, step, kwargs = _user_step(m, lambda: m(**batch))
    assert not audit(model, step, inputs=batch, **kwargs).by_id("DATA-002")


@case("INPUT-008/one-id-per-sample")
def _entity_zero_is_padding(bug: bool) -> Case:
    class _Scorer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.entity = nn.Embedding(12, 8, **({"padding_idx": 0} if bug else {}))
            self.head = nn.Linear(8, 1)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.head(self.entity(ids)).squeeze(-1)

    m = _Scorer()
    ids, y = torch.arange(16) % 12, torch.randn(16)  # entity 0 is a real entity
    return m, lambda: F.mse_loss(m(ids), y), {}


@case("DATA-008/class-weights-per-token")
def _token_class_weights_in_the_wrong_order(bug: bool) -> Case:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    x = torch.randn(6, 10, 8, generator=torch.Generator().manual_seed(10))
    y = torch.zeros(6, 10, dtype=torch.long)
    y[:, 7:] = 1  # 30% positive frames
    weight = torch.tensor([1 / 0.3, 1 / 0.7] if bug else [1 / 0.7, 1 / 0.3])  # inverse frequencies, or swapped
    return m, lambda: F.nll_loss(F.log_softmax(m(x), -1).transpose(1, 2), y, weight=weight), {}


def test_mode_003_leaves_a_discriminator_its_own_optimizer_trains_alone() -> None:
    class _Pair(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.g = nn.Linear(8, 8)
            self.d = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 1))

    m = _Pair()
    opt_g, opt_d = torch.optim.Adam(m.g.parameters()), torch.optim.Adam(m.d.parameters())
    z, real = torch.randn(6, 8), torch.randn(6, 8)

    def step() -> torch.Tensor:
        m.d.requires_grad_(False)  # the generator's update: the discriminator is frozen for it only
        opt_g.zero_grad()
        g_loss = F.softplus(-m.d(m.g(z))).mean()
        g_loss.backward()
        opt_g.step()
        m.d.requires_grad_(True)
        opt_d.zero_grad()
        d_loss = F.softplus(-m.d(real)).mean() + F.softplus(m.d(m.g(z).detach())).mean()
        d_loss.backward()
        opt_d.step()
        return g_loss

    assert not [f for f in audit(m, step, optimizer=opt_g) if f.catalog_id.startswith("MODE-")
                and f.severity >= Severity.WARN]


class _PolicyValueAgent(nn.Module):
    """A shared trunk with a policy head and a value head (returns both, as PPO agents do)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.trunk, self.actor, self.critic = nn.Sequential(nn.Linear(6, 16), nn.Tanh()), nn.Linear(16, 3), \
            nn.Linear(16, 1)

    def forward(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.trunk(obs)
        return self.actor(h), self.critic(h).squeeze(-1)


@case("GRAD-004/target-is-the-prediction")
def _value_target_is_the_old_value(bug: bool) -> Case:
    """PPO value targets built as (zero-filled) advantages plus the rollout's values: the critic regresses onto its
    own prediction, its loss and gradient are exactly 0; the twin's returns are the computed advantages plus the
    values."""
    agent = _PolicyValueAgent()
    gen = torch.Generator().manual_seed(4)
    obs, actions = torch.randn(32, 6, generator=gen), torch.randint(0, 3, (32,), generator=gen)
    advantages = torch.randn(32, generator=gen)
    with torch.no_grad():
        old_logits, old_values = agent(obs)
    old_logprob = torch.distributions.Categorical(logits=old_logits).log_prob(actions)
    returns = (torch.zeros(32) if bug else advantages) + old_values
    opt = torch.optim.Adam(agent.parameters(), lr=1e-3)

    def loss() -> torch.Tensor:
        logits, values = agent(obs)
        ratio = (torch.distributions.Categorical(logits=logits).log_prob(actions) - old_logprob).exp()
        policy = -torch.min(advantages * ratio, advantages * ratio.clamp(0.8, 1.2)).mean()
        return policy + 0.5 * ((values - returns) ** 2).mean()

    return agent, sgd_step(agent, opt, loss), {"optimizer": opt, "inputs": obs}


def _two_group_one_cycle(max_lr: float | list[float], decay: tuple[float, float] = (0.1, 0.1)) -> Case:
    """A pretrained encoder at lr/10 and a new head at lr, under OneCycleLR."""
    torch.manual_seed(0)
    return _scheduled(lambda opt: torch.optim.lr_scheduler.OneCycleLR(opt, max_lr, total_steps=100), 100,
                      groups=lambda m: [{"params": m[0].parameters(), "lr": 1e-4, "weight_decay": decay[0]},
                                        {"params": m[2].parameters(), "lr": 1e-3, "weight_decay": decay[1]}])


@case("SCHED-007")
def _one_max_lr_for_two_groups(bug: bool) -> Case:
    return _two_group_one_cycle(1e-3 if bug else [1e-4, 1e-3])


def test_sched_007_leaves_one_max_lr_for_groups_split_by_weight_decay_alone() -> None:
    """Groups that differ in weight decay (a no-decay group) share one max_lr by design."""
    model, step, kwargs = _two_group_one_cycle(1e-3, decay=(0.1, 0.0))
    assert not audit(model, step, **kwargs).by_id("SCHED-007")


@case("LOSS-016/derivative-without-create-graph")
def _force_term_from_a_derivative_without_graph(bug: bool) -> Case:
    """Energy and force training: the forces -dE/dpos taken with autograd.grad without create_graph=True are a
    constant, so the force term changes the loss value and trains nothing (torchani PR 238); the twin passes
    create_graph=True."""
    m = _Energy()
    g = torch.Generator().manual_seed(7)
    pos, forces_true, energy_true = torch.randn(6, 3, generator=g), torch.randn(6, 3, generator=g), torch.randn(())
    opt = torch.optim.Adam(m.parameters(), lr=1e-3)

    def loss() -> torch.Tensor:
        p = pos.clone().requires_grad_(True)
        energy = m(p)
        forces = -torch.autograd.grad(energy, p, retain_graph=True, create_graph=not bug)[0]
        force_loss = (F.mse_loss(forces, forces_true, reduction="none").sum(-1) / 3).mean()
        return (energy - energy_true) ** 2 + force_loss

    return m, sgd_step(m, opt, loss), {"optimizer": opt, "inputs": pos}


@case("LOSS-004/double-activation")
def _dice_on_an_activated_output(bug: bool) -> Case:
    """A segmentation net whose loss takes a softmax over the classes, then a per-class soft Dice that applies a
    sigmoid again (Loss_ToolBox issue 11); the twin's Dice takes the probabilities as they are."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 3, 1))
    g = torch.Generator().manual_seed(8)
    x = torch.randn(4, 1, 8, 8, generator=g)
    y = F.one_hot(torch.randint(0, 3, (4, 8, 8), generator=g), 3).permute(0, 3, 1, 2).float()
    opt = torch.optim.Adam(m.parameters(), lr=1e-3)

    def loss() -> torch.Tensor:
        probs = F.softmax(m(x), dim=1)
        total = torch.zeros(())
        for c in range(3):
            p = torch.sigmoid(probs[:, c]) if bug else probs[:, c]
            total = total + 1 - (2 * (p * y[:, c]).sum() + 1) / ((p * p).sum() + (y[:, c] * y[:, c]).sum() + 1)
        return total / 3

    return m, sgd_step(m, opt, loss), {"optimizer": opt, "inputs": x}


# --- the parametrised trigger / clean pairs ------------------------------------------------------------------
class _HistoryPooling(nn.Module):
    """A click model: the user's history items, pooled by a length mask, against a candidate item."""

    def __init__(self) -> None:
        super().__init__()
        self.items = nn.Embedding(20, 8, padding_idx=0)
        self.head = nn.Linear(16, 1)

    def forward(self, history: torch.Tensor, lengths: torch.Tensor, item: torch.Tensor) -> torch.Tensor:
        keep = (torch.arange(history.shape[1])[None, :] < lengths[:, None]).unsqueeze(-1)
        pooled = (self.items(history) * keep).sum(1) / lengths[:, None]
        return self.head(torch.cat([pooled, self.items(item)], -1)).squeeze(-1)


@case("INPUT-013")
def _history_lengths_of_ones(bug: bool) -> Case:
    torch.manual_seed(0)
    m = _HistoryPooling()
    lengths = torch.tensor([3, 5, 2, 4])
    history = torch.randint(1, 20, (4, 5)).masked_fill(torch.arange(5)[None, :] >= lengths[:, None], 0)
    item, clicked = torch.randint(1, 20, (4,)), torch.tensor([1.0, 0.0, 1.0, 0.0])
    used = torch.ones_like(lengths) if bug else lengths  # the bug: a length of one for every user
    return m, lambda: F.binary_cross_entropy_with_logits(m(history, used, item), clicked), {"inputs": history}


def _masked_cross_entropy(per_element: bool, mask: torch.Tensor) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    def loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if per_element:  # the fix: mask the per-element loss
            return (F.cross_entropy(logits, y, reduction="none") * mask).sum() / mask.sum()
        return (nn.CrossEntropyLoss()(logits, y) * mask.reshape(-1, 1)).sum() / mask.sum()  # mean, then masked

    return loss


@case("LOSS-020")
def _mask_multiplies_a_mean_loss(bug: bool) -> Case:
    m = _classifier()
    x, y = _data()
    mask = (torch.arange(y.shape[0]) % 4 != 3).float()  # every fourth slot is padding
    loss = _masked_cross_entropy(per_element=not bug, mask=mask)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    return m, sgd_step(m, opt, lambda: loss(m(x), y)), {"optimizer": opt, "inputs": x}


def test_loss_020_also_when_the_audit_runs_the_backward() -> None:
    m = _classifier()
    x, y = _data()
    mask = (torch.arange(y.shape[0]) % 4 != 3).float()
    for per_element, found in ((False, True), (True, False)):
        loss = _masked_cross_entropy(per_element, mask)
        assert bool(audit(m, lambda: loss(m(x), y), inputs=x).by_id("LOSS-020")) is found


@case("INPUT-014")
def _rope_scaling_written_after_construction(bug: bool) -> Case:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32)
    scaling = {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}
    if not bug:  # the fix: the long-context setting is in the config the model is built from
        config.rope_parameters, config.max_position_embeddings = dict(scaling), 128
    m = LlamaForCausalLM(config).train()
    if bug:  # "enable long context" on the loaded model
        m.config.rope_parameters, m.config.max_position_embeddings = dict(scaling), 128
    batch = token_batch(seq=12)
    return m, lambda: m(**batch), {}


@case("SCHED-008")
def _second_scheduler_on_the_first_optimizer(bug: bool) -> Case:
    """A backbone at a small lr and a head at a large one, each with its warmup schedule; the bug builds the head's
    schedule on the backbone's optimizer."""
    from transformers import get_linear_schedule_with_warmup

    m = _classifier()
    x, y = _data()
    body = torch.optim.AdamW(m[0].parameters(), lr=1e-4)
    head = torch.optim.AdamW(m[2].parameters(), lr=1e-2)
    body_schedule = get_linear_schedule_with_warmup(body, 10, 200)
    head_schedule = get_linear_schedule_with_warmup(body if bug else head, 10, 200)

    def step() -> torch.Tensor:
        loss = F.cross_entropy(m(x), y)
        loss.backward()
        for opt, schedule in ((body, body_schedule), (head, head_schedule)):
            opt.step()
            schedule.step()
            opt.zero_grad()
        return loss

    return m, step, {"optimizer": head, "lr_scheduler": head_schedule, "total_steps": 200, "inputs": x}


def test_sched_008_is_quiet_for_two_schedulers_chained_on_one_optimizer() -> None:
    # torch documents chaining: a warmup and a decay stepped back to back on the one optimizer the step has
    m = _classifier()
    x, y = _data()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    warmup = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.1, total_iters=5)
    decay = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.99)

    def step() -> torch.Tensor:
        opt.zero_grad()
        loss = F.cross_entropy(m(x), y)
        loss.backward()
        opt.step()
        warmup.step()
        decay.step()
        return loss

    assert not audit(m, step, optimizer=opt, lr_scheduler=decay, inputs=x).by_id("SCHED-008")


@case("SCHED-009")
def _plateau_in_max_mode_on_the_loss(bug: bool) -> Case:
    m = _classifier()
    x, y = _data()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, mode="max" if bug else "min", patience=2)

    def step() -> torch.Tensor:
        opt.zero_grad()
        loss = F.cross_entropy(m(x), y)
        loss.backward()
        opt.step()
        plateau.step(float(loss))
        return loss

    return m, step, {"optimizer": opt, "lr_scheduler": plateau, "inputs": x}


def test_sched_009_is_quiet_for_max_mode_on_an_accuracy() -> None:
    m = _classifier()
    x, y = _data()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, mode="max", patience=2)

    def step() -> torch.Tensor:
        opt.zero_grad()
        logits = m(x)
        loss = F.cross_entropy(logits, y)
        loss.backward()
        opt.step()
        plateau.step(float((logits.argmax(-1) == y).float().mean()))
        return loss

    assert not audit(m, step, optimizer=opt, lr_scheduler=plateau, inputs=x).by_id("SCHED-009")


class _MainWeightsAdam(torch.optim.Adam):
    """A mixed-precision optimizer as Megatron writes it: Adam on float32 main copies of the bf16 weights, the
    gradients copied in and the weights copied back inside its step."""

    def __init__(self, model: nn.Module) -> None:
        self.model_params = [p for p in model.parameters() if p.requires_grad]
        super().__init__([p.detach().clone().float() for p in self.model_params], lr=1e-3)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.model_params:
            p.grad = None
        super().zero_grad(set_to_none=set_to_none)

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        mains = [p for g in self.param_groups for p in g["params"]]
        for main, p in zip(mains, self.model_params):
            main.grad = None if p.grad is None else p.grad.float()
        super().step()
        for main, p in zip(mains, self.model_params):
            p.copy_(main)


@case("OPT-003/main-weights-not-reloaded")
def _checkpoint_loaded_after_the_main_weights_were_copied(bug: bool) -> Case:
    torch.manual_seed(0)
    m = _classifier().to(torch.bfloat16)
    opt = _MainWeightsAdam(m)
    pretrained = {k: v + 0.5 for k, v in m.state_dict().items()}
    m.load_state_dict(pretrained)  # the checkpoint, loaded after the optimizer was built
    if not bug:  # the fix: re-sync the main weights (Megatron's reload_model_params)
        with torch.no_grad():
            for main, p in zip((p for g in opt.param_groups for p in g["params"]), opt.model_params):
                main.copy_(p)
    x, y = _data()
    return m, sgd_step(m, opt, lambda: F.cross_entropy(m(x.to(torch.bfloat16)).float(), y)), {"optimizer": opt}


def test_a_main_weights_optimizer_is_neither_stale_nor_changed_by_the_audit() -> None:
    m, step, kwargs = _checkpoint_loaded_after_the_main_weights_were_copied(bug=False)
    opt = kwargs["optimizer"]
    mains = [p.detach().clone() for g in opt.param_groups for p in g["params"]]
    report = audit(m, step, **kwargs)
    assert not [f for f in report if f.severity >= Severity.ERROR], str(report)
    assert all(torch.equal(a, p) for a, p in zip(mains, (p for g in opt.param_groups for p in g["params"])))


@pytest.mark.parametrize("key", sorted(CASES))
def test_triggers(key: str) -> None:
    catalog_id = key.split("/")[0]
    model, step, kwargs = CASES[key](True)
    report = audit(model, step, **kwargs)
    least = min(Severity.WARN, next((m.severity for m in _STEP if m.id == catalog_id), Severity.WARN))  # INFO: at INFO
    assert any(f.severity >= least for f in report.by_id(catalog_id)), f"{catalog_id} not emitted:\n{report}"


@pytest.mark.parametrize("key", sorted(CASES))
def test_clean_counterparts(key: str) -> None:
    model, step, kwargs = CASES[key](False)
    report = audit(model, step, **kwargs)
    loud = [f"{f.severity.label} {f.catalog_id}: {f.message}" for f in report if f.severity >= Severity.WARN]
    assert not loud, "\n".join(loud)


def test_every_step_entry_has_a_trigger_case() -> None:
    assert {m.id for m in _STEP} <= {key.split("/")[0] for key in CASES}



def test_grad_004_is_info_when_only_a_shift_a_pairwise_loss_cancels_gets_no_gradient() -> None:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))  # a reward head
    a, b = torch.randn(6, 8), torch.randn(6, 8)
    report = audit(m, lambda: -F.logsigmoid(m(a) - m(b)).mean())  # the last bias shifts both rewards alike
    (finding,) = report.by_id("GRAD-004")
    assert finding.severity == Severity.INFO and finding.details["params"] == ["2.bias"]


def test_a_per_epoch_schedule_stepped_outside_the_step_is_not_sched_003() -> None:
    # StepLR(step_size=3) counts epochs; walked per optimizer step it would end within 1% of the run
    model, step, kwargs = _scheduled(lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=3, gamma=0.1),
                                     total=2000, per_step=0)
    assert not [f for f in audit(model, step, **kwargs) if f.catalog_id.startswith("SCHED-")]


class _ZeroGatedBranch(nn.Module):
    """A residual branch behind a gate whose last projection starts at zero (ControlNet, ReZero-style)."""

    def __init__(self, both_zero: bool) -> None:
        super().__init__()
        self.branch = nn.Linear(8, 8)
        self.gate = nn.Sequential(nn.Linear(8, 8, bias=False), nn.Tanh(), nn.Linear(8, 8, bias=False))
        nn.init.zeros_(self.gate[2].weight)
        if both_zero:  # the two gate layers hold each other at zero: nothing behind them ever learns
            nn.init.zeros_(self.gate[0].weight)
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.branch(x)
        return self.head(x + self.gate(h) * h)


@pytest.mark.parametrize("own_backward", [True, False])
def test_grad_004_is_info_when_a_zero_initialised_gate_holds_the_gradient_for_the_first_step_only(
        own_backward: bool) -> None:
    x, y = torch.randn(16, 8, generator=torch.Generator().manual_seed(3)), torch.randn(16, 1)
    for both_zero in (False, True):
        torch.manual_seed(0)
        m = _ZeroGatedBranch(both_zero)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
        loss = lambda: F.mse_loss(m(x), y)  # noqa: E731
        step = sgd_step(m, opt, loss) if own_backward else loss
        before = {n: p.detach().clone() for n, p in m.named_parameters()}
        (finding,) = audit(m, step, optimizer=opt, inputs=x).by_id("GRAD-004")
        assert all(torch.equal(before[n], p) for n, p in m.named_parameters())  # the extra steps are put back
        assert set(finding.details["params"]) >= {"branch.weight", "gate.0.weight"}
        if both_zero:
            assert finding.severity == Severity.WARN and "gate.2.weight" in finding.details["params"]
        else:
            assert finding.severity == Severity.INFO and finding.details["first_step_only"]


@pytest.mark.parametrize("restores_train_mode", [True, False])
def test_mode_001_judges_the_training_forward_not_a_validation_forward_before_it(restores_train_mode: bool) -> None:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.5), nn.Linear(16, 1)).train()
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    x, y, val_x = torch.randn(8, 8), torch.randn(8, 1), torch.randn(8, 8)

    def step() -> torch.Tensor:
        m.eval()  # a validation every N iterations, at the top of the training step
        with torch.no_grad():
            m(val_x)
        if restores_train_mode:
            m.train()
        opt.zero_grad()
        loss = F.mse_loss(m(x), y)
        loss.backward()
        opt.step()
        return loss

    found = audit(m, step, optimizer=opt, inputs=x).by_id("MODE-001")
    assert not found if restores_train_mode else found[0].severity == Severity.WARN
    assert m.training  # put back as handed over


class _HandWrittenLM(nn.Module):
    """A hand-written token model (no config): embedding, a GRU, logits over the same vocabulary."""

    def __init__(self, vocab: int = 20) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, 16)
        self.rnn = nn.GRU(16, 16, batch_first=True)
        self.out = nn.Linear(16, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(self.rnn(self.tok(ids))[0])


@pytest.mark.parametrize("setup", ["unshifted", "shifted", "denoiser"])
def test_data_006_on_a_hand_written_model_needs_nearly_every_target_to_be_its_own_input(setup: str) -> None:
    torch.manual_seed(0)
    m = _HandWrittenLM()
    opt = torch.optim.Adam(m.parameters(), lr=1e-3)
    ids = torch.randint(0, 20, (8, 32), generator=torch.Generator().manual_seed(5))
    noisy = torch.where(torch.rand(ids.shape, generator=torch.Generator().manual_seed(6)) < 0.15,
                        torch.randint(0, 20, ids.shape, generator=torch.Generator().manual_seed(7)), ids)

    def loss() -> torch.Tensor:
        if setup == "unshifted":  # scored against the tokens it is given: it learns to copy
            return F.cross_entropy(m(ids).transpose(1, 2), ids)
        if setup == "shifted":
            return F.cross_entropy(m(ids[:, :-1]).transpose(1, 2), ids[:, 1:])
        return F.cross_entropy(m(noisy).transpose(1, 2), ids)  # a denoiser reconstructs every position

    found = audit(m, sgd_step(m, opt, loss), optimizer=opt, inputs=ids).by_id("DATA-006")
    assert bool(found) == (setup == "unshifted")


def test_opt_016_is_quiet_for_an_ema_copy_held_in_a_list_on_purpose() -> None:
    import copy

    torch.manual_seed(0)
    m = _classifier()
    m.ema = [copy.deepcopy(m)]  # timm's ModelEma kept beside the model: out of state_dict and the optimizer
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    x, y = _data()

    def step() -> torch.Tensor:
        loss = sgd_step(m, opt, lambda: F.cross_entropy(m(x), y))()
        with torch.no_grad():
            for e, p in zip(m.ema[0].parameters(), m.parameters()):
                e.mul_(0.999).add_(p, alpha=0.001)
        return loss

    assert not audit(m, step, optimizer=opt, inputs=x).by_id("OPT-016")
    model, step, kwargs = CASES["OPT-016"](True)  # layers in a list that run in forward stay a finding
    assert audit(model, step, **kwargs).by_id("OPT-016")


def test_grad_001_is_info_for_a_library_embedding_its_forward_skips_under_inputs_embeds() -> None:
    from transformers import LlamaConfig, LlamaModel

    class SpeechLM(nn.Module):  # CosyVoice / LLaVA style: the step builds inputs_embeds itself
        def __init__(self) -> None:
            super().__init__()
            self.llm = LlamaModel(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                              num_attention_heads=2, num_key_value_heads=2))
            self.speech = nn.Embedding(12, 16)
            self.head = nn.Linear(16, 12)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.head(self.llm(inputs_embeds=self.speech(ids)).last_hidden_state)

    torch.manual_seed(0)
    m = SpeechLM()
    ids = torch.randint(0, 12, (2, 6))
    (finding,) = audit(m, lambda: F.cross_entropy(m(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())).by_id("GRAD-001")
    assert finding.severity == Severity.INFO and finding.details["params"] == ["llm.embed_tokens.weight"]


def test_an_accelerate_step_that_zeroes_with_set_to_none_runs_under_the_audit() -> None:
    # Accelerate inspects optimizer.zero_grad's signature for set_to_none: the audit's watch must keep it
    from accelerate import Accelerator

    torch.manual_seed(0)
    accelerator = Accelerator(gradient_accumulation_steps=2, cpu=True)
    m, (x, y) = _classifier(), _data()
    base = torch.optim.AdamW(m.parameters(), lr=1e-3)
    model, opt = accelerator.prepare(m, base)

    def step() -> torch.Tensor:
        total = torch.zeros(())
        for xs, ys in ((x[:8], y[:8]), (x[8:], y[8:])):
            with accelerator.accumulate(model):
                loss = F.cross_entropy(model(xs), ys)
                accelerator.backward(loss)
                opt.step()
                opt.zero_grad(set_to_none=True)
            total = total + loss.detach()
        return total / 2

    report = audit(model, step, optimizer=base, inputs=x)
    assert not report.by_id("LOSS-006") and not report.by_id("LOOP-003"), str(report)


@pytest.mark.parametrize("detached", [True, False])
def test_grad_001_is_a_failure_when_a_whole_library_encoder_is_cut_and_info_for_its_unused_pooler(
        detached: bool) -> None:
    from transformers import BertConfig, BertModel

    class Classifier(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bert = BertModel(BertConfig(vocab_size=30, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                             intermediate_size=32))
            self.head = nn.Linear(16, 2)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            h = self.bert(ids).last_hidden_state  # the pooler runs, and nothing uses its output
            return self.head((h.detach() if detached else h)[:, 0])

    torch.manual_seed(0)
    m, ids = Classifier(), torch.randint(0, 30, (4, 6))
    found = audit(m, lambda: F.cross_entropy(m(ids), torch.tensor([0, 1, 0, 1])),
                  optimizer=torch.optim.AdamW(m.parameters())).by_id("GRAD-001")
    (finding,) = found
    if detached:  # no part of the encoder got a gradient: cut, not an optional part
        assert finding.severity == Severity.ERROR and "bert.embeddings.word_embeddings.weight" in finding.details["params"]
    else:
        assert finding.severity == Severity.INFO and all(p.startswith("bert.pooler.") for p in finding.details["params"])


class _MomentumEncoders(nn.Module):
    """A MoCo-style query encoder and a key copy that runs under no_grad, stays trainable and sits in the optimizer;
    ``follows``: the forward moves the copy towards the query encoder (the momentum update), else it never moves."""

    def __init__(self, follows: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.query, self.key = nn.Linear(8, 4), nn.Linear(8, 4)
        self.key.load_state_dict(self.query.state_dict())
        self.follows = follows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = F.normalize(self.query(x), dim=1)
        with torch.no_grad():
            k = F.normalize(self.key(x + 0.1), dim=1)
            if self.follows:
                for pq, pk in zip(self.query.parameters(), self.key.parameters()):
                    pk.data = pk.data * 0.99 + pq.data * 0.01
        return F.cross_entropy(q @ k.T / 0.1, torch.arange(x.shape[0]))


@pytest.mark.parametrize("follows", [True, False])
def test_a_momentum_copy_the_step_updates_is_info_and_one_that_never_follows_fails(follows: bool) -> None:
    m = _MomentumEncoders(follows)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.1)
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(1))
    report = audit(m, sgd_step(m, opt, lambda: m(x)), optimizer=opt, inputs=x)
    (finding,) = report.by_id("GRAD-001")
    assert set(finding.details["params"]) == {"key.weight", "key.bias"}
    assert finding.severity == (Severity.INFO if follows else Severity.ERROR)
    # the optimizer skips tensors without a gradient: only the forward's own update moved the copy
    assert not report.by_id("OPT-008")
    assert torch.equal(m.key.weight, m.query.weight)  # every value put back


@pytest.mark.parametrize("overridden", [True, False])
def test_batchnorm_kept_in_eval_by_a_train_override_of_the_users_is_info(overridden: bool) -> None:
    class FrozenStats(SmallCNN):
        def train(self, mode: bool = True) -> FrozenStats:
            super().train(mode)
            self.bn.eval()  # pretrained statistics stay frozen; the affine weights train
            return self

    m = FrozenStats() if overridden else SmallCNN()
    m.train()
    m.bn.eval()
    x = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(2))
    (finding,) = audit(m, lambda: F.cross_entropy(m(x), torch.arange(4) % 5)).by_id("MODE-001")
    assert finding.severity == (Severity.INFO if overridden else Severity.WARN)


def test_a_per_token_score_read_at_padding_through_a_positional_mask_is_data_005() -> None:
    from transformers import GPT2Config, GPT2Model

    class RewardModel(nn.Module):
        def __init__(self, pad_id: int) -> None:
            super().__init__()
            self.body = GPT2Model(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=VOCAB, n_positions=16,
                                             bos_token_id=1, eos_token_id=2))
            self.score, self.pad_id = nn.Linear(16, 1), pad_id

        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            hidden = self.body(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
            scores = self.score(hidden).squeeze(-1)
            ends = [(row == self.pad_id).nonzero() for row in input_ids]
            last = [int(e[0]) - 1 if len(e) else input_ids.shape[1] - 1 for e in ends]
            return scores, scores[torch.arange(input_ids.shape[0]), torch.tensor(last)]

    ids = torch.randint(3, VOCAB, (4, 10), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    for row, length in enumerate((10, 6, 8, 5)):
        ids[row, length:], mask[row, length:] = 0, 0
    found = {}
    for pad_id in (0, VOCAB + 7):  # the tokenizer's pad id, and an id that never occurs: the end is the last column
        torch.manual_seed(0)
        m = RewardModel(pad_id)  # called with the mask by position, as the chosen and rejected halves
        report = audit(m, lambda: -F.logsigmoid(m(ids, mask)[1] - m(ids.flip(0), mask.flip(0))[1]).mean(),
                       optimizer=torch.optim.AdamW(m.parameters()))
        found[pad_id] = report.by_id("DATA-005")
    assert not found[0]
    finding = found[VOCAB + 7][0]
    assert finding.severity == Severity.WARN and "per-token output" in finding.message


@pytest.mark.parametrize("cut", [True, False])
def test_a_hand_written_term_cut_through_numpy_is_loss_016_and_a_constant_term_is_not(cut: bool) -> None:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    x = torch.randn(8, 8, generator=torch.Generator().manual_seed(4))
    y = torch.arange(8) % 4
    soft = torch.softmax(torch.randn(8, 4, generator=torch.Generator().manual_seed(5)), dim=1)

    def loss() -> torch.Tensor:
        logits = m(x)
        if cut:  # an embedding penalty on a numpy copy of the outputs: a number in the loss, no gradient
            copied = torch.from_numpy(logits.detach().numpy().copy())
            return F.cross_entropy(logits, y) + 0.1 * copied.pow(2).mean()
        # a KL written as a cross-entropy minus the targets' own entropy: a constant term, on purpose
        target_entropy = -(soft * soft.log()).sum(1).mean()
        return -(soft * logits.log_softmax(1)).sum(1).mean() - target_entropy

    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    found = audit(m, sgd_step(m, opt, loss), optimizer=opt, inputs=x).by_id("LOSS-016")
    assert bool(found) == cut
    if cut:
        assert found[0].severity == Severity.WARN and found[0].details["fn"] == "mean"


@pytest.mark.parametrize("buffers_follow", [False, True])
def test_an_ema_copy_beside_the_model_whose_statistics_never_follow_is_mode_009(buffers_follow: bool) -> None:
    torch.manual_seed(0)
    model = SmallCNN().train()
    ema = copy.deepcopy(model).eval().requires_grad_(False)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(6)) * 2 + 1

    def step() -> torch.Tensor:
        opt.zero_grad()
        loss = F.cross_entropy(model(x), torch.arange(4) % 5)
        loss.backward()
        opt.step()
        with torch.no_grad():
            for e, p in zip(ema.parameters(), model.parameters()):
                e.mul_(0.9).add_(p, alpha=0.1)
            if buffers_follow:
                for e, b in zip(ema.buffers(), model.buffers()):
                    e.copy_(b)
        return loss

    found = audit(model, step, optimizer=opt, inputs=x).by_id("MODE-009")
    assert bool(found) != buffers_follow
    if found:
        assert "ema" in found[0].details["modules"]


@pytest.mark.parametrize("by_value", [True, False])
def test_real_end_tokens_a_loss_mask_by_value_never_supervises_are_data_003(by_value: bool) -> None:
    eos = 2
    m = gpt2(bos_token_id=1, eos_token_id=eos, pad_token_id=eos)  # pad_token = eos_token
    lengths = (9, 12, 6, 10)
    ids = torch.full((4, 12), eos)
    g = torch.Generator().manual_seed(7)
    for row, n in enumerate(lengths):
        ids[row, :n - 1] = torch.randint(3, VOCAB, (n - 1,), generator=g)  # ... then the real end token at n - 1
    attention = (torch.arange(12)[None, :] < torch.tensor(lengths)[:, None]).long()
    targets = ids[:, 1:]
    if by_value:  # the dataset's mask: every target equal to the pad id is dropped, real ends included
        keep = (targets != eos).float()
    else:  # by position: a row's targets after its real end token are padding
        keep = attention[:, 1:].float()

    def loss() -> torch.Tensor:
        logits = m(input_ids=ids, attention_mask=attention).logits[:, :-1]
        per_token = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="none")
        return (per_token * keep.reshape(-1)).sum() / keep.sum()

    opt = torch.optim.AdamW(m.parameters())
    found = audit(m, sgd_step(m, opt, loss), optimizer=opt, inputs=ids).by_id("DATA-003")
    assert bool(found) == by_value
    if found:
        assert found[0].details["real_eos"] == 4


def test_an_ema_helper_object_holding_its_copy_is_looked_into_for_mode_009() -> None:
    class Ema:  # an EMA helper that is not a module itself, its copy an attribute (ema-pytorch's layout)
        def __init__(self, model: nn.Module) -> None:
            self.copy = copy.deepcopy(model).requires_grad_(False)

        @torch.no_grad()
        def update(self, model: nn.Module) -> None:
            for e, p in zip(self.copy.parameters(), model.parameters()):
                e.lerp_(p, 0.01)

    torch.manual_seed(0)
    model = SmallCNN().train()
    ema, opt = Ema(model), torch.optim.SGD(model.parameters(), lr=0.05)
    x = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(8)) * 2 + 1

    def step() -> torch.Tensor:
        opt.zero_grad()
        loss = F.cross_entropy(model(x), torch.arange(4) % 5)
        loss.backward()
        opt.step()
        ema.update(model)
        return loss

    (finding,) = audit(model, step, optimizer=opt, inputs=x).by_id("MODE-009")
    assert finding.details["modules"] == ["ema.copy"]
