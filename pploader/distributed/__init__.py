"""Process-group start-up and every torch.distributed collective."""
