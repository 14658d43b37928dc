"""scripts/sync_collectives.py: the collectives a train -> rollout resharding compiles to."""

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts"))

import sync_collectives  # noqa: E402

TUPLE_HLO = """
  %all-to-all.9 = (f32[1,1,1024,64]{3,2,1,0}, f32[1,1,1024,64]{3,2,1,0}) all-to-all(%a, %b), replica_groups={}
  %all-gather.2 = bf16[8,256]{1,0} all-gather(%c), dimensions={0}
  %all-gather-start.1 = f32[4]{0} all-gather-start(%d), dimensions={0}
  %add.1 = f32[4]{0} add(%e, %f)
"""


def test_collectives_in_counts_tuple_and_async_ops():
    got = sync_collectives.collectives_in(TUPLE_HLO)
    assert got == {"all-gather": {"count": 2, "bytes": 8 * 256 * 2 + 4 * 4, "dtypes": ["bf16", "f32"]},
                   "all-to-all": {"count": 1, "bytes": 2 * 1024 * 64 * 4, "dtypes": ["f32"]}}


def test_layout_pairs_compile_to_the_expected_collectives(capsys):
    assert sync_collectives.main(["--size", "10m", "--pairs", "fsdp_tp:tp_replicas,fsdp_tp:fsdp_tp"]) == 0
    pairs = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["pairs"]
    gather, same = pairs
    # Each device keeps its tensor column block and gathers the rows the other fsdp ranks hold.
    assert set(gather["collectives"]) == {"all-gather"} and gather["planned_bytes_moved_total"] > 0
    assert same["collectives"] == {} and same["planned_bytes_moved_total"] == 0
