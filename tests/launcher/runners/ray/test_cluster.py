"""The Ray cluster as the plan sees it (names, order, slots) and the flags' errors: no Ray needed."""

from __future__ import annotations

import pytest

from dslaunch.errors import UsageError
from dslaunch.launcher.cli.launch import parse_config
from dslaunch.launcher.runners.ray.cluster import RAY_HEAD, RayCluster, _named, ray_pool


def _node(node_id: str, address: str, cpus: int, gpus: int = 0, head: bool = False, alive: bool = True) -> dict:
    res = {"CPU": float(cpus), **({"GPU": float(gpus)} if gpus else {}), **({RAY_HEAD: 1.0} if head else {})}
    return {"NodeID": node_id, "NodeManagerAddress": address, "Resources": res, "Alive": alive}


def test_nodes_are_named_by_address_with_the_node_id_where_addresses_repeat_and_head_comes_first():
    nodes = _named([_node("bb" * 28, "10.0.0.2", 1), _node("aa" * 28, "10.0.0.2", 1),
                    _node("cc" * 28, "10.0.0.9", 2, head=True), _node("dd" * 28, "10.0.0.3", 4)])
    assert [n.host for n in nodes] == ["10.0.0.9", "10.0.0.2-aaaaaaaa", "10.0.0.2-bbbbbbbb", "10.0.0.3"]


def test_a_dead_node_keeps_the_others_names_stable():
    nodes = _named([_node("aa" * 28, "10.0.0.2", 1), _node("bb" * 28, "10.0.0.2", 1, alive=False)])
    assert [n.host for n in nodes] == ["10.0.0.2-aaaaaaaa"]  # not renamed to 10.0.0.2 after its twin died


def test_slots_are_gpus_else_cpus_and_nodes_too_small_for_num_gpus_are_left_out_with_a_note():
    cluster = RayCluster("auto", _named([_node("aa" * 28, "10.0.0.1", 8, gpus=4, head=True),
                                         _node("bb" * 28, "10.0.0.2", 2), _node("cc" * 28, "10.0.0.3", 1)]))
    assert ray_pool(cluster, "", "", -1, []) == {"10.0.0.1": (0, 1, 2, 3), "10.0.0.2": (0, 1), "10.0.0.3": (0,)}
    notes: list[str] = []
    assert ray_pool(cluster, "", "", 2, notes) == {"10.0.0.1": (0, 1), "10.0.0.2": (0, 1)}
    assert notes == ["Ray node 10.0.0.3 left out: 1 CPUs, 2 needed per node"]
    with pytest.raises(UsageError, match="no node of the Ray cluster at auto has room for 16 worker"):
        ray_pool(cluster, "", "", 16, [])


@pytest.mark.parametrize("argv, message", [
    (["--ray_address", "auto", "train.py"], "--ray_address auto is only used with --launcher ray"),
    (["--launcher", "ray", "--no_ssh", "train.py"], "leave out --no_ssh"),
    (["--launcher", "ray", "-H", "hosts", "train.py"], "leave out --hostfile"),
])
def test_ray_flags_in_the_wrong_company_are_one_clear_error(argv, message):
    with pytest.raises(UsageError, match=message):
        parse_config(argv, env={})
