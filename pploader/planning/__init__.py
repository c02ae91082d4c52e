"""Planning, pure (headers only, no torch.distributed): topology to read plan."""
