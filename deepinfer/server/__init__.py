"""``deepinfer serve``: an OpenAI-compatible HTTP server on ``AsyncLLM`` (needs the ``serve`` extra)."""
