"""monitor(): names the first module whose forward output went NaN/+Inf, cheaply, on real models."""

from __future__ import annotations

import gc
import warnings
import weakref
from typing import Any, Iterator

import pytest
import torch
from torch import nn

from guardtower import _monitor_pass
from guardtower.bus import EventBus
from guardtower.errors import ConfigError, NonFiniteActivation
from guardtower.events import HaltEvent, NonFiniteEvent
from guardtower.nonfinite_watch import monitor
from guardtower.severity import Severity
from guardtower.testing import InMemorySink, capture_events

NAN = float("nan")


def tiny_gpt2(attn: str = "eager") -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32,
                        bos_token_id=0, eos_token_id=0, pad_token_id=0)
    config._attn_implementation = attn
    return GPT2LMHeadModel(config)


def tiny_llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=64, max_position_embeddings=32,
                         bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return LlamaForCausalLM(config)


def ids(batch: int = 2, seq: int = 12) -> torch.Tensor:
    return torch.randint(1, 64, (batch, seq), generator=torch.Generator().manual_seed(1))


def poison(param: torch.Tensor, value: float = NAN) -> None:
    with torch.no_grad():
        param.view(-1)[0] = value


def all_hooks(model: nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


@pytest.fixture
def gpt2() -> Iterator[nn.Module]:
    yield tiny_gpt2()


# -- localisation ---------------------------------------------------------------------------------------
def test_nan_weight_in_middle_layer_names_that_module(gpt2: nn.Module) -> None:
    poison(gpt2.transformer.h[1].mlp.c_fc.weight)
    x = ids()
    with capture_events() as events, pytest.raises(NonFiniteActivation) as caught:
        with monitor(gpt2):
            gpt2(input_ids=x, labels=x)
    err = caught.value
    assert err.module == "transformer.h.1.mlp.c_fc"
    assert err.input_nonfinite is False
    assert "transformer.h.1.mlp.c_fc" in str(err) and "input was finite" in str(err)
    # downstream modules are listed as affected, never blamed
    assert err.details["nonfinite_modules"][0] == "transformer.h.1.mlp.c_fc"
    assert "transformer.h.1.mlp.c_proj" in err.details["nonfinite_modules"]
    assert not any(name.startswith("transformer.h.0") for name in err.details["nonfinite_modules"])
    nonfinite = [e for e in events if isinstance(e, NonFiniteEvent)]
    assert [(e.module, e.where, e.input_nonfinite, e.step, e.severity) for e in nonfinite] == [
        ("transformer.h.1.mlp.c_fc", "forward", False, 0, Severity.ERROR)]
    halts = [e for e in events if isinstance(e, HaltEvent)]
    assert [(h.layer, h.reason) for h in halts] == [("transformer.h.1.mlp.c_fc", "nonfinite_activation")]


def test_nonfinite_input_is_reported_as_such(gpt2: nn.Module) -> None:
    embeds = torch.randn(2, 8, 32)
    embeds[1, 3, 5] = NAN
    with pytest.raises(NonFiniteActivation) as caught, monitor(gpt2):
        gpt2(inputs_embeds=embeds)
    # inputs_embeds + position embeddings is functional code; the first module to return NaN is the dropout
    assert caught.value.module == "transformer.drop"
    assert caught.value.input_nonfinite is True


def test_llama_nan_in_attention_projection() -> None:
    model = tiny_llama()
    poison(model.model.layers[0].self_attn.v_proj.weight)
    with pytest.raises(NonFiniteActivation) as caught, monitor(model):
        model(input_ids=ids())
    assert caught.value.module == "model.layers.0.self_attn.v_proj"
    assert caught.value.input_nonfinite is False


def test_positive_inf_from_overflow_is_caught() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4))
    with torch.no_grad():
        model[0].weight.fill_(3e38)
    with pytest.raises(NonFiniteActivation) as caught, monitor(model):
        model(torch.ones(2, 8))
    assert caught.value.module == "0"


def test_first_in_execution_order_across_many_chunks() -> None:
    depth = _monitor_pass.CHUNK_MAX_SLOTS + 40  # forces several reductions inside one forward
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(depth)])
    poison(model[depth - 10].weight)
    with pytest.raises(NonFiniteActivation) as caught, monitor(model):
        model(torch.randn(3, 4))
    assert caught.value.module == str(depth - 10)
    assert caught.value.details["nonfinite_modules"][:2] == [str(depth - 10), str(depth - 9)]


