"""Counter-based randomness: every draw is a pure function of (seed, position, purpose).

No generator state is carried between steps, so a seeded request samples the same tokens alone or
in any batch, in any row order, under any executor (ARCHITECTURE §8). The mixer is SplitMix64,
written with wrapping int64 tensor arithmetic so it runs on any device without a host round-trip.
"""

from __future__ import annotations

from enum import IntEnum

import torch

_GOLDEN = 0x9E3779B97F4A7C15
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB
_MASK64 = (1 << 64) - 1


class Purpose(IntEnum):
    """What a draw is for; distinct purposes at one position give independent streams."""

    SAMPLE = 0
    RESAMPLE = 1
    ACCEPT = 2
    DRAFT = 3


def _signed(value: int) -> int:
    value &= _MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


def seed_lane(seed: int) -> int:
    """The int64 lane value of a request seed in [−2^63, 2^64): the same 64 bits, read as two's complement.

    The reference's ``seq_seed`` is a uint64; tensors here are int64, and a uint64 seed ≥ 2^63 does
    not fit one. Its bit pattern does, and the mixer's wrapping arithmetic only sees bits, so seed
    ``s`` and ``s − 2^64`` give the same draws."""
    return _signed(seed)


def _shr(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 lanes (``>>`` on int64 is arithmetic)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def splitmix64(x: torch.Tensor) -> torch.Tensor:
    """The SplitMix64 finalizer on int64 lanes (two's-complement wrap-around)."""
    z = x + _signed(_GOLDEN)
    z = (z ^ _shr(z, 30)) * _signed(_MIX1)
    z = (z ^ _shr(z, 27)) * _signed(_MIX2)
    return z ^ _shr(z, 31)


def splitmix64_int(x: int) -> int:
    """Python-int twin of :func:`splitmix64` (unsigned result), for tests and host-side keys."""
    z = (x + _GOLDEN) & _MASK64
    z = ((z ^ (z >> 30)) * _MIX1) & _MASK64
    z = ((z ^ (z >> 27)) * _MIX2) & _MASK64
    return z ^ (z >> 31)


def uniform(seeds: torch.Tensor, positions: torch.Tensor, purpose: Purpose) -> torch.Tensor:
    """Uniform float64 draws in [0, 1), one per lane, from int64 ``seeds`` and ``positions``.

    The key is ``mix(mix(seed) + 4·position + purpose)``; the top 53 bits become the fraction.
    """
    key = splitmix64(splitmix64(seeds.to(torch.int64)) + positions.to(torch.int64) * 4 + int(purpose))
    return _shr(key, 11).to(torch.float64) * (1.0 / (1 << 53))


def derive_seed(engine_seed: int, counter: int) -> int:
    """A request seed for requests without their own: a pure function of the engine seed and the
    request's arrival counter (signed int64)."""
    return _signed(splitmix64_int(splitmix64_int(engine_seed & _MASK64) ^ counter))
