"""What many tests share: Hugging Face-format files written by the tests themselves (no model hub
here), the scripts loaded as modules, random models built without compiling, and what a sandboxed execution may have left behind
on this machine (`nothing_left_behind`, an autouse fixture where a module imports it)."""

from __future__ import annotations

import glob
import importlib.util
import json
import os
import tempfile
import time

import jax.numpy as jnp
import numpy as np
import pytest
import tokenizers
from flax import nnx
from tokenizers import decoders, models, pre_tokenizers, trainers

from tpurl.models.transformer import abstract_model
from tpurl.sandbox.process import UID_RANGE

SCRIPTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts")


def load_script(name: str):
    """`scripts/<name>.py` as a module (its `main` not run), for tests of its parts."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(SCRIPTS, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# A ChatML template (Qwen's turn markers) without tools: enough to exercise chat prompts.
CHATML = ("{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endfor %}"
          "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


def write_bpe_tokenizer(directory: str, corpus: list[str], vocab_size: int, *, chat_template: str | None = None,
                        eos: str = "</s>") -> None:
    """A byte-level BPE trained on `corpus` (any text encodes: bytes are the base alphabet) with
    `<pad>`, `<s>`, `</s>` and ChatML's markers as special tokens, saved as `tokenizer.json` +
    `tokenizer_config.json` in `directory`."""
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    os.makedirs(directory, exist_ok=True)
    tok.save(os.path.join(directory, "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": eos, "pad_token": "<pad>"}
    if chat_template is not None:
        config["chat_template"] = chat_template
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump(config, f)


# Every sandbox process of this test process carries its working directory, which starts with
# this, on its command line (the settings argument); forks keep it.
SANDBOX_MARK = f"tpurl-sandbox-{os.getpid()}-"


def _live_processes() -> dict[int, tuple[bytes, int]]:
    """pid -> (command line, real uid) of every process that is not a zombie."""
    out = {}
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        try:
            with open(f"/proc/{p}/cmdline", "rb") as f:
                cmdline = f.read()
            with open(f"/proc/{p}/status") as f:
                fields = dict(line.split(":", 1) for line in f if line.startswith(("State:", "Uid:")))
        except (OSError, ValueError):
            continue
        if not fields.get("State", "Z").strip().startswith(("Z", "X")):
            out[int(p)] = (cmdline, int(fields["Uid"].split()[0]))
    return out


def leftover_processes(*markers: str, uid_base: int | None = None, wait_s: float = 2.0) -> list[str]:
    """Live processes from sandboxes of this test process, or whose command line holds one of
    `markers`, or (with `uid_base`) running as a sandbox uid, which parallel test workers share;
    waits up to `wait_s` for dying ones to go."""
    needles = [m.encode() for m in (SANDBOX_MARK, *markers)]
    end = time.monotonic() + wait_s
    while True:
        found = [f"{pid} uid={uid} {cmd[:120]!r}" for pid, (cmd, uid) in _live_processes().items()
                 if any(n in cmd for n in needles) or (uid_base is not None and uid_base <= uid < uid_base + UID_RANGE)]
        if not found or time.monotonic() > end:
            return found
        time.sleep(0.05)


def leftover_dirs() -> list[str]:
    """Working directories of this test process's sandboxes that were not removed."""
    return glob.glob(os.path.join(tempfile.gettempdir(), SANDBOX_MARK + "*"))


def kill_marked(marker: str) -> None:
    """Kill what a deliberately unsandboxed run (a control) left running."""
    for pid, (cmd, _) in _live_processes().items():
        if marker.encode() in cmd:
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass


def jsonl_task_files(directory, rows: list[dict], corpus: list[str], vocab_size: int) -> None:
    """A JSONL task's files in `directory`: `train.jsonl` with `rows` and a ChatML BPE tokenizer
    trained on `corpus` in `tok/`."""
    write_bpe_tokenizer(str(directory / "tok"), corpus, vocab_size=vocab_size, chat_template=CHATML,
                        eos="<|im_end|>")
    (directory / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def random_model(cfg, seed: int = 0):
    """A model of `cfg` with standard-normal weights drawn by numpy: no JAX program is compiled,
    for tests that only move bytes."""
    graphdef, state = nnx.split(abstract_model(cfg))
    rng = np.random.default_rng(seed)
    for _, var in nnx.to_flat_state(state):
        var.set_value(jnp.asarray(rng.standard_normal(var.get_value().shape), jnp.float32))
    return nnx.merge(graphdef, state)


@pytest.fixture
def nothing_left_behind():
    """After the test: no process and no working directory of this test process's sandboxes."""
    yield
    assert leftover_processes() == [] and leftover_dirs() == []


def dense_logprobs(model, prompt: list[int], completion) -> np.ndarray:
    """The logprobs of `completion`'s tokens after `prompt` under a dense forward of `model` (the
    reference an engine's sampled logprobs are checked against)."""
    import jax

    from tpurl.models import forward_logits

    ids = list(np.asarray(completion).tolist())
    logp = np.asarray(jax.nn.log_softmax(forward_logits(model, jnp.asarray([prompt + ids], jnp.int32))[0], axis=-1))
    n = len(prompt)
    return logp[np.arange(n - 1, n - 1 + len(ids)), ids]
