"""Host plumbing: CPUs and their features, GPUs, the C allocator, the event loop."""
