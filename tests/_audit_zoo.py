"""Correct training setups of many transformers architectures, built from tiny configs (no hub access).

Each entry builds a model and a batch; ``setups`` combines them with a training regime: a full fine-tune,
LoRA (peft, ``target_modules="all-linear"``, new heads in ``modules_to_save``), or activation checkpointing
with bf16 autocast.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

V = 64  # vocabulary
B, T = 4, 16  # batch, sequence length


def _ids(seed: int = 0, vocab: int = V) -> torch.Tensor:
    return torch.randint(4, vocab, (B, T), generator=torch.Generator().manual_seed(seed))


def _lm_batch() -> dict[str, torch.Tensor]:
    ids = _ids()
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def _cls_batch() -> dict[str, torch.Tensor]:
    ids = _ids()
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": torch.tensor([0, 1, 1, 0])}


def _mlm_batch() -> dict[str, torch.Tensor]:
    ids = _ids()
    labels = torch.full_like(ids, -100)
    labels[:, ::4] = ids[:, ::4]
    ids[:, ::4] = 3  # the labelled positions are masked in the input, as a masked-LM collator does
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}


def _s2s_batch() -> dict[str, torch.Tensor]:
    ids = _ids()
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": _ids(1)}


def _electra_batch() -> dict[str, torch.Tensor]:
    ids = _ids()
    mask = torch.ones_like(ids)
    mask[-1, -4:] = 0  # a padded sequence: the discriminator's loss drops padded positions itself
    ids[-1, -4:] = 0
    labels = (torch.arange(T).expand(B, T) % 3 == 0).long()  # 0/1 "replaced" labels everywhere, as ELECTRA's data
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _pixels(channels: int = 3, size: int = 32) -> torch.Tensor:
    return torch.randn(B, channels, size, size, generator=torch.Generator().manual_seed(2))


def _text_with_eos() -> torch.Tensor:
    ids = _ids()
    ids[:, -1] = 2  # CLIP pools the text at its EOS token: a text without one pools position 0
    return ids


def _clip_batch() -> dict[str, torch.Tensor]:
    ids = _text_with_eos()
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "pixel_values": _pixels(), "return_loss": True}


def _siglip_batch() -> dict[str, torch.Tensor]:
    return {"input_ids": _text_with_eos(), "pixel_values": _pixels(), "return_loss": True}


def _audio_batch() -> dict[str, torch.Tensor]:
    return {"input_values": torch.randn(B, 1600, generator=torch.Generator().manual_seed(3)),
            "labels": torch.tensor([0, 1, 1, 0])}


@dataclass(frozen=True)
class Arch:
    name: str
    build: Callable[[], nn.Module]
    batch: Callable[[], dict[str, Any]]
    heads: tuple[str, ...] = ()
    """freshly initialised heads a LoRA fine-tune must train (peft ``modules_to_save``)"""
    lora_exclude: tuple[str, ...] = ()
    """linears LoRA must not target: nn.MultiheadAttention reads ``out_proj.weight`` directly, so an adapter
    there never runs (the audit reports it as GRAD-001; see the corpus)"""


def _t(cls_name: str, config_name: str, **cfg: Any) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        import transformers

        transformers.logging.set_verbosity_error()
        torch.manual_seed(0)
        config = getattr(transformers, config_name)(**cfg)
        return getattr(transformers, cls_name)(config)

    return build


_DEC = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)
_ENC = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=64, pad_token_id=0)
_VIS = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=32,
            patch_size=8)
_TXT = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=64, eos_token_id=2)

ARCHS: list[Arch] = [
    Arch("gpt2", _t("GPT2LMHeadModel", "GPT2Config", vocab_size=V, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                    bos_token_id=1, eos_token_id=2), _lm_batch),
    Arch("llama", _t("LlamaForCausalLM", "LlamaConfig", **_DEC), _lm_batch),
    Arch("mistral", _t("MistralForCausalLM", "MistralConfig", **_DEC), _lm_batch),
    Arch("qwen2", _t("Qwen2ForCausalLM", "Qwen2Config", **_DEC), _lm_batch),
    Arch("gemma", _t("GemmaForCausalLM", "GemmaConfig", head_dim=8, **_DEC), _lm_batch),
    Arch("phi3", _t("Phi3ForCausalLM", "Phi3Config", **_DEC), _lm_batch),
    Arch("gpt_neox", _t("GPTNeoXForCausalLM", "GPTNeoXConfig", vocab_size=V, hidden_size=32, intermediate_size=64,
                        num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64), _lm_batch),
    Arch("opt", _t("OPTForCausalLM", "OPTConfig", vocab_size=V, hidden_size=32, ffn_dim=64, num_hidden_layers=2,
                   num_attention_heads=4, max_position_embeddings=64, word_embed_proj_dim=32), _lm_batch),
    Arch("mixtral_moe", _t("MixtralForCausalLM", "MixtralConfig", num_local_experts=4, num_experts_per_tok=2,
                           **_DEC), _lm_batch),
    Arch("qwen2_moe", _t("Qwen2MoeForCausalLM", "Qwen2MoeConfig", num_experts=4, num_experts_per_tok=2,
                         moe_intermediate_size=32, shared_expert_intermediate_size=32, **_DEC), _lm_batch),
    Arch("bert_cls", _t("BertForSequenceClassification", "BertConfig", **_ENC), _cls_batch, ("classifier",)),
    Arch("roberta_mlm", _t("RobertaForMaskedLM", "RobertaConfig", **{**_ENC, "pad_token_id": 1}), _mlm_batch),
    Arch("distilbert_cls", _t("DistilBertForSequenceClassification", "DistilBertConfig", vocab_size=V, dim=32,
                              hidden_dim=64, n_layers=2, n_heads=4, max_position_embeddings=64),
         _cls_batch, ("pre_classifier", "classifier")),
    Arch("electra_disc", _t("ElectraForPreTraining", "ElectraConfig", embedding_size=32, **_ENC), _electra_batch,
         ("discriminator_predictions",)),
    Arch("t5", _t("T5ForConditionalGeneration", "T5Config", vocab_size=V, d_model=32, d_kv=8, d_ff=64, num_layers=2,
                  num_heads=4, decoder_start_token_id=0, pad_token_id=0), _s2s_batch),
    Arch("bart", _t("BartForConditionalGeneration", "BartConfig", vocab_size=V, d_model=32, encoder_layers=2,
                    decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
                    decoder_ffn_dim=64, max_position_embeddings=64, pad_token_id=0, bos_token_id=1,
                    eos_token_id=2, decoder_start_token_id=2), _s2s_batch),
    Arch("vit", _t("ViTForImageClassification", "ViTConfig", num_labels=2, **_VIS),
         lambda: {"pixel_values": _pixels(), "labels": torch.tensor([0, 1, 1, 0])}, ("classifier",)),
    Arch("wav2vec2_layerdrop", _t("Wav2Vec2ForSequenceClassification", "Wav2Vec2Config", hidden_size=32,
                                  intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                                  conv_dim=(16, 16), conv_stride=(5, 4), conv_kernel=(10, 4), num_conv_pos_embeddings=8,
                                  num_conv_pos_embedding_groups=4, layerdrop=0.5, num_labels=2,
                                  classifier_proj_size=16, mask_time_prob=0.0), _audio_batch,
         ("projector", "classifier")),
    Arch("clip", _t("CLIPModel", "CLIPConfig", text_config=dict(_TXT), vision_config=dict(_VIS), projection_dim=16),
         _clip_batch),
    Arch("siglip", _t("SiglipModel", "SiglipConfig", text_config=dict(_TXT), vision_config=dict(_VIS)),
         _siglip_batch, lora_exclude=("vision_model.head.attention.out_proj",)),
]


def build(arch: Arch, regime: str) -> tuple[nn.Module, Callable[[], Any], torch.optim.Optimizer]:
    """The model prepared for ``regime`` ("full", "lora" or "ckpt_bf16"), its step and its optimizer."""
    model = arch.build()
    if regime == "lora":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=1, lora_alpha=2, lora_dropout=0.0, target_modules="all-linear",
                                                 modules_to_save=list(arch.heads) or None,
                                                 exclude_modules=list(arch.lora_exclude) or None))
    if regime == "ckpt_bf16":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    batch = arch.batch()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.0)

    def step() -> Any:
        if regime == "ckpt_bf16":
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return model(**batch).loss
        return model(**batch).loss

    return model, step, opt
