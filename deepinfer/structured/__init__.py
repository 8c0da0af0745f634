"""Structured output: grammar specs, background compilation, per-request matchers and step bitmasks.

Only ``spec`` is imported here (``SamplingParams`` validates with it); ``grammar`` (xgrammar),
``masks`` and ``runtime`` are imported by the engine where they are used, so a process that never
sees a structured request never imports xgrammar.
"""

from deepinfer.structured.spec import GrammarSpec, parse_spec

__all__ = ["GrammarSpec", "parse_spec"]
