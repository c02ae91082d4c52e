"""Reading a plan's bytes into tensors behind one seam: the ``ReadBackend`` protocol and the
shared materialise step (backend.py), the one place that picks a backend (registry.py), and the
backends (read.py: threaded CPU, device.py: pinned CUDA, buffered.py: plain read())."""
