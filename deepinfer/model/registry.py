"""Model classes by ``config.json`` ``architectures[0]``, collected from every plugin."""

from __future__ import annotations

from collections.abc import Mapping

from deepinfer.errors import ConfigError


def resolve_architecture(hf_config: Mapping, architectures: Mapping[str, type], where: str) -> type:
    """The model class for ``hf_config``; unknown architectures list the supported ones."""
    archs = hf_config.get("architectures") or []
    if not archs:
        raise ConfigError(f"{where}/config.json has no 'architectures' entry")
    arch = archs[0]
    if arch not in architectures:
        raise ConfigError(
            f"{where}: architecture {arch!r} is not supported (supported: {', '.join(sorted(architectures))})"
        )
    return architectures[arch]
