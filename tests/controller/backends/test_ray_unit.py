"""The Ray backend's pure parts, without a cluster: which backend a spec names, and GPU names in Ray's
spelling.

The backend itself is tested on a real cluster (tests/controller/test_ray_backend.py, in `unshare -rn`).
"""

from __future__ import annotations

import pytest

from mortal.controller.backends import UnknownBackend, backend_key, select_backend
from mortal.workers.simulated import simulated_run

ray = pytest.importorskip("ray")
from mortal.controller.backends.ray import ray_accelerator_type  # noqa: E402 - after the skip


def test_backend_key_carries_the_ray_address_so_runs_on_one_cluster_share_a_backend() -> None:
    assert backend_key(simulated_run("a").spec) == "local"
    assert backend_key(simulated_run("b", spec={"backend": "ray"}).spec) == "ray"
    named = simulated_run("c", spec={"backend": "ray", "ray": {"address": "10.0.0.5:6379"}}).spec
    assert backend_key(named) == "ray@10.0.0.5:6379"
    with pytest.raises(UnknownBackend, match="use one of local, modal, ray"):
        select_backend("rayy")


@pytest.mark.parametrize(
    ("gpu", "expected"),
    [
        ("none", None),
        ("cpu", None),
        ("any", None),
        ("A100", "A100"),
        ("a10g", "A10G"),
        ("H100", "H100"),
        ("L4", "L4"),
        ("t4", "T4"),
        ("H200", "H200"),
        ("A100:2", "A100"),
    ],
)
def test_gpu_names_become_rays_accelerator_types(gpu: str, expected: str | None) -> None:
    assert ray_accelerator_type(gpu, ray) == expected
