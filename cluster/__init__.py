"""pdserve cluster (see shared DESIGN.md)."""
