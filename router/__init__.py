"""pdserve router (see shared DESIGN.md)."""
