"""``dspark_weights: auto``: the trained drafter of this target, from the cache or trained on first use."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

from deepinfer.errors import ConfigError
from deepinfer.interfaces import EngineInfo
from deepinfer_spec_decode.config import SpecDecodeConfig
from deepinfer_spec_decode.drafter_training import Recipe, train_drafter, weights_cache

logger = logging.getLogger(__name__)

# The plugins.spec_decode fields a trained dspark drafter's shape depends on (its recipe records them), and
# those of MoE blocks, recorded only when set (so dense drafters cached before them keep their recipe keys).
ARCHITECTURE_FIELDS = ("max_draft", "dspark_target_layer_ids", "dspark_num_layers", "dspark_context_window",
                       "dspark_num_heads", "dspark_intermediate_size", "dspark_markov_rank", "dspark_noise_token_id")
MOE_FIELDS = ("dspark_n_routed_experts", "dspark_num_experts_per_tok")


def auto_recipe(config: SpecDecodeConfig) -> Recipe:
    """The default recipe for the configured drafter shape, with ``dspark_auto_recipe``'s overrides."""
    fields = ARCHITECTURE_FIELDS + (MOE_FIELDS if config.dspark_n_routed_experts else ())
    drafter = {name: getattr(config, name) for name in fields}
    overrides = dict(config.dspark_auto_recipe or {})
    known = {f.name for f in dataclasses.fields(Recipe)} - {"drafter"}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ConfigError(f"plugins.spec_decode.dspark_auto_recipe: unknown fields {unknown}; allowed: {sorted(known)}")
    return Recipe(drafter=drafter, **overrides)


def train_dspark(model: str, *, output: str | Path | None = None, minutes: float | None = None,
                 device: str | None = None, engine_overrides: dict[str, Any] | None = None,
                 recipe: dict[str, Any] | None = None) -> Path:
    """``deepinfer train-drafter --drafter dspark`` (the ``deepinfer_drafter_trainers`` hook's signature):
    the default recipe for the drafter shape in ``engine_overrides``' ``plugins.spec_decode`` section (or the
    default shape), with ``recipe``'s overrides; without ``output`` the weights go where ``auto`` finds them."""
    overrides = dict(engine_overrides or {})
    plugins = dict(overrides.get("plugins") or {})
    section = dict(plugins.pop("spec_decode", None) or {})  # the target generates without speculation
    section.pop("enabled", None)
    overrides["plugins"] = plugins
    config = SpecDecodeConfig(**{**section, "drafter": "dspark", "dspark_auto_recipe": recipe or None})
    return train_drafter(model, output=output, recipe=auto_recipe(config), minutes=minutes, device=device,
                         engine_overrides=overrides)


def auto_drafter(info: EngineInfo, config: SpecDecodeConfig) -> Path:
    """The cached drafter for ``info.model_path`` and the configured recipe; trains it when missing."""
    if not info.model_path:
        raise ConfigError("plugins.spec_decode.dspark_weights='auto' needs the model folder (EngineInfo.model_path)")
    recipe = auto_recipe(config)
    path = weights_cache(Path(info.model_path), recipe)
    if path.exists():
        return path
    logger.warning("no trained dspark drafter for %s yet: training one (recipe %s, cached at %s); this runs once",
                   info.model_path, recipe.key(), path)
    return train_drafter(info.model_path, output=path, recipe=recipe, device=info.device)