class DictOut(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> dict[str, Any]:
        h = self.proj(x)
        return {"hidden": h, "extras": (h.sum(), [torch.log(-h.abs() - 1)])}  # log of a negative: NaN


def test_nan_only_inside_nested_dict_and_list_output() -> None:
    model = DictOut()
    with pytest.raises(NonFiniteActivation) as caught, monitor(model):
        model(torch.randn(2, 4))
    assert caught.value.module == "DictOut"
    assert caught.value.input_nonfinite is False


# -- masks: -Inf is legitimate --------------------------------------------------------------------------
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_gpt2_padding_mask_no_false_alarm(attn: str) -> None:
    model = tiny_gpt2(attn)
    x = ids(3, 10)
    mask = torch.ones_like(x)
    mask[0, :4] = 0  # left padding
    mask[2, 7:] = 0  # right padding
    with monitor(model) as mon:
        out = model(input_ids=x, attention_mask=mask, labels=x)
        out.loss.backward()
    assert (mon.passes, mon.nonfinite_passes) == (1, 0)


def test_llama_padding_mask_no_false_alarm() -> None:
    model = tiny_llama()
    x = ids(2, 10)
    mask = torch.ones_like(x)
    mask[1, :5] = 0
    with monitor(model) as mon:
        model(input_ids=x, attention_mask=mask, labels=x).loss.backward()
    assert (mon.passes, mon.nonfinite_passes) == (1, 0)


class CausalMask(nn.Module):
    """A mask producer: an additive float mask with -inf above the diagonal (as nn.Transformer builds it)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.Transformer.generate_square_subsequent_mask(x.shape[1])


class TinyEncoderLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, 32)
        self.mask = CausalMask()
        layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(32, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        return self.head(self.encoder(h, mask=self.mask(h), is_causal=True))


def test_minus_inf_mask_producer_is_not_an_alarm_but_nan_still_is() -> None:
    torch.manual_seed(0)
    model = TinyEncoderLM()
    x = ids()
    with monitor(model) as mon:
        model(x).sum().backward()
    assert mon.nonfinite_passes == 0
    poison(model.encoder.layers[1].linear1.weight)
    with pytest.raises(NonFiniteActivation) as caught, monitor(model):
        model(x)
    assert caught.value.module == "encoder.layers.1.linear1"


class NegInfThenConsumer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.producer = nn.Identity()
        self.norm = nn.LayerNorm(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.producer(x))


def test_minus_inf_is_reported_where_it_turns_into_nan() -> None:
    """The documented rule: -Inf alone is ignored; the module that turns it into NaN is named."""
    x = torch.zeros(2, 4)
    x[0, 1] = float("-inf")
    with pytest.raises(NonFiniteActivation) as caught, monitor(NegInfThenConsumer()) as mon:
        mon.model(x)
    assert caught.value.module == "norm"
    assert caught.value.input_nonfinite is False  # -Inf in the input is not counted


# -- modes ----------------------------------------------------------------------------------------------
def test_warn_mode_warns_once_per_episode_and_keeps_running(gpt2: nn.Module) -> None:
    poison(gpt2.transformer.h[0].attn.c_attn.weight)
    x = ids()
    with warnings.catch_warnings(record=True) as caught, monitor(gpt2, on_nonfinite="warn") as mon:
        warnings.simplefilter("always")
        for _ in range(3):
            gpt2(input_ids=x)
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(messages) == 1
    assert "'transformer.h.0.attn.c_attn'" in messages[0] and "forward pass 0" in messages[0]
    assert (mon.passes, mon.nonfinite_passes) == (3, 3)


def test_event_mode_publishes_to_sinks_with_the_pass_counter(gpt2: nn.Module) -> None:
    sink = InMemorySink()
    bus = EventBus([sink])
    x = ids()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # event mode neither warns nor raises
        with monitor(gpt2, on_nonfinite="event", bus=bus) as mon:
            gpt2(input_ids=x)
            gpt2(input_ids=x)
            poison(gpt2.lm_head.weight)  # tied with wte; row 0 is token 0, which the batch never looks up
            gpt2(input_ids=x)
    assert bus.flush(5)
    events = sink.of_kind("nonfinite")
    assert len(events) == 1
    event = events[0]
    assert isinstance(event, NonFiniteEvent)
    assert (event.module, event.where, event.input_nonfinite, event.step) == ("lm_head", "forward", False, 2)
    assert event.severity == Severity.ERROR  # a non-finite value is a failure, whatever on_nonfinite says
    assert mon.last == event
    assert not bus.stats()["closed"]  # a bus passed in belongs to the caller
    bus.close()


def test_sinks_argument_gets_an_owned_bus(gpt2: nn.Module) -> None:
    sink = InMemorySink()
    poison(gpt2.transformer.ln_f.weight)
    with monitor(gpt2, on_nonfinite="event", sinks=[sink]):
        gpt2(input_ids=ids())
    # the monitor made the bus, so closing it on exit delivered everything
    assert [e.module for e in sink.of_kind("nonfinite")] == ["transformer.ln_f"]


# -- in-place ops ---------------------------------------------------------------------------------------
def inplace_mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(inplace=True), nn.Linear(8, 8), nn.ReLU(inplace=True),
                         nn.Linear(8, 2))


def test_inplace_relu_does_not_hide_the_culprit() -> None:
    model = inplace_mlp()
    poison(model[2].weight)
    with pytest.raises(NonFiniteActivation) as caught, monitor(model):
        model(torch.randn(4, 6))
    assert caught.value.module == "2"
    assert caught.value.input_nonfinite is False


def test_inplace_relu_clean_model_and_outputs_unchanged() -> None:
    model = inplace_mlp()
    x = torch.randn(4, 6)
    expected = model(x)
    with monitor(model) as mon:
        got = model(x)
    assert torch.equal(expected, got) and mon.nonfinite_passes == 0


class MutatesChildOutput(nn.Module):
    """A parent that corrupts a child's output in place before handing it to the next child."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        with torch.no_grad():
            h[0, 0] = NAN
        return self.b(h)


def test_child_output_changed_in_place_later_is_not_blamed_on_the_child() -> None:
    with pytest.raises(NonFiniteActivation) as caught, monitor(MutatesChildOutput()) as mon:
        mon.model(torch.randn(2, 4))
    assert caught.value.module == "b"
    assert caught.value.input_nonfinite is True


# -- transparency and lifecycle -------------------------------------------------------------------------
def test_outputs_and_gradients_unchanged(gpt2: nn.Module) -> None:
    x = ids()
    torch.manual_seed(5)
    plain = gpt2(input_ids=x, labels=x)
    plain.loss.backward()
    plain_grads = [p.grad.clone() for p in gpt2.parameters()]
    gpt2.zero_grad(set_to_none=True)
    torch.manual_seed(5)
    with monitor(gpt2):
        watched = gpt2(input_ids=x, labels=x)
        watched.loss.backward()
    assert torch.equal(plain.logits, watched.logits)
    assert all(torch.equal(a, p.grad) for a, p in zip(plain_grads, gpt2.parameters()))


def test_hooks_removed_after_exit_also_on_exception(gpt2: nn.Module) -> None:
    assert all_hooks(gpt2) == 0
    with monitor(gpt2):
        assert all_hooks(gpt2) >= len(list(gpt2.modules()))
    assert all_hooks(gpt2) == 0
    with pytest.raises(KeyError), monitor(gpt2):
        raise KeyError("boom")
    assert all_hooks(gpt2) == 0
    poison(gpt2.transformer.h[0].ln_1.weight)
    with pytest.raises(NonFiniteActivation), monitor(gpt2):
        gpt2(input_ids=ids())
    assert all_hooks(gpt2) == 0


def test_nested_enter_and_two_monitors(gpt2: nn.Module) -> None:
    outer = monitor(gpt2, on_nonfinite="event")
    with outer:
        with outer:
            gpt2(input_ids=ids())
        assert outer.active  # still attached until the outermost exit
        with monitor(gpt2.transformer.h[1], on_nonfinite="event") as inner:
            gpt2(input_ids=ids())
        assert not inner.active and outer.active
    assert not outer.active and all_hooks(gpt2) == 0
    assert outer.passes == 2 and inner.passes == 1
    # reusable after exit
    with outer:
        gpt2(input_ids=ids())
    assert outer.passes == 3


def test_model_called_twice_per_step_counts_each_pass(gpt2: nn.Module) -> None:
    good, bad = torch.randn(2, 6, 32), torch.randn(2, 6, 32)
    bad[0, 0, 0] = float("inf")
    with capture_events() as events, monitor(gpt2, on_nonfinite="event") as mon:
        for _ in range(2):
            a = gpt2(inputs_embeds=good).logits
            b = gpt2(inputs_embeds=bad).logits
            (a.mean() + b.mean()).backward()
    steps = [e.step for e in events if isinstance(e, NonFiniteEvent)]
    assert mon.passes == 4 and mon.nonfinite_passes == 2
    assert steps == [1, 3]  # a clean pass in between starts a new episode


def test_forward_that_raises_leaves_monitor_usable() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    with monitor(model) as mon:
        with pytest.raises(RuntimeError):
            model(torch.randn(2, 5))  # shape error inside the first Linear
        model(torch.randn(2, 4))
        poison(model[1].weight)
        with pytest.raises(NonFiniteActivation) as caught:
            model(torch.randn(2, 4))
    assert caught.value.details["step"] == 2 and mon.passes == 3


def test_recorded_outputs_are_released_after_the_forward() -> None:
    model = nn.Sequential(nn.Linear(8, 64), nn.GELU(), nn.Linear(64, 8))
    seen: list[weakref.ref[torch.Tensor]] = []
    model[1].register_forward_hook(lambda m, a, out: seen.append(weakref.ref(out)))
    with monitor(model), torch.no_grad():
        model(torch.randn(4, 8))
        gc.collect()
        assert seen[0]() is None  # the monitor holds no reference once the pass is reduced


def test_deferred_check_reports_late_but_never_loses_a_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    """As on CUDA when the GPU lags: flags are read only once MAX_LAG passes wait, or at exit."""
    monkeypatch.setattr(_monitor_pass.PassResult, "ready", lambda self: False)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    poison(model[1].weight)
    with monitor(model) as mon:
        for _ in range(_monitor_pass.MAX_LAG):
            model(torch.randn(2, 4))  # not checked yet: the host does not wait
        with pytest.raises(NonFiniteActivation) as caught:
            model(torch.randn(2, 4))
    assert caught.value.details["step"] == 0
    # the passes already run when it raised belong to the same incident: counted, not raised again at exit
    assert mon.passes == mon.nonfinite_passes == _monitor_pass.MAX_LAG + 1
    with warnings.catch_warnings(record=True) as warned, monitor(model, on_nonfinite="warn"):
        warnings.simplefilter("always")
        model(torch.randn(2, 4))
        assert not warned
    assert any("'1'" in str(w.message) for w in warned)  # drained at exit


# -- bad input ------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "argument"),
    [({"model": "gpt2"}, "model"), ({"on_nonfinite": "ignore"}, "on_nonfinite"),
     ({"on_nonfinite": None}, "on_nonfinite"), ({"bus": object()}, "bus")],
)
def test_bad_arguments_raise_config_error_naming_the_argument(kwargs: dict[str, Any], argument: str) -> None:
    model = nn.Linear(2, 2)
    args = {"model": model, **kwargs}
    with pytest.raises(ConfigError) as caught:
        monitor(args.pop("model"), **args)
    assert caught.value.argument == argument
    assert "Fix:" in str(caught.value)
    assert all_hooks(model) == 0


