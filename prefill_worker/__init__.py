"""pdserve prefill_worker (see docs/design.md)."""
