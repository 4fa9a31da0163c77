"""pdserve decode_worker (see shared DESIGN.md)."""
