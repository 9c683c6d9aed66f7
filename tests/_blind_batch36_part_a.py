"""Blind batch 36 (part a): silent transformer fine-tuning bugs from public GitHub threads, each with its fixed twin.

Collected by someone who does not write the audit's checks. Every case builds the user's setup on a tiny model
(transformers Whisper, BERT and Llama models from tiny configs in code, a plain torch intent/entity transformer; nothing
is downloaded) and proves the bug without the audit on real tensors and real steps.
"""

from __future__ import annotations

import math
import re

import torch
import torch.nn.functional as F
from torch import nn

from tests._blind import BlindCase, Case
from tests._blind_batch5 import _gen, _kw

# --------------------------------------------------------------------------------------------- case-01
# espnet/notebook PR #51 ("Fix bug in OWSM finetuning with LoRA"): the ESPnetEZ demo fine-tunes the OWSM speech-to-text
# model (a Whisper-style attention encoder-decoder) with LoRA. Its `build_model_fn` loads the pretrained model and calls
# `create_lora_adapter(model, target_modules=["w_1", "w_2", "merge_proj"])`, which swaps the targeted Linear layers for
# loralib-style LoRA layers, but nothing freezes the rest of the model; `replace_module` even hands the new layer the
# old (trainable) weight Parameter. So the "LoRA" run is a full fine-tune of every OWSM weight with the LoRA learning
# rate (Adam, lr 0.002, warmup schedule). The loss falls like a normal run; the pretrained weights quietly drift and the
# saved "adapter" is a whole new model. Fix in the PR: `freeze_parameters(model)` (every requires_grad -> False) before
# `create_lora_adapter`, so only lora_A / lora_B train.

_C01_FEATS = torch.randn(4, 8, 32, generator=_gen(3601))
_C01_LABELS = torch.randint(4, 60, (4, 7), generator=_gen(3602))
_C01_LABELS[1, 5:] = -100
_C01_LABELS[3, 4:] = -100
_C01_TARGETS = ["fc1", "fc2"]  # the feed-forward projections (ESPnet's w_1 / w_2)


class _LoraLinear(nn.Linear):
    """A loralib-style LoRA Linear (espnet2.layers LoRA backend): frozen base weight plus a scaled B @ A update."""

    def __init__(self, in_features: int, out_features: int, bias: bool, r: int = 4, lora_alpha: int = 4):
        super().__init__(in_features, out_features, bias=bias)
        self.lora_A = nn.Parameter(torch.empty(r, in_features))
        self.lora_B = nn.Parameter(torch.zeros(out_features, r))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        self.scaling = lora_alpha / r
        self.weight.requires_grad = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias) + (x @ self.lora_A.t() @ self.lora_B.t()) * self.scaling


def _c01_create_lora_adapter(model: nn.Module, target_modules: list[str]) -> None:
    """espnet2 create_lora_adapter + replace_module: new LoRA layer, old weight and bias Parameters copied in."""
    for key in [k for k, _ in model.named_modules()]:
        if not any(key.endswith(t) for t in target_modules):
            continue
        parent = model.get_submodule(".".join(key.split(".")[:-1]))
        name = key.split(".")[-1]
        old = model.get_submodule(key)
        new = _LoraLinear(old.in_features, old.out_features, bias=old.bias is not None)
        setattr(parent, name, new)
        new.weight = old.weight
        if old.bias is not None:
            new.bias = old.bias
    model.eval()


def _c01_setup(bug: bool):
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    torch.manual_seed(0)
    cfg = WhisperConfig(vocab_size=64, num_mel_bins=8, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                        decoder_attention_heads=2, d_model=32, encoder_ffn_dim=64, decoder_ffn_dim=64,
                        max_source_positions=16, max_target_positions=16, pad_token_id=0, bos_token_id=1,
                        eos_token_id=2, decoder_start_token_id=3, dropout=0.0)
    model = WhisperForConditionalGeneration(cfg)
    model.train()
    if not bug:
        for p in model.parameters():  # the PR's freeze_parameters(model)
            if p.requires_grad:
                p.requires_grad = False
    _c01_create_lora_adapter(model, _C01_TARGETS)
    model.train()  # the ESPnet trainer puts the model back in train mode every epoch
    opt = torch.optim.Adam(model.parameters(), lr=0.002, weight_decay=1e-6)
    warmup = 25.0  # ESPnet WarmupLR (the demo's warmup_steps=15000, scaled down)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: warmup ** 0.5 * min((s + 1) ** -0.5, (s + 1) * warmup ** -1.5))
    batch = {"input_features": _C01_FEATS, "labels": _C01_LABELS}

    def step() -> torch.Tensor:
        opt.zero_grad()
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        sched.step()
        return loss

    return model, opt, sched, batch, step


