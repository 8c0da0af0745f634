"""DeepSeek-V4.1's Engram: an n-gram embedding memory gated into the hyper-connection streams.

As the reference defines it (``v4_modules/engram*.py``, ``hugging_face/config.py``; the hash and gate as
``tile_kernels.torch.engram.engram_hash_ref`` / ``engram_gate_ref`` state them):

- **Tokenizer compression** (``engram_compressed_vocab_size`` set): every id of the model folder's
  tokenizer.json maps to the first id of its key, the single-token text normalized NFKC → NFD → strip
  accents → lowercase → whitespace runs to one space → strip (a lone space stays); a text with U+FFFD
  keys by its raw vocabulary string. The PAD token ``<｜▁pad▁｜>`` must be id 2.
- **N-grams**: token t at position p reads ``c[p − r]`` for ``r = 0 … engram_max_ngram_size − 1``
  (compressed ids; the compressed ``engram_pad_token_id`` before the sequence start, and from the first
  id outside the tokenizer's vocabulary on, looking back).
- **Hash**: per engram layer, odd multipliers ``m_r`` (NumPy ``default_rng(10007 · layer)``, bound
  ``int64_max // vocab // 2``); ``h_n = (c_0·m_0) xor … xor (c_{n−1}·m_{n−1})`` for the n-gram of order n
  (2 … max); head j of order n looks up row ``h_n mod P[n, j] + offset[n, j]`` of the layer's table,
  where the ``P`` are primes after ``engram_vocab_size − 1``, distinct over all layers, orders and heads
  in config order, and the offsets their running sum.
- **Gate**: the ``(max − 1) · engram_n_heads`` rows of ``engram_head_dim`` concatenated → ``wkv`` →
  ``k [hc_mult, H]`` and ``v [H]``; each stream ``x_k += sigmoid(ssqrt(⟨rms(x_k)·q_weight_k, rms(k_k)·
  k_weight_k⟩ / sqrt(H))) · v`` with ``ssqrt(d) = sign(d)·sqrt(max(|d|, 1e-6))``, applied to the streams
  before the layer's attention hyper-connection.

Tables: the reference shards each layer's table rows (padded to a multiple of ``lcm(256,
engram_parallel_size)``) evenly over the engram-parallel group (``engram_parallel_size``, default
``cp · dp``) and fetches rows across ranks by hash (DeepEP's ``EngramBuffer``); tables stay in host
memory unless ``DEEPINFER_ENGRAM_FORCE_GPU_STORAGE``. Here one process holds every row: the table is a
read-only memory map of the checkpoint file (``mmap_safetensor``; pages are read when a step touches
their rows, in the checkpoint's dtype), or, without the model folder, the tensor the loader hands over;
never a parameter, never on the device. Each step gathers only its rows and moves them to the device. With
``load_format=dummy`` a table is computed from the row index instead (``HashedTable``: no memory, the same
rows in every engine of one seed).

Per request, a ring of the last compressed ids (indexed by position, like the attention rings, so a
rollback is the length going back) lives in model-owned int32 state of the request's state slot.
"""

from __future__ import annotations

import json
import math
import warnings
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from torch import nn

from deepinfer.errors import ConfigError
from deepinfer.sampling.rng import splitmix64

_PAD_TOKEN = "<｜▁pad▁｜>"
_CLAMP = 1e-6  # the reference's Engram clamp_value


_NUMPY_OF = {"F32": (np.float32, None), "F16": (np.float16, None), "BF16": (np.uint16, torch.bfloat16),
             "F8_E4M3": (np.uint8, torch.float8_e4m3fn), "I64": (np.int64, None), "I32": (np.int32, None)}


def mmap_safetensor(folder: Path, name: str) -> torch.Tensor | None:
    """Tensor ``name`` of the folder's safetensors files as a read-only memory map (None if absent)."""
    for file in sorted(folder.glob("*.safetensors")):
        with open(file, "rb") as fh:
            size = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(size))
        info = header.get(name)
        if info is None:
            continue
        if info["dtype"] not in _NUMPY_OF:
            raise ValueError(f"weight {name!r}: dtype {info['dtype']} is not supported for an Engram table")
        np_dtype, view = _NUMPY_OF[info["dtype"]]
        start, _ = info["data_offsets"]
        array = np.memmap(file, dtype=np_dtype, mode="r", offset=8 + size + start, shape=tuple(info["shape"]))
        with warnings.catch_warnings():  # read-only by design: the table is never written
            warnings.simplefilter("ignore", UserWarning)
            tensor = torch.from_numpy(array)
        return tensor if view is None else tensor.view(view)
    return None


