"""The namespace cluster's link shaping (``cluster.py up|shape --link-rate``), used: 2 hosts with a
40 Mbit/s link each; a transfer between them takes at least what the rate allows (a lower bound holds
under any load), and OneBitAdam's compressed steps send ~32x fewer bytes over the link than its fp32
warm-up steps (the hosts' interface counters: bytes on the wire, headers included).

Runs under ``/tmp/dslaunch-cluster.lock`` (the cluster is shared); brings hosts 1 and 2 up if they are
not, shapes the cluster's links for the test and puts back the shaping it found. Skips where no
cluster can exist.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.launcher.runners.hosts import locked_hosts, rank_outputs

ROOT = Path(__file__).resolve().parents[3]
RATE_BITS = 40_000_000
TRANSFER_BYTES = 5_000_000


@pytest.mark.timeout(150)  # the ranks' start and exit, not the timed transfer, take long under load
def test_a_shaped_link_bounds_a_transfer_and_onebit_adam_sends_32x_fewer_bytes_over_it() -> None:
    with locked_hosts(2) as (cluster, ranks, hosts):
        state = cluster.state_dir_default()
        found = cluster.LinkShape(**json.loads((state / "state.json").read_text())["link"])
        cluster.reshape(state, cluster.LinkShape(f"{RATE_BITS // 1_000_000}mbit"))
        try:
            results = ranks.run_on_hosts(hosts, 1, [sys.executable, str(ROOT / "tests/runtime/optim/bin/onebit_link.py")],
                                         timeout=120, env={"PYTHONPATH": str(ROOT), "TRANSFER_BYTES": str(TRANSFER_BYTES)})
        finally:
            cluster.reshape(state, found)
    out = rank_outputs(results)
    # unshaped, the veth pair moves 5 MB in milliseconds
    # (less the token bucket's burst: sent at once, before the rate applies)
    assert out[0]["transfer_s"] >= (TRANSFER_BYTES - cluster.BURST_BYTES) * 8 / RATE_BITS, out
    for host in out:  # fp32 ring all-reduce: 4 bytes per parameter; the 1-bit exchange ~1/8 (30.8x here)
        assert host["warmup_bytes"] >= 4 * host["numel"], out
        assert host["warmup_bytes"] / host["compressed_bytes"] >= 25, out
