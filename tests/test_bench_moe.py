"""`scripts/bench_moe.py`: its `--tiny` size run in this process (every field of its JSON present and
finite, the grouped and dense experts agreeing, the counted FLOPs K/E apart and as written out by
hand), and a bad flag as a usage error."""

import json
import math

import pytest

from helpers import load_script  # tests/ is on the path

PHASE_FIELDS = tuple(f"{v}_{f}" for v in ("grouped", "dense") for f in (
    "s", "tokens_per_s", "flops", "xla_flops", "xla_over_counted", "xla_flops_per_s")) + (
    "grouped_over_dense", "max_abs_diff", "max_abs")
ROW_FIELDS = ("size", "tokens", "embed", "expert_mlp", "experts", "experts_per_token", "routing", "forward",
              "forward_backward")
ROUTING_FIELDS = ("tokens_per_expert_min", "tokens_per_expert_max", "tokens_per_expert_mean", "max_over_mean")


@pytest.fixture(scope="module")
def bench():
    return load_script("bench_moe")


def _numbers(tree):
    if isinstance(tree, dict):
        for v in tree.values():
            yield from _numbers(v)
    elif isinstance(tree, list):
        for v in tree:
            yield from _numbers(v)
    elif isinstance(tree, (int, float)) and not isinstance(tree, bool):
        yield tree


@pytest.mark.slow
def test_tiny_run_prints_every_field_finite_and_the_two_computations_agree(bench, capsys):
    assert bench.main(["--tiny"]) == 0
    out = json.loads(capsys.readouterr().out)  # the one JSON document: progress went to stderr
    assert {"backend", "devices", "dtype", "matmul_rate", "repeats", "results", "xla_flops_note", "wall_s"} <= set(out)
    assert out["repeats"] == 1 and out["matmul_rate"] > 0 and "ragged_dot" in out["xla_flops_note"]
    (row,) = out["results"]
    assert set(ROW_FIELDS) <= set(row) and set(ROUTING_FIELDS) <= set(row["routing"])
    t, d, f, e, k = (row[n] for n in ("tokens", "embed", "expert_mlp", "experts", "experts_per_token"))
    assert (row["size"], t, d, f, e, k) == ("tiny", 64, 32, 16, 4, 2)
    assert row["routing"]["tokens_per_expert_mean"] == t * k / e
    for phase, factor in (("forward", 1), ("forward_backward", 3)):
        r = row[phase]
        assert set(PHASE_FIELDS) <= set(r), set(PHASE_FIELDS) - set(r)
        # The expert matmuls: gate, up and down, 2*D*F FLOPs a row each; the backward twice that.
        assert r["grouped_flops"] == factor * 3 * 2 * t * k * d * f
        assert r["grouped_flops"] * e == r["dense_flops"] * k
        assert r["grouped_s"] > 0 and r["dense_s"] > 0 and r["grouped_xla_flops"] > 0 and r["dense_xla_flops"] > 0
        assert r["grouped_over_dense"] == pytest.approx(r["dense_s"] / r["grouped_s"])
        assert r["max_abs"] > 0
    assert row["forward"]["max_abs_diff"] <= 1e-4
    assert row["forward_backward"]["max_abs_diff"] <= 1e-4 * max(1.0, row["forward_backward"]["max_abs"])
    assert all(math.isfinite(x) for x in _numbers(out))


def test_bad_repeats_is_a_usage_error(bench, capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(["--tiny", "--repeats", "0"])
    assert e.value.code == 2 and "--repeats 0 must be >= 1" in capsys.readouterr().err
