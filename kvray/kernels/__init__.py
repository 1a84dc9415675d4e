"""Hot ops. Each has a plain PyTorch reference (the CPU path and the ground truth in tests)."""
