"""What the tests and the benchmarks share: tiny random checkpoints (`models`), real worker
processes with gRPC stubs to drive them (`workers`) and loopback Ray nodes (`nodes`).
Installed as `pdserve.testkit` (like Ray's `ray.cluster_utils`), so benchmarks, tests and the
Ray workers they start import it by its installed name; nothing in the product imports it."""
