"""The KV cache: per-layer cache specs, the block allocator with prefix caching, device pools."""
