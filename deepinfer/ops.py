"""The core's reference ops that plugins may reuse: public, and stable within a minor version.

A plugin imports from the core only ``deepinfer`` (``hookimpl``, ``LLM``, ``SamplingParams``),
``deepinfer.interfaces``, ``deepinfer.hookspecs``, ``deepinfer.outputs``, ``deepinfer.errors``,
``deepinfer.config``, this module and ``deepinfer.testing`` (``tests/test_public_surface.py`` walks every
plugin package's imports). The names below are what a kernel backend or a drafter legitimately shares
with the core, because it must compute *the same thing*: a kernel falls back to, and is tested against,
the reference it replaces; a cache write must leave the bytes the core's reads expect; a draft must use
the same counter-based randomness as the sampler so seeded runs stay reproducible.

Where each one lives inside the core (``model/layers/``, ``kv/``, ``sampling/``, ``defaults.py``) is not
part of the contract and may change; these names, their signatures and their behaviour do not change
within a minor version (0.1.x). Each keeps its docstring where it is defined.

Reference backends (plain torch, correct on CPU and GPU; the ops they implement are in their ``ops``):
    ``TorchAttentionBackend`` (``paged_attention``), ``TorchMLABackend`` (``mla_attention``),
    ``TorchSinkAttentionBackend`` (DeepSeek-V4 ``sink_attention`` / ``indexer_topk``), ``TorchMoEBackend``
    (``experts``). ``row_block(per_row)``: the query rows per block the V4 reference scores at once, so a
    kernel bounds its temporaries the same way.
KV writes (the paged cache layouts of ``kv/specs.py``, bf16 or FP8):
    ``write_kv(k, v, kv_cache, slot_mapping)`` for GQA caches, ``write_latent(latent, k_pe, cache,
    slot_mapping)`` for MLA caches; ``ALL_KV_DTYPES``: the ``cache.kv_dtype`` values of GQA/MLA caches a
    backend can declare (DeepSeek-V4.1's ``fp4`` is read by ``TorchSinkAttentionBackend`` alone, ``kv/v41_cache.py``).
FP8 packing: ``fp8``, the FP8 KV-cache format module (e4m3 data, one UE8M0 scale byte per 32 elements:
    ``quantize``, ``dequantize``, ``store``, ``gather``, ``roundtrip``, ``num_groups``, ``scale_values``
    and the format's constants ``FP8_DTYPE``, ``FP8_MAX``, ``GROUP``, ``E8M0_BIAS``, ``MIN_AMAX``).
Layers and weights: ``RMSNorm`` (the core's norm, statistics in float32); ``init_dummy(module, seed)``,
    the seeded random weights of ``model.load_format: dummy``; ``dequantize_e2m1(packed, scales, block)``, the
    FP4 (e2m1 with ue8m0 or e4m3 scales) dequantization a kernel reading ``Fp4ExpertWeights`` must equal.
Randomness and draft choice: ``uniform(seeds, positions, purpose)`` and ``Purpose``, the counter-based
    draws of ``sampling/rng.py``; ``inverse_cdf(probs, u)``, the sampler's choice of a token from one
    uniform per row; ``row_argmax(x)``, the sampler's greedy choice (``argmax`` over the last dimension).
Statistics: ``pool_adjacent_violators(values, weights)``, the isotonic fit the core's step-cost curve
    uses, for calibrations that must be monotone the same way.
Strategies: ``ExactReplayPlanner``, the built-in ``exact`` replay planner, for a planner that restores
    exactly in some cases and bounds the replay in others.
Transfers: ``to_device(values, dtype, device)``, host lists to a tensor on the device without waiting for
    it (on CUDA through pinned memory and a non-blocking copy): what a backend's launch path uses for index
    tensors it builds on the host, so the overlapped executor's sync guard holds.
Files: ``cache_dir()``, the project's cache root (``$DEEPINFER_CACHE_DIR``, else the XDG cache), where a
    plugin keeps what it builds or trains once per machine (compiled kernels, drafters).
"""

from __future__ import annotations

from deepinfer.defaults import ExactReplayPlanner
from deepinfer.isotonic import pool_adjacent_violators
from deepinfer.kv import fp8
from deepinfer.model.assets import cache_dir
from deepinfer.model.layers.fp4 import dequantize_e2m1
from deepinfer.model.layers.norm import RMSNorm
from deepinfer.model.layers.reference import ALL_KV_DTYPES, TorchAttentionBackend, write_kv
from deepinfer.model.layers.reference_deepseek import TorchMLABackend, TorchMoEBackend, write_latent
from deepinfer.model.layers.reference_deepseek_v4 import TorchSinkAttentionBackend, row_block
from deepinfer.model.loader import init_dummy
from deepinfer.model.transfer import to_device
from deepinfer.sampling.rng import Purpose, uniform
from deepinfer.sampling.sampler import inverse_cdf, row_argmax

__all__ = [
    "ALL_KV_DTYPES",
    "ExactReplayPlanner",
    "Purpose",
    "RMSNorm",
    "TorchAttentionBackend",
    "TorchMLABackend",
    "TorchMoEBackend",
    "TorchSinkAttentionBackend",
    "cache_dir",
    "dequantize_e2m1",
    "fp8",
    "init_dummy",
    "inverse_cdf",
    "pool_adjacent_violators",
    "row_argmax",
    "row_block",
    "to_device",
    "uniform",
    "write_kv",
    "write_latent",
]
