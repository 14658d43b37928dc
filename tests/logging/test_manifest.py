"""The run manifest records every version a comparison depends on: model config hash and
checksums, library and backend versions, task and grader versions, data-file and tokenizer
checksums, and the sandbox in force."""

import hashlib
import importlib.metadata
import json

import jax
import pytest
from flax import nnx

from helpers import CHATML, write_bpe_tokenizer
from tpurl.logging.manifest import MANIFEST_KEYS, build_manifest, config_hash
from tpurl.models import abstract_model, preset
from tpurl.tasks import MathConfig, MathTask, TaskConfig, make_task
from tpurl.tokenizer import load_hf_tokenizer

MV = importlib.metadata.version("math-verify")  # the math grader in force, named in the manifest
ROWS = [{"question": f"What is {a} plus 1?", "answer": f"#### {a + 1}"} for a in range(12)]


def _sha(path) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


@pytest.fixture(scope="module")
def math_task(tmp_path_factory):
    d = tmp_path_factory.mktemp("data")
    write_bpe_tokenizer(str(d / "tok"), [r["question"] for r in ROWS], vocab_size=280, chat_template=CHATML)
    for name, rows in (("train.jsonl", ROWS[:10]), ("eval.jsonl", ROWS[10:])):
        (d / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = MathConfig(train_file=str(d / "train.jsonl"), eval_file=str(d / "eval.jsonl"), reference_format="hash")
    return MathTask(cfg, tokenizer=load_hf_tokenizer(str(d / "tok"))), d


def _manifest(task, init_from=None, model=preset("tiny")):
    params = jax.tree.map(lambda x: jax.numpy.zeros(x.shape, x.dtype), nnx.split(abstract_model(model))[1])
    return build_manifest(model_config=model, params=params, task=task, seed=0, gin_config="",
                          extra={"init_from": init_from})


def test_manifest_records_what_a_comparison_depends_on(math_task, tmp_path):
    task, d = math_task
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text("{}")
    (ckpt / "model.safetensors").write_bytes(b"weights")
    (ckpt / "notes.txt").write_text("not part of the model")
    m = _manifest(task, init_from=str(ckpt))
    assert set(MANIFEST_KEYS) <= set(m)
    for lib in ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "tokenizers", "safetensors", "numpy"):
        assert m["versions"][lib], lib
    assert m["versions"]["jax"] == jax.__version__ and m["backend_version"]
    assert m["sandbox"] == "none"
    assert m["task"]["version"] == "math-jsonl-v2" and m["task"]["grader"] == f"math-verify-{MV}+builtin-v2"
    assert m["task"]["data_files"] == {str(d / n): _sha(d / n) for n in ("train.jsonl", "eval.jsonl")}
    assert m["model"]["config_hash"] == config_hash(preset("tiny")) != config_hash(preset("tiny", num_layers=3))
    assert m["model"]["param_checksum"] == m["param_checksum"]
    assert m["model"]["init_from_checksums"] == {"config.json": _sha(ckpt / "config.json"),
                                                 "model.safetensors": _sha(ckpt / "model.safetensors")}
    assert m["tokenizer"]["kind"] == "HFTokenizer" and len(m["tokenizer"]["checksum"]) == 64
    json.dumps(m)  # plain JSON


def test_tokenizer_checksum_follows_the_tokenizer(math_task, tmp_path):
    task, d = math_task
    same = load_hf_tokenizer(str(d / "tok"))
    assert same.checksum() == task.tokenizer.checksum()
    other = tmp_path / "tok2"
    write_bpe_tokenizer(str(other), [r["question"] for r in ROWS], vocab_size=280, chat_template=CHATML + " ")
    assert load_hf_tokenizer(str(other)).checksum() != same.checksum()  # only the chat template differs
    addition = make_task(TaskConfig())
    m = _manifest(addition)
    assert m["tokenizer"]["checksum"] == addition.tokenizer.checksum() and m["task"]["data_files"] == {}
    assert m["model"]["init_from"] is None and m["model"]["init_from_checksums"] is None


def test_manifest_records_the_sandbox_of_a_task_that_runs_code(math_task, tmp_path):
    # A task that runs untrusted code (here the Python tool) records the isolation in force and
    # its limits, at the manifest's top level; a task with an in-process grader records "none".
    from tpurl.sandbox import SandboxConfig, sandbox_mechanisms
    from tpurl.tasks.python_tool import PythonToolConfig, PythonToolEnv

    _, d = math_task
    sandbox = SandboxConfig(timeout_s=3.0, memory_mb=256)
    cfg = PythonToolConfig(train_file=str(d / "train.jsonl"), eval_file=str(d / "eval.jsonl"),
                           reference_format="hash", sandbox=sandbox)
    task = PythonToolEnv(cfg, tokenizer=load_hf_tokenizer(str(d / "tok")))
    m = _manifest(task)
    assert m["sandbox"] == sandbox_mechanisms(sandbox) and m["sandbox"]["limits"]["timeout_s"] == 3.0
    assert m["sandbox"]["network"] and "sandbox" not in m["task"]
    assert m["task"]["grader"] == f"math-verify-{MV}+builtin-v2+sandbox"
