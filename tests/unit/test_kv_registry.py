"""The KV transport registry: keyed on the names pdserve.protos declares, a request's name
resolved once (the default when it gives none), and each transport's leg contract."""

import asyncio

import pytest

from pdserve.kv_transfer.base import TransportSettings
from pdserve.kv_transfer.grpc_transport import GrpcStreamSender, GrpcTransport
from pdserve.kv_transfer.layout import KVLayout
from pdserve.kv_transfer.registry import TRANSPORTS, KVTransports, resolve_transport_name
from pdserve.kv_transfer.torch_transport import TorchTransport
from pdserve.protos import DEFAULT_KV_TRANSPORT, KV_TRANSPORTS

LAYOUT = KVLayout(num_layers=2, block_size=4, num_kv_heads=2, head_dim=8, dtype="float32")
SETTINGS = TransportSettings("w1", LAYOUT, "cpu", max_piece_tokens=16)


def test_the_registry_is_keyed_on_the_declared_names():
    assert tuple(TRANSPORTS) == KV_TRANSPORTS
    assert all(cls.name == name for name, cls in TRANSPORTS.items())


def test_a_request_without_a_transport_gets_the_default_and_an_unknown_one_is_refused():
    assert resolve_transport_name("") == DEFAULT_KV_TRANSPORT
    assert [resolve_transport_name(name) for name in KV_TRANSPORTS] == list(KV_TRANSPORTS)
    with pytest.raises(ValueError, match="unknown KV transport 'rdma'"):
        resolve_transport_name("rdma")


def test_a_worker_holds_one_of_every_transport():
    transports = KVTransports(SETTINGS)
    try:
        assert transports.names == list(KV_TRANSPORTS)
        assert isinstance(transports["torch"], TorchTransport) and isinstance(transports["grpc"], GrpcTransport)
    finally:
        transports.close()


def test_torch_legs_need_an_endpoint_and_only_their_peer_writes():
    torch_transport = TorchTransport.from_settings(SETTINGS)
    with pytest.raises(ValueError, match="kv_endpoint is required"):
        torch_transport.check_endpoint("")
    torch_transport.check_endpoint("127.0.0.1:1/p?piece_tokens=16")
    assert torch_transport.writer_for("prefill-1") == "prefill-1"


def test_grpc_legs_ride_their_stream():
    grpc_transport = GrpcTransport.from_settings(SETTINGS)
    grpc_transport.check_endpoint("")
    assert grpc_transport.writer_for("prefill-1") == "" and grpc_transport.endpoint_for("prefill-1") == ""

    async def open_and_finish():
        sender = await grpc_transport.open_sender("")
        sender.finish()
        return sender, [message async for message in sender.messages()]

    sender, messages = asyncio.run(open_and_finish())
    assert isinstance(sender, GrpcStreamSender) and messages == []
