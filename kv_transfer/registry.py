"""The KV transports, by the names a request's `kv_transport` may give (declared once, for
every layer, as `pdserve.protos.KV_TRANSPORTS`), and a worker's set of them.

Adding a transport: implement `KVTransport` (kv_transfer.base) with a `from_settings`
constructor, add its name to `KV_TRANSPORTS`, and its class here.
"""

from __future__ import annotations

from pdserve.kv_transfer.base import KVTransport, TransportSettings
from pdserve.kv_transfer.grpc_transport import GrpcTransport
from pdserve.kv_transfer.reservations import ReservationTable
from pdserve.kv_transfer.torch_transport import TorchTransport
from pdserve.protos import DEFAULT_KV_TRANSPORT, KV_TRANSPORTS

# name -> implementation, in the order of KV_TRANSPORTS (a unit test holds them equal)
TRANSPORTS: dict[str, type[KVTransport]] = {cls.name: cls for cls in (TorchTransport, GrpcTransport)}


def resolve_transport_name(requested: str) -> str:
    """The transport a request names (its `kv_transport`), DEFAULT_KV_TRANSPORT when it
    names none; ValueError naming the choices for a name not registered."""
    name = requested or DEFAULT_KV_TRANSPORT
    if name not in TRANSPORTS:
        raise ValueError(f"unknown KV transport {name!r}; choose one of {list(KV_TRANSPORTS)}")
    return name


class KVTransports:
    """One worker's instance of every registered transport, by name."""

    def __init__(self, settings: TransportSettings) -> None:
        self._by_name: dict[str, KVTransport] = {name: cls.from_settings(settings) for name, cls in TRANSPORTS.items()}

    @property
    def names(self) -> list[str]:
        """What this worker offers (WorkerInfo.kv_transports)."""
        return list(self._by_name)

    def __getitem__(self, name: str) -> KVTransport:
        """The transport `name` (from `resolve_transport_name`)."""
        return self._by_name[name]

    def listen(self, table: ReservationTable) -> str:
        """Decode side: every transport delivers into `table`; returns the endpoint this worker
        advertises (WorkerInfo.kv_endpoint: the first transport's that has one, else "")."""
        endpoints = [transport.listen(table) for transport in self._by_name.values()]
        return next((endpoint for endpoint in endpoints if endpoint), "")

    def close(self) -> None:
        """Stop every transport (`KVTransport.close`)."""
        for transport in self._by_name.values():
            transport.close()
