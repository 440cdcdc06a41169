"""ZeRO++ on the namespace cluster: 2 hosts x 2 ranks (gloo over the hosts' links), 100 steps of a tiny
language model at ZeRO-3 and with quantized weights, quantized gradients and hpZ; the ZeRO++ run's
held-out loss and its last training losses stay within 1% of ZeRO-3's.

100 steps, not 200: the task is at its floor by then, so the bound compares trained runs either way
(2 x 2 ranks, hpZ over 2, on one host: ZeRO-3's held-out loss 1.123 at step 100, 1.113 at 200, from
3.17; ZeRO++'s gaps +0.45% held-out and +0.22% on the last 20 losses at 100, +0.28% and +0.21% at 200).

Runs under ``/tmp/dslaunch-cluster.lock`` (the cluster is shared); brings hosts 1 and 2 up if they are
not and leaves them up. Skips where no cluster can exist.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.launcher.runners.hosts import locked_hosts, rank_outputs

ROOT = Path(__file__).resolve().parents[3]
STEPS = 100


@pytest.mark.timeout(300)
def test_zeropp_stays_within_one_percent_of_zero3_over_100_steps_on_two_hosts() -> None:
    with locked_hosts(2) as (_, ranks, hosts):
        results = ranks.run_on_hosts(hosts, 2, [sys.executable, str(ROOT / "tests/runtime/zero/bin/zeropp_train.py")],
                                     timeout=270, env={"PYTHONPATH": str(ROOT), "STEPS": str(STEPS)})
    out = rank_outputs(results)[0]
    zero3, zeropp = out["zero3"], out["zeropp"]
    assert zero3["held_out"] < 0.6 * zero3["first"]  # it trains
    assert zeropp["held_out"] == pytest.approx(zero3["held_out"], rel=0.01), out
    assert sum(zeropp["last"]) == pytest.approx(sum(zero3["last"]), rel=0.01), out
