"""Every bad input to `tpurl train|generate|serve|score|layouts` ends with exit status 2 and exactly one
line on stderr that names the field or file at fault, never a traceback.

The commands run in this process through the real dispatcher (`tpurl.commands.main.main`, with the fds
captured), so the table stays fast; one case also runs as `python -m tpurl`."""

import json
import os
import shutil
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from helpers import CHATML, write_bpe_tokenizer
from multiprocess_helpers import cpu_env
from tpurl.commands import main as cli
from tpurl.models import abstract_model, preset
from tpurl.models.hf import save_hf_checkpoint

REPO = os.path.join(os.path.dirname(__file__), "..")
GIN = os.path.join(REPO, "configs", "test_tiny.gin")
LONG = ",".join(["5"] * 600)  # longer than the tiny preset's max_position_embeddings=512


def _write(path, data):
    with open(path, "wb") as f:
        f.write(data.encode() if isinstance(data, str) else data)


def _edit_json(path, **changes):
    cfg = json.load(open(path))
    cfg.update(changes)
    _write(path, json.dumps({k: v for k, v in cfg.items() if v is not None}))


def _edit_config(d, **changes):
    _edit_json(os.path.join(d, "config.json"), **changes)


def _edit_header(d, edit):
    """Replace the JSON header of `d/model.safetensors` by `edit(header)`."""
    raw = open(f"{d}/model.safetensors", "rb").read()
    n = int.from_bytes(raw[:8], "little")
    header = json.dumps(edit(json.loads(raw[8:8 + n]))).encode()
    _write(f"{d}/model.safetensors", len(header).to_bytes(8, "little") + header + raw[8 + n:])


