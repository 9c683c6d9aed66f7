"""Every fenced code block of README.md runs, each in a fresh temporary folder, so no snippet can rot.

Python blocks run in a fresh process (forked from a warm one that has imported torch, transformers...:
tests/_forkserver.py) with ``PYTHONPATH`` set to this checkout, offline (HF, W&B) and with a timeout;
shell blocks run under ``bash -e``. An HTML comment on the line right before a block changes that:

- ``<!-- readme-test: skip (why) -->``: not runnable here (it installs packages, needs a GPU or an account);
  the reason is required.
- ``<!-- readme-test: setup NAME -->``: the block is a fragment about the user's own objects (``model``,
  ``loader``...): the setup ``NAME`` below builds small real ones first (a tiny GPT-2 or Llama built from a
  config, a real guarded run for the shell commands that read its logs). Only the names the setup lists are
  handed over, never its imports: a snippet carries its own imports.
- ``<!-- readme-test: expect-failure (why) -->``: known broken; the test fails as soon as the block passes,
  so the mark is removed when the fix lands.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

from _forkserver import Forkserver

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
TIMEOUT_S = 300
_MARK = re.compile(r"^<!--\s*readme-test:\s*(?P<directive>[a-z-]+)\s*(?P<arg>.*?)\s*-->$")
_PYTHON = {"python", "py"}
_SHELL = {"bash", "sh", "shell"}


@dataclass(frozen=True)
class Block:
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    #: directive -> argument, from the marks right before the block ("skip", "setup", "expect-failure")
    marks: tuple[tuple[str, str], ...] = ()

    @property
    def id(self) -> str:
        return f"L{self.line}-{self.lang or 'text'}"

    def mark(self, directive: str) -> str | None:
        return dict(self.marks).get(directive)


def readme_blocks(text: str) -> list[Block]:
    """The fenced blocks of a markdown text, each with the ``readme-test`` marks on the lines right before it."""
    blocks: list[Block] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        fence = re.match(r"^(```+|~~~+)\s*([\w+-]*)", lines[i])
        if not fence:
            i += 1
            continue
        start, lang = i, fence.group(2).lower()
        i += 1
        body: list[str] = []
        while i < len(lines) and not lines[i].startswith(fence.group(1)):
            body.append(lines[i])
            i += 1
        i += 1
        marks: list[tuple[str, str]] = []
        prev = start - 1
        while prev >= 0 and not lines[prev].strip():
            prev -= 1
        while prev >= 0 and (mark := _MARK.match(lines[prev].strip())):
            marks.insert(0, (mark.group("directive"), mark.group("arg")))
            prev -= 1
        blocks.append(Block(start + 1, lang, "\n".join(body) + "\n", tuple(marks)))
    return blocks


# ------------------------------------------------------------------------------------------------ setups
_TINY_GPT2 = """
import torch
from transformers import GPT2Config, GPT2LMHeadModel

torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=32, n_positions=32, vocab_size=64,
                                   bos_token_id=0, eos_token_id=0))
ids = torch.randint(0, 64, (32, 16))
train_loader = loader = torch.utils.data.DataLoader(
    [{"input_ids": row, "attention_mask": torch.ones_like(row), "labels": row} for row in ids], batch_size=4)
batch = next(iter(train_loader))
base = optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
step_fn = lambda: model(**batch).loss
"""

#: name -> (code, the names it hands to the block)
SETUPS: dict[str, tuple[str, tuple[str, ...]]] = {
    # a snippet defines what a reader must define (its scheduler, scaler): only the model and data are handed
    "tiny-gpt2": (_TINY_GPT2, ("model", "train_loader", "loader", "batch", "base", "optimizer", "step_fn")),
    "tiny-llama": ("""
import torch
from transformers import LlamaConfig, LlamaForCausalLM

torch.manual_seed(0)
base_model = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, vocab_size=64))
ids = torch.randint(0, 64, (4, 16))
batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
""", ("base_model", "batch")),
    "hf-trainer": (_TINY_GPT2 + """
from transformers import TrainingArguments

args = TrainingArguments(output_dir="trainer-out", max_steps=4, per_device_train_batch_size=4, report_to=[],
                         use_cpu=True, logging_steps=2, save_strategy="no", disable_tqdm=True)
train_dataset = list(loader.dataset)
""", ("model", "args", "train_dataset")),
    "alerts": (_TINY_GPT2 + """
import os

os.environ["SLACK_WEBHOOK_URL"] = "http://127.0.0.1:9/slack-hook"   # nothing listens: nothing is sent anyway
""", ("model", "base")),
    # a real guarded run that leaves ./sg_logs with a spike and a NaN step, for the commands that read it
    "guarded-run": ("""
import os
import torch
from guardtower import GuardedOptimizer, JsonlSink

torch.manual_seed(0)
os.makedirs("sg_logs", exist_ok=True)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
opt = GuardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), model, warmup_steps=5, log_every=5,
                       log_dir="./sg_logs", verbose=False, sinks=[JsonlSink("./sg_logs/events.jsonl")])
