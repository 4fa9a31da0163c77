"""pdserve prefill_worker (see shared DESIGN.md)."""
