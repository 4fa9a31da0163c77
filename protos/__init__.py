"""pdserve protos (see shared DESIGN.md)."""
