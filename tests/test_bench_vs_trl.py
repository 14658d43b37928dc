"""`scripts/bench_vs_trl.py` without TRL: the checkpoint and tokenizer it writes load in tpurl as the
stated architecture, TRL's prompt strings tokenize to exactly tpurl's prompt ids, the tpurl run's
gin file trains on the same problems, and the TRL reward is the task's own."""

import os

import jax
import pytest
from flax import nnx
from safetensors.numpy import load_file

from helpers import load_script  # tests/ is on the path
from tpurl.commands.train import build_config
from tpurl.models.hf import load_hf_checkpoint, load_hf_config
from tpurl.rl.loop import prepare
from tpurl.tokenizer import load_hf_tokenizer

transformers = pytest.importorskip("transformers")



@pytest.fixture(scope="module")
def bench():
    return load_script("bench_vs_trl")


@pytest.fixture(scope="module")
def checkpoint(bench, tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("bench_ckpt"))
    bench.write_checkpoint(directory)
    return directory


def test_checkpoint_loads_in_tpurl_as_the_stated_model(bench, checkpoint):
    cfg = load_hf_config(checkpoint)
    assert (cfg.model_type, cfg.vocab_size, cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads,
            cfg.head_dim, cfg.intermediate_size) == ("qwen3", 64, 256, 4, 4, 2, 64, 1024)
    assert cfg.param_dtype == "float32"
    params = jax.tree.leaves(nnx.state(load_hf_checkpoint(checkpoint, config=cfg), nnx.Param))
    stored = load_file(os.path.join(checkpoint, "model.safetensors"))
    assert sum(p.size for p in params) == sum(t.size for t in stored.values())  # every weight, each once
    tok = load_hf_tokenizer(checkpoint)
    assert (tok.vocab_size, tok.pad_id, tok.bos_id, tok.eos_id) == (64, 0, 1, 2)


def test_trl_prompts_and_tpurl_prompts_are_the_same_ids(bench, checkpoint, tmp_path):
    hf = transformers.AutoTokenizer.from_pretrained(checkpoint)
    gin_file = tmp_path / "tpurl.gin"
    gin_file.write_text(bench.tpurl_gin(bench.addition_task(8), checkpoint, str(tmp_path / "run"), 2))
    cfg = build_config([str(gin_file)], [])
    _, task = prepare(cfg)  # the task the tpurl run builds: the checkpoint's tokenizer, the script's problems
    assert cfg.task.max_new_tokens == 8 and cfg.model.remat == "none"
    assert (cfg.algorithm.kl_coef, cfg.algorithm.adv_eps) == (bench.KL_COEF, bench.ADV_EPS)
    problems = bench.step_problems(bench.addition_task(8), 2)
    assert [task.train_problem(i) for i in range(len(problems))] == problems
    trl_ids = hf(text=[hf.bos_token + p.prompt for p in problems])["input_ids"]
    assert trl_ids == [task.encode_prompt(p) for p in problems]
    ids = [5, 6, 40, 12, 2]
    assert hf.decode(ids, skip_special_tokens=True) == task.tokenizer.decode(ids)


def test_trl_reward_is_the_tasks_score(bench):
    task = bench.addition_task(8)
    p = bench.step_problems(task, 1)[0]
    eos = 2
    bonus = bench.FORMAT_WEIGHT  # the well-formed bonus (off in the bench)
    assert bench.completion_reward(task, p.answer, p.answer, [7, 7, eos], eos) == pytest.approx(1.0 + bonus)
    assert bench.completion_reward(task, p.answer, p.answer, [7, 7, 7], eos) == 0.0  # cut off: "length"
    assert bench.completion_reward(task, p.answer, "9", [12, eos], eos) == pytest.approx(bonus)
