"""Fixtures of the controller tests that need more than tests/conftest.py gives.

    ray_cluster   one real three-node Ray cluster per test session (tests/controller/raycluster.py),
                  started on first use and stopped at the end; RAY_ADDRESS points at it for each test.

The Ray tests (test_ray_backend.py, test_lifecycle_ray.py) need a private network namespace:
scripts/test.sh runs them in `unshare -rn`. Elsewhere the fixture skips them, saying how to run them;
with CI=true it fails instead, so CI cannot pass without having run them.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from raycluster import RayCluster, in_private_network

RAY_TEST_FILES = ("tests/controller/test_ray_backend.py", "tests/controller/test_lifecycle_ray.py")


@pytest.fixture(scope="session")
def ray_session_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RayCluster]:
    pytest.importorskip("ray", reason="the ray backend's tests need ray: pip install 'mortal[ray]'")
    if not in_private_network():
        why = ("the Ray tests run a real cluster and must run in a private network namespace, loopback only: "
               f"unshare -rn sh -c 'ip link set lo up && python -m pytest {' '.join(RAY_TEST_FILES)}'")
        if os.environ.get("CI") == "true":
            pytest.fail(why)
        pytest.skip(why)
    cluster = RayCluster(Path(tmp_path_factory.mktemp("ray")))
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def ray_cluster(ray_session_cluster: RayCluster, monkeypatch: pytest.MonkeyPatch) -> RayCluster:
    monkeypatch.setenv("RAY_ADDRESS", ray_session_cluster.address)
    return ray_session_cluster