def test_checkpoint_recompute_and_direct_submodule_calls_are_not_held(gpt2: nn.Module) -> None:
    if hasattr(gpt2, "activation_checkpointing_enable"):
        gpt2.activation_checkpointing_enable({"use_reentrant": False})
    else:  # transformers < 5
        gpt2.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    gpt2.train()
    outputs: list[weakref.ref[torch.Tensor]] = []
    gpt2.transformer.h[0].mlp.c_fc.register_forward_hook(lambda m, a, out: outputs.append(weakref.ref(out)))
    x = ids()
    with monitor(gpt2) as mon:
        gpt2(input_ids=x, labels=x).loss.backward()  # the backward re-runs each block's forward
        with torch.no_grad():
            gpt2.transformer.h[1].mlp(torch.randn(2, 3, 32))
        gc.collect()
        assert len(outputs) == 2 and outputs[1]() is None  # the recomputed activation was freed
        assert mon.passes == 1 and mon.nonfinite_passes == 0


def test_package_level_monitor_is_callable_whatever_was_imported_first() -> None:
    import guardtower
    import guardtower.nonfinite_watch as submodule

    model = nn.Linear(2, 2)
    for entry in (guardtower.monitor, submodule.monitor, monitor):
        with entry(model, on_nonfinite="warn") as mon:
            model(torch.ones(1, 2))
        assert mon.passes == 1


def test_leaving_the_monitor_is_bounded_when_a_sink_hangs(monkeypatch: pytest.MonkeyPatch) -> None:
    import threading

    import guardtower.nonfinite_watch as watch
    from guardtower.bus import BaseSink

    release = threading.Event()

    class Hanging(BaseSink):
        name = "hanging"

        def handle(self, event: Any) -> None:
            release.wait(120)  # a destination that never answers

    monkeypatch.setattr(watch, "CLOSE_TIMEOUT_S", 0.5)
    model = nn.Linear(2, 2)
    left = threading.Event()

    def run() -> None:
        with monitor(model, on_nonfinite="event", sinks=[Hanging()]):
            model(torch.full((1, 2), float("nan")))
        left.set()

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    try:
        assert left.wait(60), "monitor() did not return while its sink hung"
    finally:
        release.set()
        worker.join(60)
