"""How pdserve processes call each other, beyond the wire format (`protos`): the gRPC channel and
server settings both ends share (`channel`), who may call (`security`: the cluster token and
TLS), and the trace context a call carries (`tracing`, which also traces the router's HTTP side)."""
