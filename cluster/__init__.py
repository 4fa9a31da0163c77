"""pdserve cluster (see docs/design.md)."""
