"""RL from a pretrained Hugging Face checkpoint (`RLConfig.init_from`): the architecture comes from
its config.json, the weights are its own, the task tokenizes with its (subword) tokenizer, and
the exported policy is a complete model directory again. The checkpoint and the byte-level BPE
tokenizer are written here."""

import json
import os

import jax
import numpy as np
import pytest
from flax import nnx

from algo_helpers import tiny_rl_config
from helpers import CHATML, write_bpe_tokenizer
from tpurl.checkpoint import CheckpointConfig
from tpurl.logging import read_jsonl
from tpurl.models import init_model, preset
from tpurl.models.hf import load_hf_checkpoint, save_hf_checkpoint
from tpurl.rl.loop import prepare, run
from tpurl.rl.runtime import RLRuntime
from tpurl.rl.spec import task_config_for
from tpurl.tasks import AdditionTask, MathConfig

# A context long enough for configs/gsm8k.gin (prompts up to 512 tokens + 512 new ones).
ARCH = preset("tiny", model_type="qwen2", vocab_size=320, hidden_size=32, intermediate_size=64, head_dim=8,
              num_heads=4, num_kv_heads=2, attention_bias=True, tie_word_embeddings=True,
              max_position_embeddings=2048)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny Qwen2-style checkpoint with a byte-level BPE trained on sums (multi-digit merges)."""
    directory = str(tmp_path_factory.mktemp("pretrained"))
    save_hf_checkpoint(init_model(ARCH, seed=7), directory)
    corpus = [f"{a}+{b}={a + b}" for a in range(10) for b in range(10)] * 3
    write_bpe_tokenizer(directory, corpus, vocab_size=290, chat_template=CHATML)
    return directory


@pytest.mark.slow
def test_rl_from_a_pretrained_checkpoint(tmp_path, checkpoint):
    # `model` differs from the checkpoint's architecture on purpose: only its run-time fields count.
    cfg = tiny_rl_config(tmp_path / "run", "grpo", init_from=checkpoint,
                         checkpoint=CheckpointConfig(every_steps=0, export_hf=True))
    spec, task = prepare(cfg)
    assert cfg.task.tokenizer is None and spec.task.tokenizer == checkpoint  # its tokenizer by default
    assert isinstance(task, AdditionTask) and task.tokenizer.vocab_size == 290
    merged = [p for p in task.eval_problems() if len(task.tokenizer.encode(p.prompt)) < len(p.prompt)]
    assert merged  # real subword tokenization, not one token per character
    assert all(len(task.tokenizer.encode(p.prompt, add_bos=True)) <= task.max_prompt_len
               for p in task.eval_problems())

    rt = RLRuntime(spec, task)
    assert rt.model_cfg == ARCH.replace(remat=cfg.model.remat, attention_impl=cfg.model.attention_impl)
    want = nnx.state(load_hf_checkpoint(checkpoint), nnx.Param)
    for a, b in zip(jax.tree.leaves(rt.init_params(0)), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    result = run(cfg, verbose=False)
    manifest = json.load(open(os.path.join(result.run_dir, "manifest.json")))
    assert manifest["extra"]["init_from"] == checkpoint and manifest["model_config"]["model_type"] == "qwen2"
    (metrics,) = [r for r in read_jsonl(os.path.join(result.run_dir, "metrics.jsonl")) if "time/step_s" in r]
    assert np.isfinite(metrics["train/loss"]) and metrics["rollout/tokens_generated"] > 0
    # The export is a complete model directory: weights that load, and the tokenizer beside them.
    exported = load_hf_checkpoint(result.export_dir)
    assert exported.config.model_type == "qwen2"
    assert {"tokenizer.json", "tokenizer_config.json"} <= set(os.listdir(result.export_dir))


def test_init_from_errors_name_the_field(tmp_path, checkpoint):
    with pytest.raises(ValueError, match="RLConfig.init_from: checkpoint directory .* does not exist"):
        prepare(tiny_rl_config(tmp_path, "grpo", init_from=str(tmp_path / "missing")))
    with pytest.raises(ValueError, match="TaskConfig.tokenizer: .* does not exist"):
        prepare(tiny_rl_config(tmp_path, "grpo", task=tiny_rl_config(tmp_path, "grpo").task.replace(
            tokenizer=str(tmp_path / "missing"))))
    small = str(tmp_path / "small")
    save_hf_checkpoint(init_model(ARCH.replace(vocab_size=256), seed=0), small)
    cfg = tiny_rl_config(tmp_path, "grpo", init_from=small, task=tiny_rl_config(tmp_path, "grpo").task.replace(
        tokenizer=checkpoint))
    with pytest.raises(ValueError, match="RLConfig.init_from: the checkpoint's vocab_size=256 is smaller"):
        prepare(cfg)
    # A checkpoint without tokenizer.json (the export of a built-in-tokenizer run) keeps the built-in one.
    assert task_config_for(tiny_rl_config(tmp_path, "grpo", init_from=small)).tokenizer is None


@pytest.mark.slow
def test_rl_on_a_jsonl_math_task(tmp_path, checkpoint):
    """The chat-templated JSONL task in the loop: prompts carry the template's turn markers, the
    completions are graded by final-answer match, the manifest records the splits."""
    rows = [{"question": f"{a}+{b}", "answer": f"#### {a + b}"} for a in range(10) for b in range(10)]
    data = tmp_path / "sums.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    math = MathConfig(train_file=str(data), prompt_template="{question}=", answer_format="last_number",
                      reference_format="hash", num_eval=4, max_new_tokens=3)
    base = tiny_rl_config(tmp_path / "run", "grpo")
    cfg = tiny_rl_config(tmp_path / "run", "grpo", init_from=checkpoint, task=base.task.replace(name="math", math=math))
    result = run(cfg, verbose=False)
    manifest = json.load(open(os.path.join(result.run_dir, "manifest.json")))
    assert manifest["task"]["name"] == "math" and manifest["task"]["train"] == 96
    traj = read_jsonl(os.path.join(result.run_dir, "trajectories.jsonl"))
    assert len(traj) == cfg.batch_size and all(t["prompt"].startswith("<|im_start|>user\n") for t in traj)
    assert all(set(t["rewards"]) == {"correct", "format"} for t in traj)
    (metrics,) = [r for r in read_jsonl(os.path.join(result.run_dir, "metrics.jsonl")) if "time/step_s" in r]
    assert np.isfinite(metrics["train/loss"]) and "reward/correct/mean" in metrics


def test_gsm8k_gin_builds_a_valid_run(tmp_path, checkpoint):
    """configs/gsm8k.gin with the checkpoint and data paths bound, as its header says."""
    import gin

    from tpurl.commands.train import build_config

    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"question": f"{a} plus {a}?", "answer": f"{a} + {a}\n#### {2 * a}"}) + "\n"
                            for a in range(300)))
    gin_file = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "gsm8k.gin")
    try:
        cfg = build_config([gin_file], [f"tpurl.RLConfig.init_from='{checkpoint}'",
                                        f"tpurl.MathConfig.train_file='{data}'"])
    finally:
        gin.clear_config()
    spec, task = prepare(cfg, 8)
    assert cfg.task.name == "math" and spec.task.tokenizer == checkpoint and task.describe()["eval"] == 200
    rt_model = RLRuntime(spec, task).model_cfg
    assert rt_model.model_type == "qwen2" and rt_model.dtype == "bfloat16" and rt_model.remat == "full"


@pytest.mark.slow
def test_resume_restores_without_reading_the_pretrained_tensors(tmp_path, checkpoint, monkeypatch):
    """`--resume` of a run started from a checkpoint restores into an abstract template: the
    pretrained tensors are never read again (nor any optimizer state built first)."""
    from tpurl.models.safetensors_reader import SliceReader

    cfg = tiny_rl_config(tmp_path / "run", "grpo", init_from=checkpoint, steps=1,
                         checkpoint=CheckpointConfig(every_steps=1, export_hf=False))
    first = run(cfg, verbose=False)
    reads = []

    def no_reads(self, *args, **kw):
        reads.append(args)
        raise AssertionError("the pretrained checkpoint's tensors were read")

    monkeypatch.setattr(SliceReader, "__init__", no_reads)
    with pytest.raises(AssertionError, match="tensors were read"):  # the spy catches a load
        RLRuntime(*prepare(cfg)).init_params(0)
    reads.clear()
    resumed = run(cfg.replace(steps=2), resume=True, allow_changed=("steps",), verbose=False)
    assert not reads and resumed.resumed_from == 1 and resumed.steps == 2
    steps = [r["step"] for r in read_jsonl(os.path.join(first.run_dir, "metrics.jsonl")) if "time/step_s" in r]
    assert steps == [1, 2]


def test_a_moe_checkpoint_keeps_the_runs_router_options(tmp_path):
    """A mixture-of-experts checkpoint decides the experts; `ModelConfig.moe` still decides how
    the run trains them (router replay, the router losses). A dense checkpoint with a MoeConfig
    set, or a config that leaves no layer sparse, is a one-line error."""
    from tpurl.models.moe import MoeConfig
    from tpurl.rl.spec import MOE_TRAINING_FIELDS

    experts = MoeConfig(num_experts=4, experts_per_token=2, intermediate_size=16, dense_layers=(1,))
    moe_dir = str(tmp_path / "moe")
    save_hf_checkpoint(init_model(ARCH.replace(model_type="qwen3_moe", qk_norm=True, attention_bias=False,
                                               num_layers=3, moe=experts), seed=0), moe_dir)
    own = MoeConfig(num_experts=8, experts_per_token=1, intermediate_size=64, router_replay=True,
                    balance_loss_coef=0.02, z_loss_coef=0.003)
    cfg = tiny_rl_config(tmp_path / "run", "grpo", init_from=moe_dir, model=preset("tiny-moe", moe=own))
    got = prepare(cfg)[0].model.moe
    assert (got.num_experts, got.experts_per_token, got.intermediate_size, got.dense_layers) == (4, 2, 16, (1,))
    assert all(getattr(got, f) == getattr(own, f) for f in MOE_TRAINING_FIELDS)
    dense_dir = str(tmp_path / "dense")
    save_hf_checkpoint(init_model(ARCH, seed=0), dense_dir)
    with pytest.raises(ValueError, match="init_from is a dense checkpoint, but ModelConfig.moe is set") as err:
        prepare(tiny_rl_config(tmp_path / "run2", "grpo", init_from=dense_dir, model=preset("tiny-moe", moe=own)))
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="leaves none of the 2 layers sparse"):
        preset("tiny-moe", num_layers=2, moe=MoeConfig(num_experts=4, experts_per_token=2, intermediate_size=8,
                                                       dense_layers=(0, 1)))


def test_a_checkpoint_keeps_the_runs_consistency(tmp_path, checkpoint):
    """`ModelConfig.consistency` is the run's, not the checkpoint's: a bitwise run from a checkpoint
    stays bitwise (here its checks refuse the 8-device mesh, which fast mode would take)."""
    cfg = tiny_rl_config(tmp_path / "run", "grpo", init_from=checkpoint, model=preset("tiny", consistency="bitwise"))
    with pytest.raises(ValueError, match="consistency='bitwise' runs on one device per pool"):
        prepare(cfg)
