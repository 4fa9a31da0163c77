"""What the prefill and decode worker processes share beyond the engine: their settings
(`config`), process bootstrap and gRPC server (`server`), and the gRPC service base with
the engine driver, KV transport, draining and Info/Stats (`service`)."""
