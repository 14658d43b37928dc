"""tpurl vs TRL's GRPOTrainer on the same checkpoint, prompts and GRPO step, one after the other.

What it measures: seconds per RL step (mean over `--steps` timed steps after one warm-up step,
which includes tpurl's compilation and TRL's first-call overheads; tpurl's mean also leaves out
the later steps that compiled a program for a new packed shape, which a long run pays once per
shape, and reports them under `compile`), the per-phase split of each
system's step, and the mean completion length of each, at `max_new_tokens` 8 and 128 (the
completions of a random-init model stop when it samples EOS, about 1 in 64 tokens, so at 128 about
50 tokens are generated on average). Each setting runs tpurl, then TRL, then tpurl once more with
the same config and the first run's compile cache (`tpurl.compile_cache`, in `--out`). It prints
one JSON object per size and setting (each system's `step_s`, `phases_s`, `common_s`,
`mean_completion_len` and `all_steps_mean_s` -- the mean over every step, the warm-up and the
compiling steps included --, TRL's effective `settings`, tpurl's `compile` seconds and programs,
`ratio` = TRL's step seconds / tpurl's over the steady steps, `ratio_all_steps` the same over
every step, `ratio_all_steps_warm` with the second tpurl run's steps (its programs loaded from the
cache), and `second_run_compile_share` = the second tpurl run's compile seconds / the
first's), then one object with every ratio (`ratio_128`, `ratio_all_steps_128`, ... for the 4m
model; `ratio_128_30m`, ... for the 30m one; above 1: tpurl is faster). The default run (4m,
8 and 128 new tokens, 5 timed steps) should take about 6 minutes on an idle 2-core machine;
`--size 4m,30m --max-new-tokens 128 --steps 19` (the first 20 steps of each system) about 40.

How to run (torch and TRL are the optional `bench` extra, never imported by tpurl itself)::

    pip install -e '.[bench]'
    python scripts/bench_vs_trl.py [--size 4m,30m] [--steps 5] [--max-new-tokens 8 128] [--out DIR]

Run it on an otherwise idle machine: the two systems run one after the other, never at once, but a
second busy process on the same cores slows either by several times.

"Same config" means:
- One random-init Hugging Face checkpoint per size, written here with transformers (`Qwen3Config`,
  vocab 64; 4m: hidden 256, 4 layers, 4 query / 2 KV heads of 64, MLP 1024, ~4M parameters; 30m:
  hidden 512, 8 layers, 8 query / 4 KV heads of 64, MLP 2048, ~32M parameters; fp32
  weights and compute) with a character-level tokenizer (digits, `+`, `=`, space, `<pad>` `<bos>`
  `<eos>`, padded to 64 ids); tpurl starts from it with `RLConfig.init_from`, TRL loads it by path.
- The same prompts in the same order: tpurl's 2-digit addition task (`ab+cd=`, `<bos>` first)
  from training problem 0 on, 16 prompts x 8 samples per step; the same reward (the task's own
  `score`: exact answer 1.0, 0 for a completion cut off by the length limit; the task's
  well-formed bonus is off, see `FORMAT_WEIGHT`).
- GRPO: advantages (r - group mean) / (group std + 1e-4), clipped ratio (eps 0.2), per-sequence
  token mean (TRL `loss_type="grpo"`: each sequence's masked token mean, averaged over the batch;
  tpurl `seq-mean-token-mean`, the same whenever every completion has a token), k3 KL to the
  initial policy with coefficient 0.04 added to each token's loss (TRL 1.16 by default also
  multiplies that KL by the differentiable importance ratio, `use_bias_correction_kl=True`, whose
  value is 1 on-policy but whose gradient adds beta * kl * grad log p; tpurl has no such term, so
  it is turned off here and both differentiate the same loss), one
  optimizer step per batch (TRL: `num_iterations=1`, `steps_per_generation=1`, one batch of 128
  completions). Both skip a separate old-policy forward: on-policy, the update's own forward is
  the old policy (TRL's `old_per_token_logps` is None in this configuration).
- AdamW (lr 1e-4, betas 0.9/0.999, eps 1e-8, no weight decay, constant lr, no warmup), gradient
  clipping at global norm 1.0.
- Sampling at temperature 1.0 from the full distribution (no top-k / top-p), stopping at EOS.
- One CPU device: tpurl without the fake-device XLA flag (meshes of shape 1), TRL with `use_cpu`
  (both use every core for their own threads); tpurl `remat="none"` and its 4 layers unrolled in
  the update and scoring forwards (`ModelConfig.unroll_layers`), TRL gradient checkpointing off
  (the fastest setting of each).

What still differs:
- Each system runs its own generation: tpurl's paged-KV engine with fixed-shape compiled programs,
  TRL `model.generate` (dynamic KV cache, eager PyTorch). Samples differ (different RNGs), so the
  completion lengths differ from step to step; the JSON reports both means.
- tpurl packs the sequences of the update and the reference forward into rows of
  prompt + `max_new_tokens` tokens times the most that fit in 128 (at 8 new tokens, 8 x 15), each
  group's prompt held once per row
  (`PackingConfig`, on by default); TRL pads each batch to its longest completion. tpurl's decode
  steps run only the slots still generating (`EngineConfig.decode_buckets`); TRL's `generate`
  keeps finished rows in its batch.
- tpurl's colocated default parks the AdamW state in host memory while it generates; on one CPU
  device that memory is the device's own, so parking frees nothing and the bench turns it off
  (`HandoverConfig.offload_opt_state=False`), as TRL keeps everything in place. Its `offload` /
  `onload` phases still allocate and free the KV pool.
- Phases: tpurl's come from its run's own timeline (`summary.json`: each phase blocks on its
  results); TRL's are timed by wrapping the trainer's methods (`TRLPhaseTimer`; eager PyTorch on
  the CPU is synchronous, so each wrapped call's time is its own). `common_s` maps both onto
  generate / reward / ref_logprobs / update (TRL: loss forward + backward + clip + AdamW step) /
  other (tpurl: offload, onload, advantages, sync; TRL: advantages, padding, scheduler, zeroing
  gradients, and whatever else happens between `on_step_begin` and `on_step_end`).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import multiprocessing
import os
import subprocess
import sys
import tempfile
import time

# The model (Qwen3-shaped) and the tokenizer both systems start from.
VOCAB_SIZE = 64
# `--size`: the 4m model (the default), and a 30m one (hidden 512, 8 layers, 8 query / 4 KV heads of
# 64, MLP 2048) to see how the comparison moves as matmuls take more of both systems' step.
SIZES = {
    "4m": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
               intermediate_size=1024, max_position_embeddings=256),
    "30m": dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4, head_dim=64,
                intermediate_size=2048, max_position_embeddings=256),
}
ARCH = SIZES["4m"]
SPECIALS = ("<pad>", "<bos>", "<eos>")  # ids 0, 1, 2
CHARS = "0123456789+= "

# The RL step both systems run.
PROMPTS_PER_STEP = 16
GROUP_SIZE = 8
KL_COEF = 0.04
CLIP_EPS = 0.2
ADV_EPS = 1e-4  # (r - mean) / (std + eps), std with Bessel's correction in both; TRL's eps is fixed
LR = 1e-4
MAX_GRAD_NORM = 1.0
TEMPERATURE = 1.0
DIGITS = 2
# The task's well-formed bonus (a digit string then EOS, 0.1 by default) is switched off. The
# random-init model samples such a completion (one digit, then EOS) about 0.27% of the time, so
# about one step in three has a group with nonzero reward spread; GRPO's std normalization turns
# that lone 0.1 into advantages of +2.47 / -0.35, and the update that follows raises EOS's
# probability: mean completion length falls from ~56 to ~39 in one step (measured on both systems).
# Whether and when that happens is a matter of which samples each system draws, so one system's
# timed steps could generate a third fewer tokens than the other's. Without the bonus the only
# reward is the exact answer, which a random-init model essentially never produces: both policies
# stay near their shared starting point and both generate the same lengths on average.
FORMAT_WEIGHT = 0.0
SEED = 0
NUM_EVAL = 16  # held-out problems: tpurl evaluates them before and after its steps (outside the timed steps)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH_EXTRA = "pip install -e '.[bench]'"


def write_tokenizer(directory: str) -> None:
    """A character-level Hugging Face fast tokenizer (`tokenizer.json` + `tokenizer_config.json`):
    one id per character of `CHARS` after the specials, filler ids up to `VOCAB_SIZE` (a
    random-init model samples them; they decode to their names, like any unused vocab entry)."""
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers

    names = list(SPECIALS) + list(CHARS)
    names += [f"<unused{i}>" for i in range(VOCAB_SIZE - len(names))]
    tok = tokenizers.Tokenizer(models.WordLevel({n: i for i, n in enumerate(names)}, unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.Split(tokenizers.Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()  # characters join without separators
    tok.add_special_tokens(list(SPECIALS))
    os.makedirs(directory, exist_ok=True)
    tok.save(os.path.join(directory, "tokenizer.json"))
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": SPECIALS[1], "eos_token": SPECIALS[2], "pad_token": SPECIALS[0],
                   "tokenizer_class": "PreTrainedTokenizerFast"}, f)


def write_checkpoint(directory: str, arch: dict = ARCH) -> None:
    """A random-init fp32 Qwen3 model (seeded) of `arch`'s shapes saved with `save_pretrained`,
    beside the tokenizer."""
    import torch
    import transformers

    torch.manual_seed(SEED)
    config = transformers.Qwen3Config(vocab_size=VOCAB_SIZE, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                      tie_word_embeddings=False, **arch)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config.update(pad_token_id=0, bos_token_id=1, eos_token_id=2)
    model.save_pretrained(directory)
    write_tokenizer(directory)


def addition_task(max_new_tokens: int):
    """tpurl's 2-digit addition task with room for `max_new_tokens` generated tokens: the prompts
    and the reward of both systems (its config is also what the tpurl run's gin file binds)."""
    from tpurl.tasks import AdditionConfig, AdditionTask

    answer_room = DIGITS + 1  # AdditionConfig.max_new_tokens = digits + 1 + extra_new_tokens
    context = ARCH["max_position_embeddings"] - (2 * DIGITS + 3)  # after <bos>ab+cd=
    if not answer_room < max_new_tokens <= context:
        raise SystemExit(f"--max-new-tokens {max_new_tokens}: use {answer_room + 1}..{context} (room for the "
                         "longest answer and eos, within the model's context)")
    return AdditionTask(AdditionConfig(digits=DIGITS, num_eval=NUM_EVAL, seed=SEED, format_weight=FORMAT_WEIGHT,
                                       extra_new_tokens=max_new_tokens - answer_room))


def step_problems(task, steps: int):
    """The training problems of `steps` steps in the order tpurl's loop takes them (16 per step)."""
    return [task.train_problem(i) for i in range(steps * PROMPTS_PER_STEP)]


def completion_reward(task, answer: str, completion: str, ids, eos_id: int) -> float:
    """The task's own reward for one completion: "stop" when it ended with EOS, else "length"."""
    from tpurl.tasks import Problem

    finish = "stop" if len(ids) and int(ids[-1]) == eos_id else "length"
    return task.score(Problem(uid="", prompt="", answer=answer), completion, finish).total


def tpurl_gin(task, ckpt: str, run_dir: str, steps: int, compile_cache: str | None = None) -> str:
    """The gin bindings of the tpurl side of one setting (written beside its run, reusable as-is);
    `compile_cache`: the runs' compile cache directory (None: `tpurl train`'s default)."""
    a = task.cfg
    with open(os.path.join(ckpt, "config.json")) as f:
        layers = json.load(f)["num_hidden_layers"]  # all unrolled in the update and scoring forwards
    cache = [] if compile_cache is None else [
        "tpurl.RLConfig.compile_cache = @tpurl.CompileCacheConfig()",
        f"tpurl.CompileCacheConfig.dir = {json.dumps(compile_cache)}"]
    return "\n".join([
        f"tpurl.RLConfig.seed = {SEED}",
        f"tpurl.RLConfig.steps = {steps}",
        f"tpurl.RLConfig.batch_size = {PROMPTS_PER_STEP * GROUP_SIZE}",
        f"tpurl.RLConfig.init_from = {json.dumps(ckpt)}",
        # With init_from the architecture comes from config.json; the preset gives run-time fields only.
        "tpurl.RLConfig.model = @tpurl.model_preset()",
        'tpurl.model_preset.name = "tiny"',
        'tpurl.model_preset.remat = "none"',
        f"tpurl.model_preset.unroll_layers = {layers}",
        # One CPU device: its memory is the host's, so parking the optimizer state frees nothing.
        "tpurl.RLConfig.handover = @tpurl.HandoverConfig()",
        "tpurl.HandoverConfig.offload_opt_state = False",
        "tpurl.RLConfig.task = @tpurl.TaskConfig()",
        "tpurl.TaskConfig.addition = @tpurl.AdditionConfig()",
        f"tpurl.AdditionConfig.digits = {a.digits}",
        f"tpurl.AdditionConfig.num_eval = {a.num_eval}",
        f"tpurl.AdditionConfig.seed = {a.seed}",
        f"tpurl.AdditionConfig.extra_new_tokens = {a.extra_new_tokens}",
        f"tpurl.AdditionConfig.format_weight = {a.format_weight}",
        "tpurl.RLConfig.algorithm = @tpurl.algorithm_preset()",
        'tpurl.algorithm_preset.name = "grpo"',
        f"tpurl.algorithm_preset.group_size = {GROUP_SIZE}",
        f"tpurl.algorithm_preset.kl_coef = {KL_COEF}",
        f"tpurl.algorithm_preset.eps_low = {CLIP_EPS}",
        f"tpurl.algorithm_preset.eps_high = {CLIP_EPS}",
        f"tpurl.algorithm_preset.adv_eps = {ADV_EPS}",
        f"tpurl.algorithm_preset.temperature = {TEMPERATURE}",
        "tpurl.RLConfig.optimizer = @tpurl.OptimizerConfig()",
        f"tpurl.OptimizerConfig.lr = {LR}",
        f"tpurl.OptimizerConfig.max_grad_norm = {MAX_GRAD_NORM}",
        "tpurl.RLConfig.eval = @tpurl.EvalConfig()",
        f"tpurl.EvalConfig.num_problems = {NUM_EVAL}",
        "tpurl.EvalConfig.pass_k = 1",
        "tpurl.RLConfig.checkpoint = @tpurl.CheckpointConfig()",
        "tpurl.CheckpointConfig.every_steps = 0",
        "tpurl.CheckpointConfig.export_hf = False",
        "tpurl.RLConfig.logging = @tpurl.LoggingConfig()",
        f"tpurl.LoggingConfig.run_dir = {json.dumps(run_dir)}",
        "tpurl.LoggingConfig.trackers = ()",
        "tpurl.LoggingConfig.progress_bar = False",
        "tpurl.LoggingConfig.trajectory_sample_rate = 0.0",
        *cache,
    ]) + "\n"


def one_cpu_device_env() -> dict[str, str]:
    """This process's environment for the `tpurl train` child: JAX on the CPU with its one real
    device (no forced fake-device count), and this checkout importable without installing it."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device_count")]
    env["XLA_FLAGS"] = " ".join(flags)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, env.get("PYTHONPATH")) if p)
    return env


def run_tpurl(task, ckpt: str, out: str, steps: int, name: str = "tpurl") -> dict:
    """`python -m tpurl train` on the checkpoint (1 warm-up + `steps` timed steps) with its compile
    cache in `out` (a second run of the same config finds the first's programs there); returns its
    step seconds, phases, completion length and compile seconds from the run's own summary.json and
    metrics.jsonl."""
    n = task.max_new_tokens
    gin_file = os.path.join(out, f"{name}_{n}.gin")
    run_dir = os.path.join(out, f"{name}_{n}")
    with open(gin_file, "w") as f:
        # One cache per setting: its first run starts from an empty one.
        f.write(tpurl_gin(task, ckpt, run_dir, steps + 1, compile_cache=os.path.join(out, f"compile_cache_{n}")))
    cmd = [sys.executable, "-m", "tpurl", "train", "--quiet", "--gin_file", gin_file]
    done = subprocess.run(cmd, env=one_cpu_device_env(), cwd=REPO, capture_output=True, text=True)
    if done.returncode != 0:
        sys.stderr.write(done.stdout[-2000:] + done.stderr[-4000:])
        raise SystemExit(f"tpurl train failed (status {done.returncode}): {' '.join(cmd)}")
    return tpurl_results(run_dir)


def tpurl_results(run_dir: str) -> dict:
    """Mean step seconds and phases (the run's summary: the steps that compiled no program), the
    mean completion length over the same steps and `all_steps_mean_s`, the mean over every step
    (the warm-up's and the other compiles included); `compile`: how many steps compiled programs
    (the first, and one per new packed shape) and the seconds they spent on it, and the whole
    run's compile seconds (`run_seconds`) with the programs it compiled or loaded from the cache."""
    from tpurl.logging import METRICS_FILE, SUMMARY_FILE, read_jsonl
    from tpurl.rl.timeline import steady_steps

    with open(os.path.join(run_dir, SUMMARY_FILE)) as f:
        summary = json.load(f)
    timeline = summary["timeline"]
    phases = {name: v["mean_s"] for name, v in timeline.items() if name != "step"}
    every = [r for r in read_jsonl(os.path.join(run_dir, METRICS_FILE)) if "time/step_s" in r]
    records = steady_steps(every)
    step_s = timeline["step"]["mean_s"]
    common = {"generate": phases.get("rollout", 0.0), "reward": phases.get("reward", 0.0),
              "ref_logprobs": phases.get("logprobs", 0.0), "update": phases.get("update", 0.0)}
    common["other"] = step_s - sum(common.values())
    return {"step_s": step_s, "phases_s": phases, "common_s": common, "timed_steps": len(records),
            "all_steps_mean_s": sum(r["time/step_s"] for r in every) / len(every), "all_steps": len(every),
            "compile": summary.get("compile"),
            "mean_completion_len": sum(r["response_length/mean"] for r in records) / len(records),
            "run_dir": run_dir}


class TRLPhaseTimer:
    """Per-step phase seconds of a `GRPOTrainer`, by wrapping the trainer's own methods.

    A step runs from the Trainer's `on_step_begin` to its `on_step_end` callback. Phases:
    `generate` (`_generate`: tokenize the prompts, `model.generate`, decode), `reward`
    (`_calculate_rewards`), `ref_logprobs` (`_get_per_token_logps_and_entropies` on the reference
    model), `old_logprobs` (the same on the policy outside the loss; none when on-policy),
    `loss_forward` (`compute_loss`: the policy forward and the GRPO loss), `backward`
    (`accelerator.backward`), `optimizer` (gradient clipping, then `on_pre_optimizer_step` to
    `on_optimizer_step`: the AdamW step). Whatever else the step does (advantages, padding, the lr
    scheduler, zeroing gradients, bookkeeping) is `other`.
    """

    def __init__(self, trainer):
        self.steps: list[dict[str, float]] = []  # one per finished step, with "step" and "other"
        self.lengths: list[float] = []  # mean completion length of each step
        self._now: dict[str, float] | None = None  # the open step's phases (None between steps)
        self._t0 = self._t_opt = 0.0  # perf_counter at the open step's start / optimizer step's start
        self._in_loss = False
        self._wrap(trainer, "_generate", "generate")
        self._wrap(trainer, "_calculate_rewards", "reward")
        self._wrap(trainer, "compute_loss", "loss_forward")
        self._wrap(trainer.accelerator, "backward", "backward")
        self._wrap(trainer, "_clip_grad_norm", "optimizer")
        self._wrap_logprobs(trainer)

    def _add(self, phase: str, seconds: float) -> None:
        if self._now is not None:
            self._now[phase] = self._now.get(phase, 0.0) + seconds

    def _wrap(self, owner, method: str, phase: str) -> None:
        inner = getattr(owner, method)

        def timed(*args, **kwargs):
            self._in_loss = phase == "loss_forward"  # no wrapped method calls another, except logprobs
            t0 = time.perf_counter()
            try:
                out = inner(*args, **kwargs)
            finally:
                self._add(phase, time.perf_counter() - t0)
                self._in_loss = False
            if phase == "generate":  # (prompt_ids, completion_ids, ...): completion_ids end with EOS if stopped
                self.lengths.append(sum(map(len, out[1])) / len(out[1]))
            return out

        setattr(owner, method, timed)

    def _wrap_logprobs(self, trainer) -> None:
        inner = trainer._get_per_token_logps_and_entropies

        def timed(model, *args, **kwargs):
            if self._in_loss:  # the loss's own forward: part of loss_forward
                return inner(model, *args, **kwargs)
            t0 = time.perf_counter()
            out = inner(model, *args, **kwargs)
            self._add("ref_logprobs" if model is trainer.ref_model else "old_logprobs", time.perf_counter() - t0)
            return out

        trainer._get_per_token_logps_and_entropies = timed

    def begin_step(self) -> None:
        self._now, self._t0 = {}, time.perf_counter()

    def begin_optimizer(self) -> None:
        self._t_opt = time.perf_counter()

    def end_optimizer(self) -> None:
        self._add("optimizer", time.perf_counter() - self._t_opt)

    def end_step(self) -> None:
        step = time.perf_counter() - self._t0
        phases, self._now = self._now, None
        phases["other"] = step - sum(phases.values())
        phases["step"] = step
        self.steps.append(phases)


def step_callback(timer: TRLPhaseTimer):
    """A transformers `TrainerCallback` that marks step and optimizer boundaries on `timer`."""
    from transformers import TrainerCallback

    class StepTimes(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            timer.begin_step()

        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            timer.begin_optimizer()

        def on_optimizer_step(self, args, state, control, **kwargs):
            timer.end_optimizer()

        def on_step_end(self, args, state, control, **kwargs):
            timer.end_step()

    return StepTimes()


def trl_config(out: str, max_new_tokens: int, steps: int):
    """The `GRPOConfig` of the TRL side. TRL defaults that would change the comparison are
    overridden: bf16 on, gradient checkpointing on, lr 1e-6 decaying linearly, the DAPO loss,
    shuffled prompts, beta 0 (no reference), the KL term's importance-ratio factor (tpurl's loss
    has none). The optimizer stays TRL's default (`adamw_torch_fused`
    with torch >= 2.8), its fastest AdamW."""
    from trl import GRPOConfig

    return GRPOConfig(
        output_dir=out, max_steps=steps, seed=SEED, use_cpu=True, bf16=False, fp16=False,
        gradient_checkpointing=False,
        per_device_train_batch_size=PROMPTS_PER_STEP * GROUP_SIZE, gradient_accumulation_steps=1,
        num_generations=GROUP_SIZE, steps_per_generation=1, num_iterations=1, shuffle_dataset=False,
        max_completion_length=max_new_tokens, temperature=TEMPERATURE, top_p=1.0, top_k=0,
        beta=KL_COEF, epsilon=CLIP_EPS, loss_type="grpo", scale_rewards="group", use_bias_correction_kl=False,
        learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, max_grad_norm=MAX_GRAD_NORM,  # optim: the default
        logging_strategy="no", save_strategy="no", report_to="none", disable_tqdm=True,
        dataloader_num_workers=0, log_completions=False)


def run_trl_apart(task, ckpt: str, out: str, steps: int) -> dict:
    """`run_trl` in a child process of its own (spawned), started as this one was (`_trl_child`):
    TRL's process and the host memory it held are gone before the next tpurl run peaks (a 30M
    run's update holds ~12 GB of activations: docs/performance.md). A child that dies (killed
    for memory) raises `BrokenProcessPool` here."""
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(_trl_child, task.max_new_tokens, ckpt, out, steps).result()


def _trl_child(max_new_tokens: int, ckpt: str, out: str, steps: int) -> dict:
    from tpurl.startup import prepare

    prepare()  # this process's start, as `__main__` below does for the parent (before torch starts)
    return run_trl(addition_task(max_new_tokens), ckpt, out, steps)


def run_trl(task, ckpt: str, out: str, steps: int) -> dict:
    """TRL's `GRPOTrainer` on the checkpoint (1 warm-up + `steps` timed steps), in this process;
    returns mean step seconds, phases and completion length over the timed steps."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is local: never ask the hub
    import datasets
    from transformers import AutoTokenizer
    from trl import GRPOTrainer

    tokenizer = AutoTokenizer.from_pretrained(ckpt)
    bos, eos_id = tokenizer.bos_token, tokenizer.eos_token_id
    rows = [{"prompt": bos + p.prompt, "answer": p.answer} for p in step_problems(task, steps + 1)]

    def addition_reward(completions, completion_ids, answer, **_):
        return [completion_reward(task, a, c, ids, eos_id) for c, ids, a in zip(completions, completion_ids, answer)]

    trainer = GRPOTrainer(model=ckpt, reward_funcs=addition_reward, processing_class=tokenizer,
                          args=trl_config(os.path.join(out, f"trl_{task.max_new_tokens}"), task.max_new_tokens,
                                          steps + 1),
                          train_dataset=datasets.Dataset.from_list(rows))
    timer = TRLPhaseTimer(trainer)
    trainer.add_callback(step_callback(timer))
    with contextlib.redirect_stdout(sys.stderr):  # stdout carries only this script's JSON
        trainer.train()
    return {**trl_results(timer.steps[1:], timer.lengths[1:]), "settings": trl_settings(trainer),
            "all_steps_mean_s": sum(s["step"] for s in timer.steps) / len(timer.steps), "all_steps": len(timer.steps)}


def trl_settings(trainer) -> dict:
    """What the TRL run actually used, read back from the trainer (not from what was asked)."""
    import torch
    import transformers
    import trl

    model = trainer.model
    checkpointing = any(getattr(m, "gradient_checkpointing", False) for m in model.modules())
    optim = getattr(trainer.args.optim, "value", str(trainer.args.optim))  # an enum in transformers
    return {"trl": trl.__version__, "torch": torch.__version__, "transformers": transformers.__version__,
            "torch_threads": torch.get_num_threads(), "dtype": str(next(model.parameters()).dtype),
            "gradient_checkpointing": checkpointing, "optim": optim,
            "loss_type": trainer.loss_type, "beta": trainer.beta, "ref_model": trainer.ref_model is not None}


def trl_results(steps: list[dict[str, float]], lengths: list[float]) -> dict:
    """Means over the timed steps, in the same shape as `tpurl_results`."""
    names = sorted({k for s in steps for k in s})
    mean = {k: sum(s.get(k, 0.0) for s in steps) / len(steps) for k in names}
    step_s = mean.pop("step")
    common = {"generate": mean.get("generate", 0.0), "reward": mean.get("reward", 0.0),
              "ref_logprobs": mean.get("ref_logprobs", 0.0) + mean.get("old_logprobs", 0.0),
              "update": sum(mean.get(k, 0.0) for k in ("loss_forward", "backward", "optimizer"))}
    common["other"] = step_s - sum(common.values())
    return {"step_s": step_s, "phases_s": mean, "common_s": common, "timed_steps": len(steps),
            "mean_completion_len": sum(lengths) / len(lengths)}


def require_bench_extra() -> None:
    """Exit with one line naming the extra when torch, transformers or trl is missing."""
    import importlib.util

    missing = [m for m in ("torch", "transformers", "trl", "datasets") if importlib.util.find_spec(m) is None]
    if missing:
        raise SystemExit(f"bench_vs_trl.py needs {', '.join(missing)} (the bench extra): {BENCH_EXTRA}")


def compare(task, ckpt: str, out: str, steps: int) -> dict:
    """One setting: tpurl, then TRL (never at once), then tpurl again with the first run's compile
    cache; the step-time ratios (steady steps, and every step with compiles included) and the
    second tpurl run's compile seconds over the first's."""
    ours = run_tpurl(task, ckpt, out, steps)
    theirs = run_trl_apart(task, ckpt, out, steps)
    again = run_tpurl(task, ckpt, out, steps, name="tpurl_again")
    return {"max_new_tokens": task.max_new_tokens, "timed_steps": steps, "tpurl": ours, "trl": theirs,
            "tpurl_second_run": again, "ratio": theirs["step_s"] / ours["step_s"],
            "ratio_all_steps": theirs["all_steps_mean_s"] / ours["all_steps_mean_s"],
            "ratio_all_steps_warm": theirs["all_steps_mean_s"] / again["all_steps_mean_s"],
            "second_run_compile_share": again["compile"]["run_seconds"] / ours["compile"]["run_seconds"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=5, help="timed steps per system and setting (after 1 warm-up)")
    parser.add_argument("--max-new-tokens", type=int, nargs="+", default=[8, 128])
    parser.add_argument("--out", default=None, help="where the checkpoint and both runs go (default: a new temp dir)")
    parser.add_argument("--size", default="4m", help=f"comma-separated model sizes of {', '.join(SIZES)}")
    args = parser.parse_args()
    if args.steps < 1:
        parser.error("--steps must be >= 1")
    sizes = [s.strip() for s in args.size.split(",") if s.strip()]
    if not sizes or any(s not in SIZES for s in sizes):
        parser.error(f"--size {args.size!r}: use some of {', '.join(SIZES)} (comma-separated)")
    require_bench_extra()
    sys.path.insert(0, REPO)  # this checkout's tpurl, as in the `tpurl train` child (`one_cpu_device_env`)
    tasks = [addition_task(n) for n in args.max_new_tokens]
    start = time.perf_counter()
    out = os.path.abspath(args.out or tempfile.mkdtemp(prefix="bench_vs_trl_"))
    if os.path.isdir(out) and os.listdir(out):
        parser.error(f"--out {out} is not empty; give a new directory (each run writes its own checkpoint)")
    ratios = {}
    for size in sizes:
        ckpt = os.path.join(out, size, "checkpoint")
        write_checkpoint(ckpt, SIZES[size])
        for task in tasks:
            result = {"size": size, **compare(task, ckpt, os.path.join(out, size), args.steps)}
            print(json.dumps(result), flush=True)
            suffix = f"{task.max_new_tokens}" + ("" if size == "4m" else f"_{size}")
            ratios[f"ratio_{suffix}"] = result["ratio"]
            ratios[f"ratio_all_steps_{suffix}"] = result["ratio_all_steps"]
            ratios[f"ratio_all_steps_warm_{suffix}"] = result["ratio_all_steps_warm"]
            ratios[f"second_run_compile_share_{suffix}"] = result["second_run_compile_share"]
    print(json.dumps(ratios), flush=True)
    print(f"[bench_vs_trl] {time.perf_counter() - start:.0f} s; checkpoints and runs in {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    # Host memory as `tpurl` allocates it and XLA:CPU's compile flags as it sets them
    # (tpurl/startup.py), before JAX or torch starts: TRL runs in a child started the same way
    # (`_trl_child`), so both systems run with the same allocator settings (the flags only concern
    # XLA; the tpurl child inherits them).
    # The comparison runs on one CPU device: the modes are decided as for the tpurl child
    # (`one_cpu_device_env`).
    os.environ.update(one_cpu_device_env())
    from tpurl.startup import apply_at_start

    apply_at_start("bench_vs_trl")
    sys.exit(main())
