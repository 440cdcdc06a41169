"""GPUs in the GRES strings sinfo prints (``%G``); sinfo itself is asked in test_sbatch.py (cluster)."""

from __future__ import annotations

import pytest

from dslaunch.launcher.runners.slurm.gres import PartitionGpus, gpus_in

pytestmark = pytest.mark.timeout(10)


@pytest.mark.parametrize("gres, gpus", [
    ("(null)", 0),  # the test SLURM's nodes, and any node without GRES
    ("gpu:8", 8),
    ("gpu:a100:4(S:0-1)", 4),
    ("gpu:tesla_v100-sxm2:2(S:0),mps:200", 2),
    ("mps:400,gpu:4(S:0,1)", 4),
    ("gpu:a100:2,gpu:h100:2", 4),  # two GPU types on one node
    ("shard:8,nic:1", 0),
    ("bandwidth:lustre:4G", 0),
])
def test_gpus_in_a_nodes_gres(gres, gpus):
    assert gpus_in(gres) == gpus


def test_a_partition_has_as_many_gpus_per_node_as_its_largest_node():
    assert PartitionGpus("mixed", ("(null)", "gpu:2", "gpu:a100:8(S:0-1)")).gpus_per_node == 8
    assert PartitionGpus("cpu", ("(null)",)).gpus_per_node == 0
