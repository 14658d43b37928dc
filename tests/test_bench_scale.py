"""`scripts/bench_scale.py`: its `tiny` size run end to end by `scripts/device_check.sh`'s `scale`
step on this CPU (every field of its JSON line, completions of the fixed length), and its parts
against independent references: the decode floor's bytes, the fixed-length task's prompts and
tokenizer, the chip of a device kind, and the task hook that turns off stopping at EOS."""

import json
import os
import subprocess
import sys
import types

import pytest

from helpers import load_script  # tests/ is on the path
from tpurl.plan.hardware import preset_for_device
from tpurl.tasks.base import stop_token_ids

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "bench_scale.py")
FIELDS = ("size", "preset", "params", "workload", "backend", "device", "chip", "peak_flops", "bandwidth_bytes_per_s",
          "phases_s", "step_s", "all_steps_s", "prefill", "decode", "scoring", "update", "sync", "compile",
          "trained_tokens_per_s_per_device", "generated_tokens_per_s", "peak_memory_bytes", "planned_peak_bytes",
          "planned_on", "peak_over_planned", "targets")


@pytest.fixture(scope="module")
def bench():
    return load_script("bench_scale")


@pytest.mark.slow  # a whole RL step in a subprocess
def test_device_check_scale_step_runs_the_tiny_size_on_cpu(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(STEPS="scale", SCALE_SIZES="tiny", JAX_PLATFORMS="cpu", OUT=str(tmp_path),
               PATH=os.path.dirname(sys.executable) + os.pathsep + env["PATH"])  # its python3: this one
    out = subprocess.run(["bash", os.path.join(ROOT, "scripts", "device_check.sh")], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + (tmp_path / "stderr.log").read_text()[-3000:]
    lines = (tmp_path / "bench_scale.jsonl").read_text().splitlines()
    assert len(lines) == 1
    r = json.loads(lines[0])
    assert set(FIELDS) <= set(r), set(FIELDS) - set(r)
    w = r["workload"]
    # EOS never stops a completion: every sample generated exactly new_tokens.
    assert r["decode"]["tokens"] == w["prompts"] * w["samples"] * w["new_tokens"]
    for phase in ("rollout", "logprobs", "update", "sync", "step"):
        assert r["phases_s"][phase] > 0
    for part in ("prefill", "scoring", "update"):
        assert 0 < r[part]["mfu"] < 1, (part, r[part])
    assert r["decode"]["over_hbm_floor"] > 1 and r["decode"]["tokens_per_s"] > 0
    assert r["sync"]["bytes"] > 0 and r["compile"]["compile_s"] > 0
    assert r["peak_memory_bytes"] is None and r["planned_peak_bytes"] > 0  # a CPU reports no peak
    assert r["targets"] == {}  # the targets are the real sizes'


def test_decode_floor_bytes_is_weights_and_kv_per_step(bench):
    from tpurl.models import preset
    from tpurl.plan.timing import matmul_params

    mc = preset("qwen3-0.6b")
    kv_token = 2 * 28 * 8 * 128 * 2  # layers x kv heads x head dim x (k, v) x bf16
    # 10 sequences in waves of 4, 4, 2; 8-token prompts, 3 new tokens: decode steps see 9 and 10 tokens.
    expected = sum(matmul_params(mc) * 2 + live * ctx * kv_token for live in (4, 4, 2) for ctx in (9, 10))
    assert bench.decode_floor_bytes(mc, 2, slots=4, batch=10, prompt=8, new=3) == expected


def test_prefill_flops_count_the_unembedding_at_the_last_token_only(bench):
    from tpurl.models import preset
    from tpurl.plan.timing import matmul_params

    mc = preset("qwen3-0.6b", attention_query_blocks=1)
    layers = matmul_params(mc) - mc.hidden_size * mc.vocab_size
    attention = 4 * mc.num_layers * mc.num_heads * mc.head_dim * 8 * 8  # per prompt: 8 queries x 8 keys
    expected = 3 * (2 * layers * 8 + 2 * mc.hidden_size * mc.vocab_size + attention)
    assert bench.prefill_model_flops(mc, prompts=3, length=8) == pytest.approx(expected)


def test_packed_tokens_hold_each_rows_prompt_once_and_no_padding(bench):
    from tpurl.train.packing import PackingConfig

    # 2 prompts x 2 samples: 3-token prompts, completions of 2, 5 / 1, 4 tokens, rows of 12.
    records = [{"prompt_ids": [1, 5, 6], "completion_ids": [7] * 2}, {"prompt_ids": [1, 5, 6], "completion_ids": [8] * 5},
               {"prompt_ids": [2, 9, 9], "completion_ids": [7] * 1}, {"prompt_ids": [2, 9, 9], "completion_ids": [8] * 4}]
    cfg = types.SimpleNamespace(packing=PackingConfig(min_row_length=24, row_buckets=4),
                                algorithm=types.SimpleNamespace(micro_batches=1))
    tokens, length = bench.packed_tokens(cfg, records, seq_len=12)
    assert length == 24 and tokens == (3 + 2 + 5) + (3 + 1 + 4)  # each group's prompt once
    cfg.packing = PackingConfig(enabled=False)
    assert bench.packed_tokens(cfg, records, seq_len=12) == (5 + 8 + 4 + 7, 12)


def test_bad_steps_is_a_one_line_error():
    out = subprocess.run([sys.executable, SCRIPT, "--size", "tiny", "--steps", "0"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2 and out.stderr.strip().count("\n") == 0 and "--steps 0 must be >= 1" in out.stderr


def test_fixed_length_task_prompts_are_their_length_in_tokens(bench):
    task = bench.FixedLengthTask(vocab_size=1000, prompt_tokens=40, new_tokens=5)
    tok = task.tokenizer
    assert (tok.vocab_size, tok.pad_id, tok.bos_id, tok.eos_id) == (1000, 0, 1, 2)
    ids = task.encode_prompt(task.train_problem(3))
    assert len(ids) == 40 and ids[0] == tok.bos_id and all(3 <= i < 1000 for i in ids[1:])
    assert ids == task.encode_prompt(task.train_problem(3)) != task.encode_prompt(task.train_problem(4))
    assert stop_token_ids(task) == ()
    assert [len(task.encode_prompt(p)) for p in task.eval_problems()] == [40, 40]
    reward = task.score(task.train_problem(0), tok.decode([3, 600, 10, 999]), "length")
    assert reward.total == pytest.approx(0.5)  # 3 and 10 are in the lower half of 1,000


def test_stop_token_ids_is_eos_unless_the_task_turns_it_off():
    tokenizer = types.SimpleNamespace(eos_id=7)
    assert stop_token_ids(types.SimpleNamespace(tokenizer=tokenizer)) == (7,)
    assert stop_token_ids(types.SimpleNamespace(tokenizer=tokenizer, stop_at_eos=True)) == (7,)
    assert stop_token_ids(types.SimpleNamespace(tokenizer=tokenizer, stop_at_eos=False)) == ()


@pytest.mark.parametrize("platform,kind,key", [
    ("gpu", "NVIDIA H200", "h200"), ("gpu", "NVIDIA H100 80GB HBM3", "h100"), ("gpu", "NVIDIA A100-SXM4-80GB", "a100"),
    ("tpu", "TPU v5 lite", "v5e"), ("tpu", "TPU v5", "v5p"), ("tpu", "TPU v5p", "v5p"), ("tpu", "TPU v4", "v4"),
    ("tpu", "TPU v6 lite", "v6e"), ("gpu", "NVIDIA GeForce RTX 4090", None), ("gpu", "NVIDIA H100 PCIe", None),
    ("gpu", "NVIDIA H100 NVL", None), ("gpu", "NVIDIA A100-SXM4-40GB", None), ("gpu", "NVIDIA GH200 480GB", None),
    ("gpu", "NVIDIA GB200", None),
    ("cpu", "cpu", None)])
def test_preset_for_device(platform, kind, key):
    assert preset_for_device(types.SimpleNamespace(platform=platform, device_kind=kind)) == key


def test_targets_of_a_size_are_the_ones_stated_for_it(bench):
    result = {"size": "0.6b", "decode": {"over_hbm_floor": 1.5}, "sync": {"seconds": 0.03},
              "trained_tokens_per_s_per_device": 30_000.0, "peak_over_planned": None}
    t = bench.targets(result)
    assert set(t) == {"decode_over_hbm_floor", "sync_s", "trained_tokens_per_s_per_device", "peak_over_planned"}
    assert t["decode_over_hbm_floor"] == {"value": 1.5, "target": "<= 2", "met": True}
    assert t["sync_s"]["met"] is False and t["trained_tokens_per_s_per_device"]["met"] is True
    assert t["peak_over_planned"]["met"] is None  # not measured
    assert set(bench.targets({"size": "1.7b", "decode": {"over_hbm_floor": 3.0}, "update": {"mfu": 0.5},
                              "scoring": {"mfu": 0.3}, "peak_over_planned": 1.1})) == {
        "decode_over_hbm_floor", "update_mfu", "scoring_mfu", "peak_over_planned"}


@pytest.mark.parametrize("size", ["0.6b", "1.7b"])
def test_the_real_sizes_fit_one_h200_by_the_plan(bench, size, tmp_path):
    """The device step's configs (at their default workloads) fit one H200 in every phase by
    `tpurl plan`'s account, so a lent device's minutes are not spent on an out-of-memory run."""
    from tpurl.plan.hardware import hardware
    from tpurl.plan.job import make_job
    from tpurl.plan.plan import make_plan
    from tpurl.rl.spec import TaskLengths

    w = {**bench.SIZES[size][2], "steps": 1}
    cfg = bench.make_config(size, w, str(tmp_path))
    assert (cfg.batch_size, cfg.model.vocab_size, cfg.model.dtype, cfg.sync.rollout_dtype) == (
        512, 151936, "bfloat16", "bfloat16")
    lengths = TaskLengths(prompt_len=w["prompt_tokens"], new_tokens=w["new_tokens"], vocab_size=cfg.model.vocab_size)
    plan = make_plan(make_job(cfg, 1, lengths=lengths), hardware("h200x1"))
    assert plan.fits_all, plan.advice()
    assert plan.kv.sequences >= w["max_slots"]  # the pool holds every slot's whole sequence
