"""Weight sync: how the actor's weight versions reach rollout workers, behind one interface
(base.WeightTransport).

`transport_for(method)` is the one place a method (spec.sync's, as `spec.sync_method()` resolves auto, or
the one a version's row records) becomes its transport: volume, ray, ipc or nccl. The actor publishes
through mortal.workers.sync.publisher; a rollout loads each version with the transport its row names.
"""

from __future__ import annotations

from mortal.workers.sync.base import WeightTransport
from mortal.workers.sync.ipc import IpcTransport
from mortal.workers.sync.nccl import NcclTransport
from mortal.workers.sync.ray import RayTransport
from mortal.workers.sync.volume import VolumeTransport

TRANSPORTS: dict[str, type[WeightTransport]] = {
    transport.method: transport for transport in (VolumeTransport, RayTransport, IpcTransport, NcclTransport)
}


class UnknownSyncMethod(ValueError):
    """A sync method no transport implements (a spec or a stored row names something else)."""


def transport_for(method: str) -> type[WeightTransport]:
    """The transport class of `method`; UnknownSyncMethod for any other name."""
    try:
        return TRANSPORTS[method]
    except KeyError:
        raise UnknownSyncMethod(f"no weight transport {method!r}; known: {', '.join(TRANSPORTS)}") from None
