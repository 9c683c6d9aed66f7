"""``weight_tying``: shared parameters (reported for information) and tying that the config promises but
the tensors do not keep."""

from __future__ import annotations

from typing import Any, Iterable

from guardtower.preflight._registry import AuditContext, check
from guardtower.report import Finding
from guardtower.severity import Severity

__all__: list[str] = []


def _config_ties(model: Any) -> bool:
    config = getattr(model, "config", None)
    if config is None:
        return False
    getter = getattr(config, "get_text_config", None)
    text = getter() if callable(getter) else config
    return bool(getattr(text, "tie_word_embeddings", False))


def _tying_model(model: Any) -> Any:
    """The model whose embeddings ``tie_word_embeddings`` is about: the decoder of a composite encoder-decoder
    (``EncoderDecoderModel``, ``VisionEncoderDecoderModel``: two models, the decoder tied within itself, its
    input embeddings not the encoder's), else the model itself."""
    config = getattr(model, "config", None)
    decoder = getattr(model, "decoder", None)
    if hasattr(getattr(config, "decoder", None), "to_dict") and callable(getattr(decoder, "get_output_embeddings", None)):
        return decoder
    return model


@check("weight_tying", emits=("TIE-001", "TIE-002"), static=True)
def check_weight_tying(ctx: AuditContext) -> Iterable[Finding]:
    """TIE-001 tied (shared) parameters, TIE-002 config says tied but the embeddings are separate tensors."""
    findings = []
    groups: dict[int, list[str]] = {}
    for name, p in ctx.model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(name)
    shared = [names for names in groups.values() if len(names) > 1]
    if shared:
        findings.append(Finding(
            "weight_tying", Severity.INFO,
            f"{len(shared)} parameter(s) are shared: " + "; ".join(" = ".join(n) for n in shared[:5])
            + " (they get one gradient and one optimizer entry)",
            "TIE-001", {"groups": shared},
        ))
    tying = _tying_model(ctx.model)
    get_in = getattr(tying, "get_input_embeddings", None)
    get_out = getattr(tying, "get_output_embeddings", None)
    if _config_ties(tying) and callable(get_in) and callable(get_out):
        try:
            inp, out = get_in(), get_out()
        except (NotImplementedError, AttributeError):
            inp = out = None
        w_in, w_out = getattr(inp, "weight", None), getattr(out, "weight", None)
        if w_in is not None and w_out is not None and w_in is not w_out:
            findings.append(Finding(
                "weight_tying", Severity.WARN,
                "the config sets tie_word_embeddings=True but the input and output embeddings are separate tensors "
                "(the head was replaced or resized after tying, or tie_weights() was not called): they will drift "
                "apart and checkpoints will not load as the config describes",
                "TIE-002", {"input_embeddings": type(inp).__name__, "output_embeddings": type(out).__name__},
            ))
    return findings
