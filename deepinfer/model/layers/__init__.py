"""Plain-torch building blocks and the reference backends."""
