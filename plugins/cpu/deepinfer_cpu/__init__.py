"""deepinfer-cpu: CPU kernels for deepinfer (README.md)."""
