"""Wire formats of every RPC between pdserve processes (see pdserve.proto).

The generated modules are committed (regenerate with `make protos`; protos/build.py says
how, and the test suite checks they match the .proto). Importing this package only imports.
"""

from pdserve.protos import pdserve_pb2, pdserve_pb2_grpc

# The KV transports a request's `kv_transport` field may name, declared once for every layer
# (the router cannot import kv_transfer, which loads torch); the first is the default.
# kv_transfer's registry maps each name to its implementation.
KV_TRANSPORTS = ("torch", "grpc")
DEFAULT_KV_TRANSPORT = KV_TRANSPORTS[0]

__all__ = ["DEFAULT_KV_TRANSPORT", "KV_TRANSPORTS", "pdserve_pb2", "pdserve_pb2_grpc"]
