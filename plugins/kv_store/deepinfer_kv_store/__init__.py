"""deepinfer-kv-store: the ``host`` and ``disk`` KV stores (``cache.kv_store``; issue 34)."""
