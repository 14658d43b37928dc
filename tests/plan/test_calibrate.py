"""The matmul skeleton that benchmarks set beside a phase: the model's projections, nothing else."""

import pytest

from tpurl.models import preset
from tpurl.plan.calibrate import model_matmuls
from tpurl.plan.timing import matmul_params

pytestmark = pytest.mark.slow  # whole runs, subprocesses or several processes


@pytest.mark.parametrize("backward", [False, True])
def test_skeleton_flops_are_the_models_matmuls(backward):
    mc = preset("tiny-qwen3", vocab_size=64, hidden_size=64, intermediate_size=160, num_layers=3, num_heads=4,
                num_kv_heads=2, head_dim=16)
    rows = 32
    fn, args = model_matmuls(mc, rows, backward=backward)
    flops = fn.lower(*args).compile().cost_analysis()["flops"]
    # Forward: 2 FLOPs per parameter per row; the backward adds two matmuls per forward matmul
    # (the gradients of its input and of its weight).
    expected = 2 * matmul_params(mc) * rows * (3 if backward else 1)
    # The residual adds and the SwiGLU product are elementwise: a few FLOPs per activation.
    assert expected <= flops <= 1.02 * expected
