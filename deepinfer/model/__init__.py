"""Model definitions in plain PyTorch, their registry, weight loading and the step runner."""
