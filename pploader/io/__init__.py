"""Reading a plan's bytes into tensors: CPU reader, direct-to-GPU loader, page cache."""
