#!/usr/bin/env bash
# The prepared accelerator check: one call of the device tool on an NVIDIA GPU (about 6 minutes).
#
#   1. the GPU-only tests: cuDNN attention vs XLA (logits and gradients), the compiled Pallas
#      paged-attention kernel vs a float64 recompute;
#   2. scripts/bench_step.py on one GPU (phase seconds vs the compute floor);
#   3. scripts/bench_sync.py (reshard vs a plain copy vs the orbax disk round trip);
#   4. scripts/bench_generate.py (paged vs dense vs no-cache decoding, slot occupancy).
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
step() {  # step NAME SECONDS COMMAND...: run with a time limit, log to $OUT/NAME.log, keep going
  local name=$1 limit=$2; shift 2
  echo "== $name"
  timeout "$limit" "$@" > "$OUT/$name.out" 2> "$OUT/$name.log" || { echo "   $name failed (rc $?)"; status=1; }
  tail -n 3 "$OUT/$name.log"
}
python3 -c "import jax; print(jax.__version__, jax.devices())" | tee "$OUT/devices.txt"
step tests 240 python3 -m pytest -q -p no:cacheprovider -rs -k on_gpu tests/models/test_transformer.py \
  tests/generate/test_attention.py
cat "$OUT/tests.out"
step bench_step 240 python3 scripts/bench_step.py --devices 1 --steps 5
step bench_sync 240 python3 scripts/bench_sync.py
step bench_generate 240 python3 scripts/bench_generate.py --batches 1,8,64
for f in bench_step bench_sync bench_generate; do [ -s "$OUT/$f.out" ] && cp "$OUT/$f.out" "$OUT/$f.json"; done
exit $status