def next_prime(n: int) -> int:
    """The smallest prime above ``n`` (sympy's ``nextprime``)."""
    candidate = max(n + 1, 2)
    while True:
        if candidate < 4 or (candidate % 2 and all(candidate % f for f in range(3, math.isqrt(candidate) + 1, 2))):
            return candidate
        candidate += 1


def table_primes(layer_ids: Sequence[int], orders: int, heads: int, vocab: int) -> dict[int, list[list[int]]]:
    """``layer → [order][head]`` table sizes: primes after ``vocab − 1``, distinct across every layer,
    order and head in config order (reference ``EngramLayout``)."""
    seen: set[int] = set()
    out: dict[int, list[list[int]]] = {}
    for layer in layer_ids:
        per_order = []
        for _ in range(orders):
            start, sizes = vocab - 1, []
            for _ in range(heads):
                prime = next_prime(start)
                while prime in seen:
                    prime = next_prime(prime)
                seen.add(prime)
                sizes.append(prime)
                start = prime
            per_order.append(sizes)
        out[layer] = per_order
    return out


def hash_multipliers(layer: int, max_ngram: int, vocab: int, seed: int = 0) -> torch.Tensor:
    """The odd int64 multipliers ``[max_ngram]`` of ``layer`` (reference ``NgramHashMapping``)."""
    bound = max(1, (np.iinfo(np.int64).max // vocab) // 2)
    rng = np.random.default_rng(int(seed + 10007 * layer))
    return torch.from_numpy(rng.integers(0, bound, size=(max_ngram,), dtype=np.int64) * 2 + 1)


def compressed_vocabulary(tokenizer_json: Path) -> tuple[list[int], int]:
    """``(old → new id table, number of compressed ids)`` of a tokenizer.json (module docstring)."""
    from tokenizers import Regex, Tokenizer, normalizers

    tok = Tokenizer.from_file(str(tokenizer_json))
    if tok.token_to_id(_PAD_TOKEN) != 2:
        raise ConfigError(f"{str(tokenizer_json)!r}: Engram tokenizer compression needs {_PAD_TOKEN} at id 2")
    sentinel = "\ue000"
    norm = normalizers.Sequence([
        normalizers.NFKC(), normalizers.NFD(), normalizers.StripAccents(), normalizers.Lowercase(),
        normalizers.Replace(Regex(r"[ \t\r\n]+"), " "), normalizers.Replace(Regex(r"^ $"), sentinel),
        normalizers.Strip(), normalizers.Replace(sentinel, " "),
    ])
    keys: dict[str, int] = {}
    table = []
    for token_id in range(tok.get_vocab_size()):
        text = tok.decode([token_id], skip_special_tokens=False)
        key = tok.id_to_token(token_id) if "\ufffd" in text else (norm.normalize_str(text) or text)
        table.append(keys.setdefault(str(key), len(keys)))
    return table, len(keys)


def engram_rows(ngrams: torch.Tensor, multipliers: torch.Tensor, primes: torch.Tensor,
                offsets: torch.Tensor) -> torch.Tensor:
    """Table rows ``[T, (max − 1) · heads]`` of the n-gram ids ``[T, max]`` (``[:, r]`` is r tokens back):
    order n+1's running xor of ``c_r · m_r`` modulo each head's prime, plus the head's offset."""
    prod = ngrams.to(torch.int64) * multipliers.to(ngrams.device)
    hashes = prod[:, 0].clone()
    out = []
    for n in range(1, ngrams.shape[1]):
        hashes = hashes ^ prod[:, n]
        out.append(hashes.unsqueeze(-1) % primes[n - 1].to(torch.int64).to(ngrams.device))
    return torch.cat(out, dim=-1) + offsets.to(ngrams.device)


def engram_gate(streams: torch.Tensor, kv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                eps: float) -> torch.Tensor:
    """``streams [T, m, H]`` gated with ``kv [T, m + 1, H]`` (module docstring), in float32, cast back."""
    m, hidden = streams.shape[1], streams.shape[2]
    x, k, v = streams.float(), kv[:, :m].float(), kv[:, m].float()
    rx = torch.rsqrt(x.square().mean(-1) + eps)
    rk = torch.rsqrt(k.square().mean(-1) + eps)
    dot = (x * q_weight.float() * k * k_weight.float()).sum(-1) * rx * rk * hidden ** -0.5
    gate = torch.sigmoid(dot.abs().clamp_min(_CLAMP).sqrt() * dot.sign())
    return (x + gate.unsqueeze(-1) * v.unsqueeze(1)).to(streams.dtype)


class HashedTable:
    """An Engram table for ``load_format=dummy`` whose rows are computed from their index, not stored (a
    V4.1-Flash-sized table is gigabytes): entry (row, column) is uniform in ``[−√3·std, √3·std)`` (standard
    deviation ``std``) from ``splitmix64`` of (seed, layer, row, column). It answers the one call a layer makes,
    ``index_select(0, rows)``, on ``device``."""

    def __init__(self, seed: int, layer: int, width: int, std: float, dtype: torch.dtype, device: torch.device) -> None:
        self.key = int(splitmix64(torch.tensor([seed * 1_000_003 + layer], dtype=torch.int64))[0])
        self.width, self.std, self.dtype, self.device = width, std, dtype, device

    def index_select(self, dim: int, rows: torch.Tensor) -> torch.Tensor:
        assert dim == 0
        cols = torch.arange(self.width, device=rows.device)
        bits = splitmix64(rows.to(torch.int64).unsqueeze(1) * self.width + cols + self.key) & ((1 << 53) - 1)
        uniform = bits.to(torch.float64) / float(1 << 53)
        return ((uniform * 2 - 1) * (3 ** 0.5) * self.std).to(self.dtype)


class EngramLayer(nn.Module):
    """One engram layer's weights (``q_weight``, ``k_weight``, ``wkv``) and its host table (``table``,
    ``[rows ≥ Σ primes, head_dim]``, filled by ``load_weights``)."""

    def __init__(self, layer: int, hidden: int, hc_mult: int, primes: list[list[int]], head_dim: int,
                 multipliers: torch.Tensor, eps: float, dtype: torch.dtype, device: torch.device | None) -> None:
        super().__init__()
        self.layer, self.eps, self.head_dim = layer, eps, head_dim
        flat = [p for order in primes for p in order]
        self.rows = sum(flat)
        width = len(flat) * head_dim
        self.q_weight = nn.Parameter(torch.empty(hc_mult, hidden, dtype=dtype, device=device))
        self.k_weight = nn.Parameter(torch.empty(hc_mult, hidden, dtype=dtype, device=device))
        self.wkv_weight = nn.Parameter(torch.empty((hc_mult + 1) * hidden, width, dtype=dtype, device=device))
        self.register_buffer("multipliers", multipliers.clone(), persistent=False)
        self.register_buffer("primes", torch.tensor(primes, dtype=torch.int64), persistent=False)
        offsets = torch.tensor([0, *flat[:-1]], dtype=torch.int64).cumsum(0)
        self.register_buffer("offsets", offsets, persistent=False)
        self.table: torch.Tensor | HashedTable | None = None  # host rows; not a parameter (never copied to the device)

    def set_table(self, table: torch.Tensor) -> None:
        """Keep the checkpoint's table (``[rows, head_dim]``, rows ≥ Σ primes: padding rows allowed)."""
        if table.dim() != 2 or table.shape[1] != self.head_dim or table.shape[0] < self.rows:
            raise ValueError(f"weight 'layers.{self.layer}.engram.embed.weight' has shape {tuple(table.shape)}, "
                             f"expected [≥ {self.rows}, {self.head_dim}]")
        self.table = table

    def fill_dummy(self, seed: int, std: float) -> None:
        """``load_format=dummy`` (``loader.init_dummy``): a table computed from the row index (``HashedTable``)."""
        self.table = HashedTable(seed, self.layer, self.head_dim, std, self.wkv_weight.dtype, self.wkv_weight.device)

    def forward(self, streams: torch.Tensor, ngrams: torch.Tensor, ctx_linear: object) -> torch.Tensor:
        """``streams [T, m, H]`` after the gate, for the n-gram ids ``ngrams [T, max]``."""
        assert self.table is not None, f"layer {self.layer}: no Engram table (the checkpoint's, or a dummy one)"
        rows = engram_rows(ngrams, self.multipliers, self.primes, self.offsets)
        # Host gather of this step's rows only (the table stays where the checkpoint put it).
        embeds = self.table.index_select(0, rows.flatten().to(self.table.device))
        embeds = embeds.to(device=streams.device, dtype=self.wkv_weight.dtype).view(rows.shape[0], -1)
        kv = ctx_linear.linear(embeds, self.wkv_weight).view(streams.shape[0], streams.shape[1] + 1, -1)
        return engram_gate(streams, kv, self.q_weight, self.k_weight, self.eps)


class NgramHistory:
    """Per state slot, the compressed ids of the last positions (``size`` of them, by position) and the
    step's n-gram ids. ``lookup`` maps token ids to compressed ids (None: identity)."""

    def __init__(self, max_ngram: int, pad: int, lookup: torch.Tensor | None) -> None:
        self.n, self.pad, self.lookup = max_ngram, pad, lookup
        self.ring: torch.Tensor | None = None

    def bind(self, num_slots: int, max_backtrack: int, device: torch.device) -> None:
        """Allocate the ring: ``max_ngram − 1`` positions of history plus the rollback margin."""
        self.ring = torch.full((num_slots, self.n + max_backtrack), self.pad, dtype=torch.int64, device=device)
        if self.lookup is not None:
            self.lookup = self.lookup.to(device)

    def ngrams(self, input_ids: torch.Tensor, segments: Sequence[object]) -> torch.Tensor:
        """``[T, max_ngram]`` ids (``[:, r]``: r tokens back; pad before position 0) of this step's tokens,
        request by request (``_Segment``s); then the step's last ids go into each request's ring."""
        assert self.ring is not None, "Engram history not bound"
        comp = self._compressed(input_ids)
        size, dev = self.ring.shape[1], input_ids.device
        out = torch.empty(input_ids.shape[0], self.n, dtype=torch.int64, device=dev)
        back = self.n - 1
        for s in segments:
            lo, hi, start, end, slot = s.lo, s.hi, s.start, s.end, s.slot  # type: ignore[attr-defined]
            hist_pos = torch.arange(start - back, start, device=dev)
            hist = torch.where(hist_pos >= 0, self.ring[slot, hist_pos % size], self.pad)
            seq = torch.cat([hist, comp[lo:hi]])
            out[lo:hi] = seq.unfold(0, self.n, 1).flip(-1)
            keep = min(hi - lo, size)
            pos = torch.arange(end - keep, end, device=dev)
            self.ring[slot, pos % size] = comp[hi - keep:hi]
        return self._cut_at_sentinels(out)

    def ngrams_on_device(self, input_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """``ngrams`` from device tensors only (each token's position and state slot; no host list, so a CUDA
        graph captures it), for steps of at most ``max_backtrack + 1`` tokens per request: every token's id
        goes into its slot's ring first — such a step overwrites only positions older than any of its
        n-grams reads (the ring holds ``max_ngram + max_backtrack`` positions) — then each token reads its
        ``max_ngram − 1`` predecessors there. Equal to the per-request path."""
        assert self.ring is not None, "Engram history not bound"
        size = self.ring.shape[1]
        flat = self.ring.view(-1)
        flat.index_copy_(0, slots * size + positions % size, self._compressed(input_ids))
        back = positions.unsqueeze(1) - torch.arange(self.n, device=positions.device)  # [T, max_ngram]
        out = flat[slots.unsqueeze(1) * size + back % size]
        return self._cut_at_sentinels(torch.where(back >= 0, out, self.pad))

    def _compressed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """int64 compressed ids; ids past the tokenizer's vocabulary are the reference's sentinel −1."""
        comp = input_ids.to(torch.int64)
        if self.lookup is None:
            return comp
        known = comp < self.lookup.shape[0]
        return torch.where(known, self.lookup[comp.clamp(max=self.lookup.shape[0] - 1)], -1)

    def _cut_at_sentinels(self, out: torch.Tensor) -> torch.Tensor:
        """Looking back past a sentinel reads pad, at that distance and every longer one (reference
        ``gather_engram_tokens_zos``)."""
        return out.masked_fill((out < 0).cumsum(dim=-1) > 0, self.pad)


def read_tokenizer_lookup(folder: Path, compressed_size: int) -> torch.Tensor:
    """The compressed-id table of the model folder's tokenizer.json, checked against
    ``engram_compressed_vocab_size``."""
    path = folder / "tokenizer.json"
    if not path.exists():
        raise ConfigError(f"config.json engram_compressed_vocab_size: Engram's tokenizer compression needs the model "
                          f"folder's tokenizer.json ({str(path)!r} is missing)")
    table, size = compressed_vocabulary(path)
    if size != compressed_size:
        raise ConfigError(f"config.json engram_compressed_vocab_size={compressed_size}, but {str(path)!r} compresses "
                          f"to {size} ids")
    return torch.tensor(table, dtype=torch.int64)
