"""Binding streamed tensors into a model's own storage; reload, layerwise loading."""
