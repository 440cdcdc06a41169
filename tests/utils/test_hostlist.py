"""SLURM hostlists: expansion and compression, checked against SLURM's own ``scontrol``."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dslaunch.errors import HostfileError
from dslaunch.utils.hostlist import MAX_HOSTS, compress, expand

SCONTROL = shutil.which("scontrol")


@pytest.fixture(scope="module")
def scontrol(tmp_path_factory):
    """``scontrol show hostnames``: parsing needs a slurm.conf, not a running controller."""
    if SCONTROL is None:
        pytest.skip("scontrol not installed (make system-deps installs slurm-wlm as root)")
    conf = tmp_path_factory.mktemp("slurm") / "slurm.conf"
    conf.write_text("ClusterName=t\nSlurmctldHost=localhost\nNodeName=localhost CPUs=1\n"
                    "PartitionName=p Nodes=localhost\n")

    def hostnames(hostlist: str) -> list[str]:
        out = subprocess.run([SCONTROL, "show", "hostnames", hostlist], capture_output=True, text=True,
                             env={**os.environ, "SLURM_CONF": str(conf)}, timeout=20, check=True)
        return out.stdout.split()

    return hostnames


@pytest.mark.parametrize("hostlist, hosts", [
    ("n[01-04,07],gpu-a[1-2]", ["n01", "n02", "n03", "n04", "n07", "gpu-a1", "gpu-a2"]),
    ("n[08-10]", ["n08", "n09", "n10"]),
    ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
    ("node7", ["node7"]),
    ("a1.rack[2-3]", ["a1.rack2", "a1.rack3"]),
    ("n[3,1]", ["n3", "n1"]),
])
def test_examples_expand_as_scontrol_does(hostlist, hosts, scontrol):
    assert expand(hostlist) == hosts
    assert scontrol(hostlist) == hosts


@pytest.mark.parametrize("hostlist, words", [
    ("n[1-", "'[' without ']'"), ("n1]", "']' without '['"), ("n[[1]]", "nested '['"),
    ("n[]", "empty brackets"), ("n[3-1]", "runs backwards"), ("a,,b", "empty host name"),
    ("n[x]", "is not a number or a range"), (f"n[1-{MAX_HOSTS + 5}]", f"more than {MAX_HOSTS} hosts"),
    ("n[1-300]m[1-300]", f"more than {MAX_HOSTS} hosts"), ("-n[1-2]", "not starting or ending with '-'"),
    ("n[1-2]-ib", "'-ib' after ']'"),
])
def test_bad_hostlists_are_one_line_naming_the_source(hostlist, words):
    with pytest.raises(HostfileError) as err:
        expand(hostlist, "SLURM_JOB_NODELIST")
    message = str(err.value)
    assert message.startswith("SLURM_JOB_NODELIST: ") and words in message and "\n" not in message
    assert len(message) < 300


_names = st.builds(
    lambda prefix, number, width, suffix: f"{prefix}{str(number).zfill(width)}{suffix}",
    st.sampled_from(["n", "gpu-a", "r1n", "x"]), st.integers(0, 120), st.integers(1, 4),
    st.sampled_from(["", "-ib", ".lan"]))
_host_lists = st.lists(st.one_of(_names, st.sampled_from(["login", "head-node"])), min_size=1, max_size=30,
                       unique=True)


@settings(max_examples=300, deadline=None)
@given(_host_lists)
def test_compress_then_expand_gives_the_hosts_back_in_order(hosts):
    text = compress(hosts)
    assert expand(text) == hosts
    assert len(text) <= len(",".join(hosts))


@pytest.mark.timeout(120)
@settings(max_examples=40, deadline=None)
@given(hosts=_host_lists)
def test_slurm_reads_what_compress_writes(hosts, scontrol):
    assert scontrol(compress(hosts)) == hosts
