"""What the tests and the benchmarks share: tiny random checkpoints (`models`) and real
worker processes with gRPC stubs to drive them (`workers`). Not part of the wheel."""
