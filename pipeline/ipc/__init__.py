"""Transport: shared-memory rings, broadcast ring, layer signal, naming and lifetime."""
