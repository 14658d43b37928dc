"""tpurl.memory: compiled programs' footprints from XLA's memory analysis, read without a compile."""

import pytest
import numpy as np
import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from tpurl.generate import Engine, EngineConfig, SamplingConfig, generate
from tpurl.memory import abstract, device_peak_metrics, program_memory
from tpurl.models import init_model
from tpurl.models.config import ModelConfig


def test_program_memory_reads_arguments_outputs_and_donation():
    x = jnp.ones((1000,), jnp.float32)
    w = jnp.ones((1000, 10), jnp.float32)
    mem = program_memory(jax.jit(lambda x, w: jnp.tanh(x @ w)), x, w)
    assert mem.argument_bytes == x.nbytes + w.nbytes and mem.output_bytes == 10 * 4 and mem.alias_bytes == 0
    donated = program_memory(jax.jit(lambda x: x * 2, donate_argnums=0), x)
    # The output is written into the donated input: counted once in the peak.
    assert donated.alias_bytes == donated.output_bytes == x.nbytes
    assert donated.peak_bytes == donated.argument_bytes + donated.temp_bytes


def test_abstract_lowers_to_the_same_program_as_the_arrays():
    """The same lowered text is what lets the compiled program come from JAX's cache (no compile):
    for arrays committed to a mesh, an uncommitted array, and a donated (deleted) one."""
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    sharded = jax.device_put(np.arange(64, dtype=np.float32).reshape(8, 8), NamedSharding(mesh, P("data")))
    loose = jnp.ones((8,), jnp.float32)
    fn = jax.jit(lambda a, b: (a * 2).sum(0) + b, donate_argnums=0)
    want = fn.lower(sharded, loose).as_text()
    specs = abstract((sharded, loose))
    fn(sharded, loose)
    assert sharded.is_deleted()
    assert fn.lower(*specs).as_text() == want == fn.lower(*abstract((sharded, loose))).as_text()


def test_device_peak_metrics_take_the_largest_device():
    stats = {"gpu:0": {"peak_bytes_in_use": 7, "bytes_in_use": 3}, "gpu:1": {"peak_bytes_in_use": 9, "bytes_in_use": 2}}
    assert device_peak_metrics("update", stats) == {"memory/update/device_peak_bytes": 9.0,
                                                    "memory/update/device_in_use_bytes": 3.0}
    assert device_peak_metrics("update", None) == {} == device_peak_metrics("update", {"cpu:0": None})


@pytest.mark.slow
def test_engine_decode_memory_counts_its_arguments_without_retracing():
    cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                      head_dim=8, max_position_embeddings=128)
    graphdef, params = nnx.split(init_model(cfg, 0))
    engine = Engine(cfg, EngineConfig(max_slots=4, max_seq_len=32, page_size=8, prefill_buckets=(8,)), graphdef=graphdef)
    assert engine.decode_memory() is None  # nothing compiled yet
    generate(engine, params, [[1, 2, 3]] * 2, n_samples=2, sampling=SamplingConfig(max_new_tokens=6), seed=0)
    traces = dict(engine.trace_counts)
    mem = engine.decode_memory()
    assert dict(engine.trace_counts) == traces  # the decode step was not traced again
    state = jax.eval_shape(engine._init_fn)
    state_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state))
    param_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
    # One device: the arguments are the weights, the whole decode state and the [slots] clear mask.
    assert mem.argument_bytes == param_bytes + state_bytes + 4
    assert mem.alias_bytes == state_bytes  # the donated state is updated in place
