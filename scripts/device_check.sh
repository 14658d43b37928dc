#!/usr/bin/env bash
# The prepared accelerator check on an NVIDIA GPU. Each step has its own time limit; all of them add up to more
# than one device call allows (600 s), so a session runs a subset with STEPS (below).
#
#   1. the GPU-only tests: cuDNN attention vs XLA (logits and gradients), the compiled Pallas
#      paged-attention kernel vs a float64 recompute;
#   2. scripts/bench_step.py on one GPU (phase seconds vs the compute floor);
#   3. scripts/bench_sync.py (reshard vs a plain copy vs the orbax disk round trip);
#   4. scripts/bench_generate.py (paged vs dense vs no-cache decoding, slot occupancy);
#   5. scripts/bench_rollout.py (a 16 x 8 rollout: pipelined decode vs not, narrowed widths vs full);
#   6. the demo (configs/demo.gin: warm start, 300 GRPO steps, held-out accuracy before and after);
#   7. scripts/bench_tools.py (multi-turn rollouts: slow tools vs instant tools);
#   8. scripts/bench_step.py --packing with the attention in one product and in 3 causal query
#      blocks (ModelConfig.attention_query_blocks; fp32, so XLA's attention, not cuDNN's; the CPU
#      A/B's `--remat none --unroll-layers 4`), one JSON line per run. Not in the default STEPS.
#   9. scripts/bench_scale.py: one RL step at the Qwen3-0.6B and 1.7B shapes (64 x 8 sequences of
#      512 + 1,024 tokens) against the chip's limits, one JSON line per size, in bench_scale.jsonl.
#      Not in the default STEPS: it needs a device call of its own (`STEPS=scale`, about 8 minutes).
#      SCALE_SIZES (default 0.6b,1.7b) and SCALE_ARGS (more flags) choose what it runs; on a CPU,
#      `STEPS=scale SCALE_SIZES=tiny JAX_PLATFORMS=cpu bash scripts/device_check.sh` runs it end to end.
#  10. scripts/bench_step.py --bitwise: the one-device step in fast and bitwise mode
#      (ModelConfig.consistency): whether the engine's logprobs equal the trainer's bit for bit on the
#      accelerator too (`mismatch_abs_diff_max`), and what it costs there. Not in the default STEPS.
#
# STEPS="tests demo tools" (names: tests step sync generate rollout demo tools blocks scale bitwise) runs only those, in this
# order, to fit a session's device minutes (the default, all but blocks and scale, writes the 8 files a device call
# brings back, but its time limits need two calls).
#
# Everything lands in $OUT (the device tool's output folder; /tmp/device_check elsewhere).
# The GPU image has JAX, flax, optax, orbax, tokenizers, transformers, pytest but not every
# pure-Python dependency: fetch those once here with `make device-wheels` (into .whl/, ignored by
# git), then run with the device tool: command `bash scripts/device_check.sh`, carry [".whl"].
set -uo pipefail
OUT=${OUT:-/tmp/device_check}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "installing .whl/ failed"; exit 1; }
  export PYTHONPATH="/tmp/site:$PWD"
else
  export PYTHONPATH="$PWD"
fi
export PYTHONUNBUFFERED=1 JAX_PLATFORMS="${JAX_PLATFORMS:-cuda}"
status=0
# The device tool brings back at most 8 files: stdout goes to $OUT/NAME.EXT, every step's stderr (and
# the JAX version and devices) to one $OUT/stderr.log, each block headed by the step's name.
STEPS=${STEPS:-tests step sync generate rollout demo tools}
want() { [[ " $STEPS " == *" $1 "* ]]; }
step() {  # step NAME EXT SECONDS COMMAND...: run with a time limit, keep going on failure
  local name=$1 ext=$2 limit=$3; shift 3
  echo "== $name" | tee -a "$OUT/stderr.log"
  local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.$ext" 2> "$OUT/$name.err"
  local rc=$?
  cat "$OUT/$name.err" >> "$OUT/stderr.log"
  tail -n 3 "$OUT/$name.err"; rm -f "$OUT/$name.err"
  echo "   $name: rc $rc, $((SECONDS - t0)) s"
  [ "$rc" -eq 0 ] || status=1
}
python3 -c "import jax; print(jax.__version__, jax.devices())" | tee -a "$OUT/stderr.log"
if want tests; then
  step tests out 150 python3 -m pytest -q -p no:cacheprovider -rs -k on_gpu tests/models/test_transformer.py \
    tests/generate/test_attention.py
  cat "$OUT/tests.out"
fi
want step && step bench_step json 120 python3 scripts/bench_step.py --devices 1 --steps 5
want sync && step bench_sync json 90 python3 scripts/bench_sync.py
want generate && step bench_generate json 120 python3 scripts/bench_generate.py --batches 1,8,64
want rollout && step bench_rollout json 90 python3 scripts/bench_rollout.py --rounds 3 --buckets 1
if want demo; then
  step demo out 200 python3 -m tpurl train --gin_file configs/demo.gin \
    --gin_param "tpurl.LoggingConfig.run_dir='$OUT/demo_run'"
  tail -n 12 "$OUT/demo.out"; rm -rf "$OUT/demo_run"
fi
want tools && step bench_tools json 120 python3 scripts/bench_tools.py
want blocks && step bench_blocks jsonl 150 bash -c 'for qb in 1 3; do python3 scripts/bench_step.py --packing \
  --steps 5 --remat none --unroll-layers 4 --attention-query-blocks "$qb" || exit 1; done'
# SCALE_ARGS is split into words on purpose (several flags).
# shellcheck disable=SC2086
want bitwise && step bench_bitwise json 300 python3 scripts/bench_step.py --bitwise --steps 3
want scale && step bench_scale jsonl "${SCALE_LIMIT:-570}" python3 scripts/bench_scale.py \
  --size "${SCALE_SIZES:-0.6b,1.7b}" ${SCALE_ARGS:-}
exit $status
