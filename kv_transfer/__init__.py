"""pdserve kv_transfer (see shared DESIGN.md)."""