for step in range(1, 41):
    x, y = torch.randn(32, 8), torch.randn(32, 1)
    if step == 25:
        x = x * float("nan")
    loss = torch.nn.functional.mse_loss(model(x), y) * (1e4 if step == 15 else 1.0)
    loss.backward()
    opt.step(loss=loss)
    opt.zero_grad()
opt.close()
""", ()),
}

_DRIVER = """
import sys
setup, exports, snippet, label = sys.argv[1:5]
scope = {"__name__": "__readme_setup__"}
exec(compile(open(setup).read(), "<readme-test setup>", "exec"), scope)
handed = {name: scope[name] for name in exports.split(",") if name}
exec(compile(open(snippet).read(), label, "exec"), {"__name__": "__main__", **handed})
"""


def _env(tmp: Path) -> dict[str, str]:
    env = _base_env(tmp)
    for name in ("WANDB_MODE", "WANDB_API_KEY"):  # a W&B snippet must say offline itself, as a reader needs it
        env.pop(name, None)
    return env


def _base_env(tmp: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
            "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "WANDB_SILENT": "true",
            "MPLBACKEND": "Agg", "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp), "GUARDTOWER_SPOOL_DIR": str(tmp / "spool"),
            "MLFLOW_TRACKING_URI": f"sqlite:///{tmp / 'mlflow.db'}"}


def run_block(block: Block, tmp: Path, forkserver: Forkserver) -> subprocess.CompletedProcess[str]:
    """Run one block in ``tmp`` (after its setup, if any); the completed process."""
    setup, exports = SETUPS[block.mark("setup") or ""] if block.mark("setup") else ("", ())
    (tmp / "_setup.py").write_text(textwrap.dedent(setup))
    env = _env(tmp)
    label = f"README.md:{block.line}"
    if block.lang in _PYTHON:
        (tmp / "_snippet.py").write_text(block.code)
        (tmp / "_driver.py").write_text(_DRIVER)
        return forkserver.run(["_driver.py", "_setup.py", ",".join(exports), "_snippet.py", label], cwd=tmp, env=env,
                              timeout=TIMEOUT_S)
    else:
        prelude = f'"{sys.executable}" _setup.py\n' if setup else ""
        env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
        cmd = ["bash", "-e", "-o", "pipefail", "-c", prelude + block.code]
        return subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)


BLOCKS = readme_blocks(README.read_text(encoding="utf-8"))
#: marked skip blocks are not collected at all (the first test checks that each says why)
RUNNABLE = [block for block in BLOCKS if block.mark("skip") is None]


def test_the_readme_has_code_and_every_mark_is_valid() -> None:
    assert len(BLOCKS) >= 8 and len(RUNNABLE) >= len(BLOCKS) - 3
    for block in BLOCKS:
        where = f"README.md:{block.line}"
        assert block.lang in _PYTHON | _SHELL or block.mark("skip"), f"{where}: a {block.lang!r} block"
        for directive, arg in block.marks:
            assert directive in ("skip", "setup", "expect-failure"), f"{where}: unknown mark {directive!r}"
            if directive in ("skip", "expect-failure"):
                assert re.fullmatch(r"\(\s*\S.*\)", arg), f"{where}: '{directive}' needs a (reason)"
            if directive == "setup":
                assert arg in SETUPS, f"{where}: unknown setup {arg!r}, known: {sorted(SETUPS)}"


def test_a_mark_applies_to_the_next_block_only() -> None:
    text = ("<!-- readme-test: setup tiny-gpt2 -->\n<!-- readme-test: expect-failure (bug 1) -->\n\n```python\n"
            "x = 1\n```\n\n```bash\necho hi\n```\n")
    first, second = readme_blocks(text)
    assert first.marks == (("setup", "tiny-gpt2"), ("expect-failure", "(bug 1)")) and first.code == "x = 1\n"
    assert (second.marks, second.lang, second.line) == ((), "bash", 8)


def test_a_failing_snippet_fails_and_names_its_readme_line(tmp_path: Path, forkserver: Forkserver) -> None:
    done = run_block(Block(12, "python", "import torch\nmodel\n"), tmp_path, forkserver)
    assert done.returncode != 0 and 'README.md:12", line 2' in done.stderr and "NameError" in done.stderr
    # a setup hands over its objects, never its imports
    block = Block(3, "python", "print(type(model).__name__)\ntorch\n", (("setup", "tiny-gpt2"),))
    done = run_block(block, tmp_path, forkserver)
    assert "GPT2LMHeadModel" in done.stdout and "name 'torch' is not defined" in done.stderr


@pytest.mark.slow
@pytest.mark.timeout(TIMEOUT_S + 60)
@pytest.mark.parametrize("block", RUNNABLE, ids=[b.id for b in RUNNABLE])
def test_readme_block_runs(block: Block, tmp_path: Path, forkserver: Forkserver) -> None:
    done = run_block(block, tmp_path, forkserver)
    output = f"README.md:{block.line} ({block.lang}) exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    if block.mark("expect-failure") is not None:
        assert done.returncode != 0, f"README.md:{block.line} passes now: remove its expect-failure mark\n{output}"
        return
    assert done.returncode == 0, output
