"""pdserve decode_worker (see docs/design.md)."""
