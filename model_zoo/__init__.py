"""Per-architecture model patches, one module per family, each a plugin of its own."""
