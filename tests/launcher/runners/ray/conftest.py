"""The Ray tests' cluster (``cluster.local_cluster``), one per module; skipped without Ray."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.launcher.runners.ray.cluster import RayTestCluster, local_cluster


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[RayTestCluster]:
    pytest.importorskip("ray", reason="Ray is not installed (pip install 'dslaunch[ray]'; make test installs it)")
    with local_cluster() as cluster:
        yield cluster