def _c01_build(bug: bool) -> Case:
    model, opt, sched, batch, step = _c01_setup(bug)
    return model, step, _kw(optimizer=opt, inputs=batch, lr_scheduler=sched, total_steps=100)


def _c01_proof(bug: bool) -> bool:
    """After one training step, has a pretrained weight outside the adapters (decoder q_proj) moved?"""
    model, _, _, _, step = _c01_setup(bug)
    w = model.model.decoder.layers[0].self_attn.q_proj.weight
    before = w.detach().clone()
    step()
    return not torch.equal(w.detach(), before)


# --------------------------------------------------------------------------------------------- case-02
# huggingface/sentence-transformers issue #3208 (fixed by PR #3767): `Pooling(pooling_mode="cls")` took the CLS
# embedding as `token_embeddings[:, 0]`, which is right only when the tokenizer pads on the right. With a left-padding
# tokenizer every shorter sequence in the batch has a [PAD] at position 0, so its "sentence embedding" is the hidden state
# of a pad token. Contrastive training (MultipleNegativesRankingLoss) still runs and the loss still falls; the
# embeddings just depend on how much padding the batch happened to need. Fix in the PR: pick the first non-pad position,
# `attention_mask.argmax(dim=1)`, and gather that row.

_C02_VOCAB, _C02_CLS, _C02_SEP, _C02_PAD = 60, 1, 2, 0