# Damaged model folders: name -> how to damage a good one.
DAMAGE = {
    "no_config": lambda d: os.remove(f"{d}/config.json"),
    "garbage_config": lambda d: _write(f"{d}/config.json", "{not json"),
    "list_config": lambda d: _write(f"{d}/config.json", "[1, 2]"),
    "latin1_config": lambda d: _write(f"{d}/config.json", b'{"model_type": "q\xe9"}'),
    "gpt2_config": lambda d: _edit_config(d, model_type="gpt2"),
    "no_hidden_size": lambda d: _edit_config(d, hidden_size=None),
    "text_hidden_size": lambda d: _edit_config(d, hidden_size="wide"),
    "wrong_shapes": lambda d: _edit_config(d, intermediate_size=64),
    "no_weights": lambda d: os.remove(f"{d}/model.safetensors"),
    "garbage_weights": lambda d: _write(f"{d}/model.safetensors", b"\x00garbage" * 10),
    "truncated_weights": lambda d: _write(f"{d}/model.safetensors", open(f"{d}/model.safetensors", "rb").read()[:5000]),
    "garbage_index": lambda d: _write(f"{d}/model.safetensors.index.json", "{garbage"),
    "garbage_tokenizer": lambda d: _write(f"{d}/tokenizer.json", "{garbage"),
    "garbage_tokenizer_config": lambda d: _write(f"{d}/tokenizer_config.json", "{garbage"),
    "no_tokenizer": lambda d: os.remove(f"{d}/tokenizer.json"),
    "list_header": lambda d: _edit_header(d, lambda h: list(h)),
    "no_dtype_header": lambda d: _edit_header(d, lambda h: {k: {f: x for f, x in v.items() if f != "dtype"}
                                                            if k != "__metadata__" else v for k, v in h.items()}),
    "zero_heads": lambda d: _edit_config(d, num_attention_heads=0, head_dim=None),
    "rope_scaling_text": lambda d: _edit_config(d, rope_scaling="llama3"),
    "deep_config": lambda d: _write(f"{d}/config.json", '{"a": ' + "[" * 100_000 + "]" * 100_000 + "}"),
    "unnamed_templates": lambda d: _edit_json(f"{d}/tokenizer_config.json", chat_template=[{"template": "x"}]),
}
# Chat templates that load but fail to render (only `score --chat` renders one).
TEMPLATES = {
    "raising_template": "{{ raise_exception('System role not supported') }}",
    "broken_template": "{% for m in messages %}{{ m }",
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """A good tiny Qwen2 checkpoint with a tokenizer, and one damaged copy per `DAMAGE` entry."""
    root = tmp_path_factory.mktemp("folders")
    cfg = preset("tiny", model_type="qwen2", attention_bias=True, vocab_size=300, hidden_size=32,
                 intermediate_size=48, num_heads=4, num_kv_heads=2, head_dim=8)
    graphdef, state = nnx.split(abstract_model(cfg))
    rng = np.random.default_rng(0)
    for _, var in nnx.to_flat_state(state):
        var.set_value(jnp.asarray(0.1 * rng.standard_normal(var.get_value().shape), jnp.float32))
    good = str(root / "good")
    save_hf_checkpoint(nnx.merge(graphdef, state), good)
    write_bpe_tokenizer(good, ["the cat sat on the mat"] * 5, vocab_size=290, chat_template=CHATML)
    for name, damage in DAMAGE.items():
        shutil.copytree(good, root / name)
        damage(str(root / name))
    for name, template in TEMPLATES.items():
        shutil.copytree(good, root / name)
        _edit_json(str(root / name / "tokenizer_config.json"), chat_template=template)
    _write(root / "syntax.gin", "tpurl.RLConfig.seed = 0\ntpurl.RLConfig.steps = \n")
    _write(root / "imports.gin", "import no_such_module_xyz\n")
    _write(root / "self.gin", f'include "{root}/self.gin"\n')
    _write(root / "solution.py", "def f(x):\n    return x\n")
    _write(root / "tests.py", "assert f(1) == 1\n")
    _write(root / "deep_tests.py", "assert f(1) == " + "-" * 900 + "f(1)\n")
    _write(root / "a_file", "not a directory")
    return root


def train(*params, flags=()):
    params = ("tpurl.LoggingConfig.run_dir='{run}'",) + params  # a case's own run_dir comes later and wins
    return ["train", "--quiet", "--gin_file", GIN, *flags, *[a for p in params for a in ("--gin_param", p)]]


# (argv, what the one line must name). `{d}` is the folders fixture, `{run}` a fresh run directory.
CASES = [
    # train: configs
    (train("tpurl.RLConfig.steps=2.5"), "RLConfig.steps=2.5 must be an int"),
    (train("tpurl.RLConfig.batch_size=16.0"), "RLConfig.batch_size=16.0 must be an int"),
    (train("tpurl.RLConfig.batch_size=-16"), "RLConfig.batch_size=-16 must be positive"),
    (train("tpurl.RLConfig.batch_size=0"), "RLConfig.batch_size=0 must be positive"),
    (train("tpurl.RLConfig.steps='x'"), "RLConfig.steps='x' must be an int"),
    (train("tpurl.EvalConfig.pass_k='2'"), "EvalConfig.pass_k='2' must be an int"),
    (train("tpurl.OptimizerConfig.lr='fast'"), "OptimizerConfig.lr='fast' must be a number"),
    (train("tpurl.LoggingConfig.trackers='wandb'"), "LoggingConfig.trackers='wandb' must be a tuple"),
    (train("tpurl.LoggingConfig.trackers=('tb',)"), "unknown tracker 'tb'; choose from ('tensorboard', 'wandb',"),
    # The field `trackers` replaced: gin's own one line names it.
    (train("tpurl.LoggingConfig.tensorboard=False"), "doesn't have a parameter named 'tensorboard'"),
    (train("tpurl.RLConfig.steps="), "--gin_param 'tpurl.RLConfig.steps='"),
    # A binding nothing uses would be silently ignored: the reference to add is named.
    (train("tpurl.PackingConfig.enabled=False"), "'tpurl.RLConfig.packing = @tpurl.PackingConfig()'"),
    (train("tpurl.RLConfig.steps=(1"), "'tpurl.RLConfig.steps=(1'"),
    (["train", "--gin_file", "{d}/syntax.gin"], "{d}/syntax.gin:2"),
    (["train", "--gin_file", "{d}/missing.gin"], "{d}/missing.gin"),
    (train("tpurl.Nope.x=1"), "tpurl.Nope"),
    (train("tpurl.RLConfig.nope=1"), "'nope'"),
    (train("tpurl.algorithm_preset.name='nope'"), "unknown algorithm 'nope'"),
    (train("tpurl.LoggingConfig.run_dir=''"), "LoggingConfig.run_dir"),
    (train("tpurl.DistributedConfig.mode='maybe'"), "DistributedConfig.mode='maybe'"),
    (train("tpurl.DistributedConfig.num_processes=2"), "DistributedConfig: give coordinator_address"),
    (train("tpurl.TaskConfig.name='math'"), "MathConfig.train_file"),
    (train("tpurl.RLConfig.init_from='{d}/garbage_tokenizer'"), "{d}/garbage_tokenizer/tokenizer.json"),
    (train("tpurl.RLConfig.init_from='{d}/nowhere'"), "{d}/nowhere"),
    (train("tpurl.model_preset.max_position_embeddings=4"), "max_position_embeddings=4"),
    (train("tpurl.TaskConfig.name='calculator'", "tpurl.RLConfig.engine=@tpurl.EngineConfig()",
           "tpurl.EngineConfig.cache='dense'"), "EngineConfig.cache='dense'"),
    (train("tpurl.RLConfig.engine=@tpurl.EngineConfig()", "tpurl.EngineConfig.top_logprobs=5"),
     "RLConfig.engine.top_logprobs=5: a rollout trains on its sampled tokens' logprobs"),
    (train("tpurl.CorrectionConfig.is_level='tok'", "tpurl.algorithm_preset.correction=@tpurl.CorrectionConfig()"),
     "CorrectionConfig.is_level='tok'"),
    (train("tpurl.OptimizerConfig.lr=1e999"), "OptimizerConfig.lr=inf must be a finite number"),
    (train("tpurl.RLConfig.seed=1180591620717411303424"), "RLConfig.seed=1180591620717411303424 must be in [0, 2**63)"),
    (train("tpurl.algorithm_preset.temperature=1e-300"), "temperature=1e-300 must be in [0.0001, 10000]"),
    (["train", "--gin_file", "{d}/imports.gin"], "No module named 'no_such_module_xyz' ({d}/imports.gin:1)"),
    (["train", "--gin_file", "{d}/self.gin"], "gin include cycle: {d}/self.gin -> {d}/self.gin"),
    (train("tpurl.RLConfig.steps=" + "[" * 3000 + "]" * 3000), "gin value nested too deeply to parse"),
    # train: LoRA, before anything compiles
    (train("tpurl.model_preset.lora=@tpurl.LoraConfig()", "tpurl.LoraConfig.targets=('q_proj', 'qkv')"),
     "LoraConfig.targets=('q_proj', 'qkv'): unknown ['qkv']; the model's projections are ['q_proj', 'k_proj',"),
    (train("tpurl.model_preset.lora=@tpurl.LoraConfig()", "tpurl.LoraConfig.rank=0"), "LoraConfig.rank=0 must be >= 1"),
    (train("tpurl.model_preset.lora=@tpurl.LoraConfig()", "tpurl.LoraConfig.rank=33"),
     "LoraConfig.rank=33 exceeds q_proj's width (32 in, 32 out); use a rank of at most 32"),
    (train("tpurl.model_preset.lora=@tpurl.LoraConfig()", "tpurl.LoraConfig.alpha=0.0"), "LoraConfig.alpha=0.0 must be > 0"),
    (train("tpurl.RLConfig.init_adapter='{d}/nowhere'"), "RLConfig.init_adapter: adapter directory {d}/nowhere does not"),
    (train("tpurl.SyncConfig.adapters='fused'", "tpurl.RLConfig.sync=@tpurl.SyncConfig()"), "SyncConfig.adapters='fused'"),
    # train: errors raised inside the run
    (train("tpurl.model_preset.num_heads=2"), "(heads) of size 2"),
    (train("tpurl.model_preset.intermediate_size=66"), "(mlp) of size 66"),
    (train(flags=["--resume"]), "nothing to resume: {run} does not exist"),
    (train("tpurl.LoggingConfig.run_dir='{d}/a_file'"), "{d}/a_file is a file"),
    # train: flags
    (["train", "--gin_file", GIN, "--bogus"], "--bogus"),
    (["train"], "--gin_file"),
    (["train", "--gin_file", GIN, "--resume", "--resume-or-start"], "--resume-or-start"),
    # serve
    (["serve", "--model", "nope"], "--model 'nope'"),
    (["serve", "--model", "tiny", "--max-model-len", "9999"], "--max-model-len 9999"),
    (["serve", "--model", "tiny", "--max-slots", "0"], "--max-slots 0"),
    (["serve", "--model", "qwen2.5-0.5b", "--port", "0"], "has no tokenizer"),
    (["serve", "--model", "tiny", "--port", "-5"], "--port -5: must be in [0, 65535]"),
    # generate
    (["generate", "--model", "tiny", "--prompt-ids", "200,300"], "--prompt-ids '200,300': token id 200"),
    (["generate", "--model", "tiny", "--prompt-ids=-3,2"], "--prompt-ids '-3,2': token id -3"),
    (["generate", "--model", "tiny", "--prompt-ids", "1,x"], "--prompt-ids '1,x'"),
    (["generate", "--model", "tiny", "--prompt-ids", LONG], "max_position_embeddings=512"),
    (["generate", "--model", "nope", "--prompt", "hi"], "--model 'nope'"),
    (["generate", "--model", "tiny", "--prompt-ids", "5", "--max-new-tokens", "0"], "max_new_tokens"),
    (["generate", "--model", "tiny", "--prompt-ids", "5", "--temperature", "-1"], "temperature"),
    (["generate", "--model", "tiny", "--prompt-ids", "5", "--dtype", "float99"], "ModelConfig.dtype='float99'"),
    (["generate", "--model", "tiny", "--prompt-ids", "5", "--temperature", "inf"],
     "SamplingConfig.temperature=inf must be a finite number"),
    (["generate", "--model", "tiny", "--prompt-ids", "5", "--temperature", "1e-300"],
     "SamplingConfig.temperature=1e-300 must be 0 (greedy) or in [0.0001, 10000]"),
    (["generate", "--model", "tiny", "--prompt-ids", "5", "--n", "0"], "--n 0"),
    (["generate", "--model", "tiny", "--prompt-ids", "5", "--max-new-tokens", "many"], "--max-new-tokens"),
    (["generate", "--model", "{d}/no_tokenizer", "--prompt", "hi"], "--prompt needs a tokenizer"),
    *[(["generate", "--model", f"{{d}}/{name}", "--prompt-ids", "5,6", "--max-new-tokens", "2"], f"{{d}}/{name}")
      for name in DAMAGE if name != "no_tokenizer"],
    # generate and serve check their input before they load the weights (garbage ones here)
    (["generate", "--model", "{d}/garbage_weights", "--prompt-ids", "299,300"], "--prompt-ids '299,300': token id 300"),
    (["generate", "--model", "{d}/garbage_weights", "--prompt-ids", "5", "--temperature", "-1"], "temperature"),
    (["generate", "--model", "{d}/garbage_weights", "--prompt-ids", LONG],
     "--prompt-ids '5,5,5,5,5,5,5,5,5,5,5,5,5,5,5,5,5,5,5,5,'... (1199 characters): prompt (600) + max_new_tokens (64) "
     "exceeds the model's max_position_embeddings=512"),
    (["generate", "--model", "{d}/garbage_weights", "--prompt-ids", "5", "--adapter", "{d}/nowhere"], "{d}/nowhere"),
    (["generate", "--model", "{d}/garbage_weights", "--prompt-ids", "5", "--compile-cache", " "], "--compile-cache ' '"),
    (["serve", "--model", "{d}/garbage_weights", "--max-model-len", "9999"], "--max-model-len 9999"),
    (["serve", "--model", "{d}/garbage_weights", "--num-pages", "0"], "EngineConfig.num_pages must be >= 1"),
    (["generate", "--model", "qwen2.5-0.5b", "--prompt-ids", "5", "--stop", "x"], "--stop needs a tokenizer"),
    # score
    (["score", "--model", "nope", "--prompt", "hi"], "--model 'nope'"),
    (["score", "--model", "tiny", "--prompt", "caf\u00e9"], "character '\u00e9'"),
    (["score", "--model", "tiny", "--prompt", "a" * 600], "max_position_embeddings=512"),
    *[(["score", "--model", f"{{d}}/{name}", "--prompt", "the cat"], f"{{d}}/{name}") for name in DAMAGE],
    (["score", "--model", "{d}/raising_template", "--prompt", "hi", "--chat"],
     "{d}/raising_template/tokenizer_config.json: the chat template rejects these messages: System role not supported"),
    (["score", "--model", "{d}/broken_template", "--prompt", "hi", "--chat"],
     "{d}/broken_template/tokenizer_config.json: chat template syntax error at line 1: unexpected '}'"),
    # grade-code
    (["grade-code", "--solution", "{d}/solution.py", "--tests", "{d}/tests.py", "--timeout", "inf"],
     "SandboxConfig.timeout_s=inf must be a finite number"),
    (["grade-code", "--solution", "{d}/solution.py", "--tests", "{d}/deep_tests.py"],
     "{d}/deep_tests.py: tests: an expression is nested too deeply to grade"),
    # layouts
    (["layouts", "--model", "nope"], "unknown model preset 'nope'"),
    (["layouts", "--model", "tiny", "--train", "zero3"], "unknown layout preset 'zero3'"),
    (["layouts", "--model", "tiny", "--mesh", "3,x"], "--mesh '3,x'"),
    (["layouts", "--model", "tiny", "--rollout_dtype", "float99"], "--rollout_dtype 'float99'"),
    (["layouts", "--gin_file", "{d}/missing.gin"], "{d}/missing.gin"),
    (["layouts", "--gin_param", "tpurl.RLConfig.rollout_layout='zero3'"], "RLConfig.rollout_layout"),
    (["layouts", "--model", "tiny", "--devices", "many"], "--devices"),
    # the dispatcher
    (["trian"], "'trian'"),
]


def _fill(text, folders, run):
    return text.replace("{d}", str(folders)).replace("{run}", str(run))


@pytest.mark.parametrize("argv, names", CASES, ids=[f"{a[0]}: {n}"[:70] for a, n in CASES])
def test_bad_input_is_one_line(folders, tmp_path, capfd, argv, names):
    run = tmp_path / "run"
    argv = [_fill(a, folders, run) for a in argv]
    try:
        rc = cli.main(argv)
    except SystemExit as e:  # argparse
        rc = e.code
    out, err = capfd.readouterr()
    lines = err.splitlines()
    assert rc == 2, (rc, err[-2000:])
    assert len(lines) == 1 and "Traceback" not in err, err[-2000:]
    assert lines[0].startswith("tpurl"), lines[0]
    assert _fill(names, folders, run) in lines[0], lines[0]


def test_table_is_large():
    assert len(CASES) >= 30 and {a[0] for a, _ in CASES} >= {"train", "generate", "score", "layouts"}


@pytest.mark.slow
def test_as_a_process(tmp_path):
    """The same contract for `python -m tpurl` (what a user runs)."""
    env = cpu_env(8)
    proc = subprocess.run([sys.executable, "-m", "tpurl", *train("tpurl.RLConfig.steps=2.5")], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and proc.stderr.splitlines() == [
        "tpurl train: config error: RLConfig.steps=2.5 must be an int, not a float"]


def test_traceback_on_request(monkeypatch, tmp_path):
    monkeypatch.setenv("TPURL_TRACEBACK", "1")
    with pytest.raises(ValueError, match="RLConfig.steps=2.5 must be an int"):
        cli.main([_fill(a, tmp_path, tmp_path / "run") for a in train("tpurl.RLConfig.steps=2.5")])
    with pytest.raises(ValueError, match="token id 200"):
        cli.main(["generate", "--model", "tiny", "--prompt-ids", "200"])


def test_bad_host_allocator_mode(monkeypatch, capfd):
    monkeypatch.setenv("TPURL_HOST_MALLOC", "tcmalloc")
    assert cli.main(["train", "--gin_file", GIN]) == 2
    assert capfd.readouterr().err.splitlines() == [
        "tpurl train: TPURL_HOST_MALLOC='tcmalloc' is not a host allocator mode; set it to one of auto, keep, system "
        "(or unset it)"]


def test_bad_cpu_compile_mode(monkeypatch, capfd):
    monkeypatch.setenv("TPURL_CPU_COMPILE", "O3")
    assert cli.main(["train", "--gin_file", GIN]) == 2
    assert capfd.readouterr().err.splitlines() == [
        "tpurl train: TPURL_CPU_COMPILE='O3' is not an XLA:CPU compile mode; set it to one of fast, xla (or unset it)"]


def _out_of_memory(argv):
    import jax

    raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 1099511627776 bytes.\nmore")


def test_out_of_device_memory_is_one_line(monkeypatch, capfd):
    """XLA's RESOURCE_EXHAUSTED (a model or batch the devices cannot hold) points at `tpurl plan`;
    any other runtime error stays a traceback, and TPURL_TRACEBACK=1 shows this one's."""
    from tpurl.commands.common import run_command

    assert run_command("tpurl train", _out_of_memory, []) == 2
    assert capfd.readouterr().err.splitlines() == [
        "tpurl train: out of device memory (RESOURCE_EXHAUSTED: Out of memory allocating 1099511627776 bytes.); "
        "`tpurl plan` with the same --gin_file/--gin_param flags shows what the run needs per device; use a smaller "
        "model or batch, shorter sequences, ModelConfig.remat='full' or a layout that shards more"]
    assert run_command("tpurl generate", _out_of_memory, []) == 2
    assert "fewer slots (--max-slots)" in capfd.readouterr().err

    def other(argv):
        raise RuntimeError("RESOURCE_EXHAUSTED but not from XLA")

    with pytest.raises(RuntimeError):
        run_command("tpurl train", other, [])
    monkeypatch.setenv("TPURL_TRACEBACK", "1")
    with pytest.raises(RuntimeError, match="RESOURCE_EXHAUSTED"):
        run_command("tpurl train", _out_of_memory, [])


@pytest.mark.slow
def test_model_too_large_for_memory(tmp_path, capfd):
    """A model of 1 TiB shards (`tpurl plan` says it does not fit): each allocation fails at once."""
    argv = train(f"tpurl.LoggingConfig.run_dir='{tmp_path / 'run'}'", "tpurl.model_preset.num_kv_heads=4",
                 "tpurl.model_preset.hidden_size=1048576", "tpurl.model_preset.intermediate_size=1048576")
    assert cli.main(argv) == 2
    lines = capfd.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("tpurl train: out of device memory (RESOURCE_EXHAUSTED: "), lines


def test_a_failure_that_left_coroutines_unawaited_is_still_one_line():
    """A save that ran out of space can leave orbax's write coroutines never awaited; Python warns
    about each as it is collected (after the command's one line, with the error's traceback, or at
    exit) unless the failure silenced them."""
    script = ("import errno, os, sys\n"
              "from tpurl.commands.common import run_command\n"
              "async def write(): pass\n"
              "kept = []\n"
              "def main(argv):\n"
              "    pending = write()  # collected with the error's traceback\n"
              "    kept.append(write())  # collected at exit\n"
              "    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))\n"
              "sys.exit(run_command('tpurl train', main, []))\n")
    done = subprocess.run([sys.executable, "-c", script], env=cpu_env(1), capture_output=True, text=True, cwd=REPO,
                          timeout=60)
    assert done.returncode == 2 and done.stderr.splitlines() == [
        "tpurl train: no space left on device; free space there and run again"], done.stderr
