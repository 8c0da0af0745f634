"""deepinfer: an LLM inference engine for DeepSeek-style MoE and Llama-family models.

A thin, kernel-free core exposing pluggy hooks; every optimization is a plugin package.
"""

from deepinfer.config import EngineConfig
from deepinfer.entrypoints.llm import LLM
from deepinfer.hookspecs import hookimpl
from deepinfer.outputs import CompletionOutput, RequestOutput
from deepinfer.sampling.params import SamplingParams

__all__ = ["LLM", "CompletionOutput", "EngineConfig", "RequestOutput", "SamplingParams", "hookimpl"]
__version__ = "0.1.0"