def _c02_left_padded(seed: int, lens: list[int], width: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.full((len(lens), width), _C02_PAD, dtype=torch.long)
    mask = torch.zeros(len(lens), width, dtype=torch.long)
    body = torch.randint(3, _C02_VOCAB, (len(lens), width), generator=_gen(seed))
    for i, n in enumerate(lens):
        row = torch.cat([torch.tensor([_C02_CLS]), body[i, : n - 2], torch.tensor([_C02_SEP])])
        ids[i, width - n:] = row
        mask[i, width - n:] = 1
    return ids, mask


_C02_A_IDS, _C02_A_MASK = _c02_left_padded(3611, [10, 6, 8, 5], 10)
_C02_P_IDS, _C02_P_MASK = _c02_left_padded(3612, [7, 10, 4, 9], 10)


def _c02_model():
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=_C02_VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=64, max_position_embeddings=32, pad_token_id=_C02_PAD,
                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return BertModel(cfg, add_pooling_layer=False).train()


def _c02_pool(bug: bool, token_embeddings: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    if bug:
        return token_embeddings[:, 0]
    first = attention_mask.argmax(dim=1)
    return token_embeddings[torch.arange(token_embeddings.size(0)), first]


def _c02_setup(bug: bool):
    from transformers import get_linear_schedule_with_warmup

    model = _c02_model()

    def embed(ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return _c02_pool(bug, model(input_ids=ids, attention_mask=mask).last_hidden_state, mask)

    opt = torch.optim.AdamW(model.parameters(), lr=2e-4)
    sched = get_linear_schedule_with_warmup(opt, num_warmup_steps=0, num_training_steps=20)
    batch = {"input_ids": _C02_A_IDS, "attention_mask": _C02_A_MASK}

    def step() -> torch.Tensor:
        opt.zero_grad()
        a = F.normalize(embed(_C02_A_IDS, _C02_A_MASK), dim=-1)
        p = F.normalize(embed(_C02_P_IDS, _C02_P_MASK), dim=-1)
        scores = a @ p.t() * 20.0  # MultipleNegativesRankingLoss: cos_sim * scale, in-batch negatives
        loss = F.cross_entropy(scores, torch.arange(scores.size(0)))
        loss.backward()
        opt.step()
        sched.step()
        return loss

    return model, opt, sched, batch, step, embed


def _c02_build(bug: bool) -> Case:
    model, opt, sched, batch, step, _ = _c02_setup(bug)
    return model, step, _kw(optimizer=opt, inputs=batch, lr_scheduler=sched, total_steps=20)


def _c02_proof(bug: bool) -> bool:
    """After a step, does a left-padded sentence's embedding change when only the token ids under its padding change?"""
    model, _, _, _, step, embed = _c02_setup(bug)
    step()
    other = _C02_A_IDS.clone()
    other[_C02_A_MASK == 0] = 7
    with torch.no_grad():
        a = embed(_C02_A_IDS, _C02_A_MASK)
        b = embed(other, _C02_A_MASK)
    return bool((a - b).abs().max() > 1e-5)


# --------------------------------------------------------------------------------------------- case-03
# MakazhanAlpamys/Soup issue #793 (fixed by PR #931): `training.rope_scaling_type` (linear / dynamic / yarn / ...) was
# applied after `AutoModelForCausalLM.from_pretrained`, by writing the scaling into `model.config` (and raising
# `max_position_embeddings`). On transformers 5 the rotary embedding computes `inv_freq` and `attention_scaling` once in
# `__init__`, so the write is never read: the run logs "Long-context enabled", trains on sequences longer than the base
# context, and the rotary module still uses the base model's unscaled frequencies. Nothing errors and the loss falls.
# Fix in the PR: put the RoPE parameters into the config before the model is constructed.

_C03_IDS = torch.randint(3, 40, (2, 96), generator=_gen(3621))
_C03_ROPE = {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}


def _c03_config(**kw):
    from transformers import LlamaConfig

    base = {"vocab_size": 40, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 2, "num_key_value_heads": 2, "max_position_embeddings": 64, "pad_token_id": 0,
            "bos_token_id": 1, "eos_token_id": 2}
    base.update(kw)
    return LlamaConfig(**base)


def _c03_setup(bug: bool):
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    if bug:
        model = LlamaForCausalLM(_c03_config())  # stands in for from_pretrained(cfg.base)
        model.config.rope_parameters = dict(_C03_ROPE)  # "apply RoPE scaling after model load"
        model.config.max_position_embeddings = 256
    else:
        cfg = _c03_config()
        cfg.rope_parameters = dict(_C03_ROPE)
        cfg.max_position_embeddings = 256
        model = LlamaForCausalLM(cfg)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=2e-4)
    batch = {"input_ids": _C03_IDS, "attention_mask": torch.ones_like(_C03_IDS), "labels": _C03_IDS}

    def step() -> torch.Tensor:
        opt.zero_grad()
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        return loss

    return model, opt, batch, step


def _c03_build(bug: bool) -> Case:
    model, opt, batch, step = _c03_setup(bug)
    return model, step, _kw(optimizer=opt, inputs=batch)


def _c03_proof(bug: bool) -> bool:
    """After a step, do the rotary cos/sin the model applies differ from what its own config's RoPE scaling gives?"""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    model, _, _, step = _c03_setup(bug)
    step()
    cfg = model.config
    inv_freq, _ = ROPE_INIT_FUNCTIONS[cfg.rope_parameters["rope_type"]](cfg, torch.device("cpu"))
    pos = torch.arange(_C03_IDS.size(1)).unsqueeze(0)
    x = torch.zeros(1, pos.size(1), cfg.hidden_size)
    with torch.no_grad():
        cos, _ = model.model.rotary_emb(x, pos)
    freqs = pos[0].float()[:, None] * inv_freq.float()[None, :]
    expected = torch.cat([freqs, freqs], dim=-1).cos()
    return bool((cos[0] - expected).abs().max() > 1e-4)


# --------------------------------------------------------------------------------------------- case-04
# cheesama/DIET-pytorch PR #3 ("update entity label: Consider [CLS] Token position"): the joint intent/entity
# transformer encodes each utterance as [BOS] + characters + [EOS], but the dataset wrote the entity tags at the
# character offsets of the raw text (`range(start, end + 1)`), so every entity label sat one token to the left of the
# entity: on the character before it (or on [BOS] for an entity at the start). The token-classification loss still
# falls, the model learns to tag the wrong positions. Fix in the PR: shift by the [BOS] token,
# `range(start + 1, end + 2)` (kept as written: its span still ends one past the entity, the shift is the fix).

_C04_LINES = [
    "## intent:weather",
    "- [seoul](city) weather today",
    "- is it raining in [busan](city)",
    "## intent:alarm",
    "- wake me at [seven](time) please",
    "- set an alarm for [noon](time)",
]
_C04_SEQ_LEN = 40
_C04_PAD, _C04_UNK, _C04_EOS, _C04_BOS = 0, 1, 2, 3


def _c04_dataset(bug: bool):
    """RasaIntentEntityDataset: markdown lines -> (tokens, intent_idx, entity_idx) with a character encoder."""
    intents: dict[str, int] = {}
    entities: dict[str, int] = {"O": 0}
    rows = []
    intent = ""
    for line in _C04_LINES:
        if line.startswith("## intent:"):
            intent = line.split(":")[1].strip()
            intents.setdefault(intent, len(intents))
            continue
        text = line[2:]
        values = [m.group(0)[1:-1] for m in re.finditer(r"\[[^)]*\]", text)]
        types = [m.group(0)[1:-1] for m in re.finditer(r"\([^)]*\)", text)]
        for t in types:
            entities.setdefault(t, len(entities))
        text = re.sub(r"\([^)]*\)", "", text).replace("[", "").replace("]", "").strip()
        ents = [{"start": m.start(), "end": m.end(), "entity_idx": entities[t]}
                for v, t in zip(values, types) for m in re.finditer(v, text)]
        rows.append({"text": text, "intent_idx": intents[intent], "entities": ents})
    chars = sorted({c for r in rows for c in r["text"]})
    vocab = {c: i + 4 for i, c in enumerate(chars)}
    tokens, intent_idx, entity_idx = [], [], []
    for r in rows:
        ids = [_C04_BOS] + [vocab.get(c, _C04_UNK) for c in r["text"]] + [_C04_EOS]
        ids = ids + [_C04_PAD] * (_C04_SEQ_LEN - len(ids))
        lab = torch.zeros(_C04_SEQ_LEN)
        for e in r["entities"]:
            span = range(e["start"], e["end"] + 1) if bug else range(e["start"] + 1, e["end"] + 2)
            for i in span:
                lab[i] = e["entity_idx"]
        tokens.append(ids)
        intent_idx.append(r["intent_idx"])
        entity_idx.append(lab)
    return (torch.tensor(tokens), torch.tensor(intent_idx), torch.stack(entity_idx), rows,
            len(vocab) + 4, len(intents), len(entities))


class _C04EmbeddingTransformer(nn.Module):
    """DIET-pytorch EmbeddingTransformer: token + position embedding, transformer encoder, intent and entity heads."""

    def __init__(self, vocab_size: int, seq_len: int, intent_class_num: int, entity_class_num: int):
        super().__init__()
        self.seq_len = seq_len
        self.embedding = nn.Embedding(vocab_size, 32)
        self.position_embedding = nn.Embedding(seq_len, 32)
        self.encoder = nn.TransformerEncoder(
            nn.TransformerEncoderLayer(32, 2, 64, 0.0, "relu"), 1, nn.LayerNorm(32), enable_nested_tensor=False)
        self.intent_feature = nn.Linear(32, intent_class_num)
        self.entity_feature = nn.Linear(32, entity_class_num)

    def forward(self, x: torch.Tensor):
        src_key_padding_mask = x == _C04_PAD
        embedding = self.embedding(x) + self.position_embedding(torch.arange(self.seq_len).repeat(x.size(0), 1))
        feature = self.encoder(embedding.transpose(1, 0), src_key_padding_mask=src_key_padding_mask)
        return self.intent_feature(feature[0, :, :]), self.entity_feature(feature).transpose(1, 0)


def _c04_setup(bug: bool):
    tokens, intent_idx, entity_idx, rows, vocab_size, n_int, n_ent = _c04_dataset(bug)
    torch.manual_seed(0)
    model = _C04EmbeddingTransformer(vocab_size, _C04_SEQ_LEN, n_int, n_ent).train()
    intent_opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    entity_opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    loss_fn = nn.CrossEntropyLoss()
    batch = {"tokens": tokens, "intent_idx": intent_idx, "entity_idx": entity_idx}

    def step() -> torch.Tensor:
        # pytorch-lightning with two optimizers: training_step once per optimizer, each with its own backward/step
        intent_pred, _ = model(tokens)
        intent_loss = loss_fn(intent_pred, intent_idx)
        intent_loss.backward()
        intent_opt.step()
        intent_opt.zero_grad()
        _, entity_pred = model(tokens)
        entity_loss = loss_fn(entity_pred.transpose(1, 2), entity_idx.long())
        entity_loss.backward()
        entity_opt.step()
        entity_opt.zero_grad()
        return entity_loss

    return model, entity_opt, batch, step, rows


def _c04_build(bug: bool) -> Case:
    model, opt, batch, step, _ = _c04_setup(bug)
    return model, step, _kw(optimizer=opt, inputs=batch)


def _c04_proof(bug: bool) -> bool:
    """Does an entity label land on a token before the entity's first character ([BOS] or the preceding character)?"""
    _, _, batch, step, rows = _c04_setup(bug)
    step()
    labels = batch["entity_idx"]
    for i, r in enumerate(rows):
        for e in r["entities"]:
            first_token = e["start"] + 1  # [BOS] occupies position 0
            if bool((labels[i, :first_token] == e["entity_idx"]).any()):
                return True
    return False


# --------------------------------------------------------------------------------------------- case-05
# determined-ai/determined PR #711 ("learning rate scheduler fix for bert squad example"): the BERT SQuAD example builds
# AdamW with the usual decay / no-decay groups and `get_linear_schedule_with_warmup(num_training_steps=400)`, stepped
# every batch, while the run itself is ~15000 optimizer steps. The linear schedule reaches 0 at step 400 and HF clamps
# it there, so the remaining ~97% of training runs with lr = 0: no error, the loss just stops improving and validation F1
# flatlines. Fix in the PR: set num_training_steps to the real number of optimizer steps (batches x epochs, 15000).
# Scaled down here: a 75-step run with the horizon set to 2 (about 400 / 15000 of it).

_C05_IDS = torch.randint(3, 60, (4, 16), generator=_gen(3631))
_C05_IDS[:, 0] = 1
_C05_IDS[:, 6] = 2
_C05_TYPES = torch.zeros_like(_C05_IDS)
_C05_TYPES[:, 7:] = 1
_C05_START = torch.randint(7, 14, (4,), generator=_gen(3632))
_C05_END = _C05_START + 1
_C05_TOTAL = 75


def _c05_setup(bug: bool):
    from transformers import BertConfig, BertForQuestionAnswering, get_linear_schedule_with_warmup

    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                     max_position_embeddings=32, pad_token_id=0, hidden_dropout_prob=0.0,
                     attention_probs_dropout_prob=0.0)
    model = BertForQuestionAnswering(cfg).train()
    no_decay = ["bias", "LayerNorm.weight"]
    groups = [
        {"params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)],
         "weight_decay": 0.0},
        {"params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(groups, lr=5e-4, eps=1e-8)
    sched = get_linear_schedule_with_warmup(opt, num_warmup_steps=0, num_training_steps=2 if bug else _C05_TOTAL)
    batch = {"input_ids": _C05_IDS, "attention_mask": torch.ones_like(_C05_IDS), "token_type_ids": _C05_TYPES,
             "start_positions": _C05_START, "end_positions": _C05_END}

    def step() -> torch.Tensor:
        opt.zero_grad()
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        sched.step()  # LRScheduler.StepMode.STEP_EVERY_BATCH
        return loss

    return model, opt, sched, batch, step


def _c05_build(bug: bool) -> Case:
    model, opt, sched, batch, step = _c05_setup(bug)
    return model, step, _kw(optimizer=opt, inputs=batch, lr_scheduler=sched, total_steps=_C05_TOTAL)


def _c05_proof(bug: bool) -> bool:
    """Three steps into a 75-step run: is the lr already 0, so that the third step leaves the weights unchanged?"""
    model, opt, _, _, step = _c05_setup(bug)
    step()
    step()
    w = model.qa_outputs.weight
    before = w.detach().clone()
    lr = opt.param_groups[0]["lr"]
    step()
    return lr == 0.0 and torch.equal(w.detach(), before)


CASES: list[BlindCase] = [
    BlindCase("b36a-01", "https://github.com/espnet/notebook/pull/51", "LoRA base model not frozen",
              "LoRA adapters are added to the speech-to-text model without freezing it first, so every pretrained "
              "weight trains at the adapter learning rate.", _c01_build, _c01_proof),
    BlindCase("b36a-02", "https://github.com/huggingface/sentence-transformers/issues/3208",
              "CLS pooling picks left padding",
              "CLS pooling takes position 0, which is a pad token for every left-padded sentence, so the contrastive "
              "loss trains pad-token embeddings.", _c02_build, _c02_proof,
              known_alarm=("INPUT-003",)),
    BlindCase("b36a-03", "https://github.com/MakazhanAlpamys/Soup/issues/793", "RoPE scaling set after construction",
              "RoPE scaling is written into the config after the model is built, so long-context training runs with "
              "the base model's unscaled rotary frequencies.", _c03_build, _c03_proof),
    BlindCase("b36a-04", "https://github.com/cheesama/DIET-pytorch/pull/3", "entity labels shifted by BOS",
              "Entity tags are written at raw character offsets although a [BOS] token is prepended, so every entity "
              "label sits one token to the left of its entity.", _c04_build, _c04_proof,
              known_miss="entity tags one token left of their entities: which token a span label should name is data semantics"),
    BlindCase("b36a-05", "https://github.com/determined-ai/determined/pull/711", "lr schedule ends too early",
              "The linear schedule's num_training_steps is far smaller than the run, so the learning rate hits zero "
              "early and most of training updates nothing.", _c05_build, _c05_proof),
]
