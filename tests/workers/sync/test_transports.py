"""mortal.workers.sync.transport_for: the one place a sync method becomes its transport."""

from __future__ import annotations

import typing

import pytest

from mortal.specs.training import SYNC_ALIASES, SyncSpec
from mortal.workers.sync import UnknownSyncMethod, transport_for
from mortal.workers.sync.base import WeightTransport
from mortal.workers.sync.ipc import IpcTransport
from mortal.workers.sync.nccl import NcclTransport
from mortal.workers.sync.ray import RayTransport
from mortal.workers.sync.volume import VolumeTransport


@pytest.mark.parametrize(
    ("method", "transport"),
    [("volume", VolumeTransport), ("ray", RayTransport), ("ipc", IpcTransport), ("nccl", NcclTransport)],
)
def test_each_method_names_its_transport(method: str, transport: type[WeightTransport]) -> None:
    assert transport_for(method) is transport and transport.method == method


def test_every_method_a_spec_can_resolve_to_has_a_transport() -> None:
    """What spec.sync_method() returns: the spec's methods, less auto (resolved) and the seeds' aliases
    (stored as the method they stand for)."""
    methods = set(typing.get_args(SyncSpec.model_fields["method"].annotation)) - {"auto"} - set(SYNC_ALIASES)
    assert {transport_for(method).method for method in methods} == methods


def test_an_unknown_method_is_a_typed_error_that_names_the_known_ones() -> None:
    with pytest.raises(UnknownSyncMethod, match=r"'carrier-pigeon'.*volume, ray, ipc, nccl"):
        transport_for("carrier-pigeon")
    with pytest.raises(UnknownSyncMethod):
        transport_for("auto")  # resolved by the spec before it reaches a transport


def test_only_ipc_and_nccl_serve_from_the_ring_and_only_ray_keeps_no_version_folders() -> None:
    assert [m for m in ("volume", "ray", "ipc", "nccl") if transport_for(m).in_ring] == ["ipc", "nccl"]
    assert [m for m in ("volume", "ray", "ipc", "nccl") if not transport_for(m).version_folders] == ["ray"]
