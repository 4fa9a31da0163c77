"""pdserve router (see docs/design.md)."""
