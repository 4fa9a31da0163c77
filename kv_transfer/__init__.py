"""pdserve kv_transfer (see docs/design.md)."""
