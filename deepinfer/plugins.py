"""The plugin host: discovery through entry points, activation by config, selection by name.

Discovery is not activation: every distribution with an entry point in the group ``deepinfer.plugins``
is *installed*; only the ones whose config section says ``enabled: true`` are built and registered.
The built-in plugin (``deepinfer.defaults``) is always registered, with ``trylast`` hookimpls.
"""

from __future__ import annotations

import importlib.metadata as md
import inspect
import logging
import typing
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import pluggy
from pydantic import BaseModel, ValidationError

from deepinfer import hookspecs
from deepinfer.config import ConfigAlias, ModelSection, format_validation_error
from deepinfer.errors import ConfigError, PluginError
from deepinfer.interfaces import Backend, RunRequirements

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "deepinfer.plugins"
BUILTIN = "builtin"


@dataclass
class InstalledPlugin:
    """One entry point of the group, loaded lazily."""

    name: str
    value: str
    distribution: str
    version: str
    entry_point: md.EntryPoint | None = None
    loaded: Any = None
    error: str | None = None

    def load(self) -> Any:
        if self.loaded is None and self.error is None and self.entry_point is not None:
            try:
                self.loaded = self.entry_point.load()
            except Exception as exc:
                self.error = f"{type(exc).__name__}: {exc}"
        return self.loaded


def discover_plugins() -> dict[str, InstalledPlugin]:
    """Every installed plugin by entry-point name (nothing is imported yet)."""
    found: dict[str, InstalledPlugin] = {}
    for ep in md.entry_points(group=ENTRY_POINT_GROUP):
        dist = ep.dist.name if ep.dist is not None else "?"
        version = ep.dist.version if ep.dist is not None else "?"
        if ep.name in found and found[ep.name].value != ep.value:
            raise PluginError(
                f"two installed distributions offer the plugin name {ep.name!r}: "
                f"{found[ep.name].distribution} and {dist}"
            )
        found[ep.name] = InstalledPlugin(ep.name, ep.value, dist, version, ep)
    return found


def _static_offers(installed: Mapping[str, InstalledPlugin], hook: str) -> list[tuple[str, Mapping[str, Any]]]:
    """``(plugin name, what it offers)`` for a hook answered before any plugin is built (a staticmethod)."""
    offers = []
    for plugin in installed.values():
        obj = plugin.load()
        func = getattr(obj, hook, None)
        if func is None:
            continue
        if inspect.isclass(obj) and not isinstance(inspect.getattr_static(obj, func.__name__),
                                                   (staticmethod, classmethod)):
            raise PluginError(f"plugin {plugin.name!r}: {hook} must be a staticmethod")
        offers.append((plugin.name, func()))
    return offers


def config_aliases(installed: Mapping[str, InstalledPlugin]) -> dict[str, ConfigAlias]:
    """Env-name → config-path aliases from every installed plugin (``deepinfer_config_aliases``)."""
    aliases: dict[str, ConfigAlias] = {}
    for _, offered in _static_offers(installed, "deepinfer_config_aliases"):
        aliases.update(offered)
    return aliases


def drafter_trainers(installed: Mapping[str, InstalledPlugin]) -> dict[str, Any]:
    """Drafter name → trainer from every installed plugin (``deepinfer_drafter_trainers``); a name offered
    by two plugins is an error naming both."""
    trainers: dict[str, Any] = {}
    owners: dict[str, str] = {}
    for plugin, offered in _static_offers(installed, "deepinfer_drafter_trainers"):
        for name, trainer in offered.items():
            if name in owners:
                raise PluginError(f"plugins {owners[name]!r} and {plugin!r} both offer a trainer for drafter {name!r}")
            trainers[name], owners[name] = trainer, plugin
    return trainers


def _plugin_hooks(obj: Any) -> list[str]:
    return sorted(n for n in dir(obj) if n.startswith("deepinfer_") and callable(getattr(obj, n, None)))


class UnfitBackend:
    """Stands for an op that no backend can serve in this run but that the model does not call: any
    use raises ``ConfigError`` with ``reason`` (never a silent fallback to a backend that lacks a
    required capability)."""

    def __init__(self, reason: str) -> None:
        self._reason = reason

    def __getattr__(self, name: str) -> Any:
        raise ConfigError(self._reason)


_QUANTIZATIONS = typing.get_args(ModelSection.model_fields["quantization"].annotation)


class _QuantizationCheck:
    """The core's check of ``model.quantization``: a value other than ``none`` must be listed by an
    enabled plugin's ``deepinfer_weight_quantizations`` (the core's own GEMMs compute in the model dtype), so a
    quantized run never silently runs unquantized."""

    def __init__(self, host: PluginHost) -> None:
        self.host = host

    @hookspecs.hookimpl(trylast=True)
    def deepinfer_validate_config(self, config: Any, info: Any) -> None:
        wanted = config.model.quantization
        if wanted == "none":
            return
        served = sorted({q for offer in self.host._call_each("deepinfer_weight_quantizations") for q in offer.value})
        if wanted not in served:
            hint = self.host._disabled_offering("deepinfer_weight_quantizations", lambda value: wanted in (value or ()))
            raise ConfigError(f"model.quantization: {wanted!r} is served by no enabled plugin (served: "
                              f"{served or 'none'}; allowed values: {', '.join(_QUANTIZATIONS)}){hint}")


@dataclass
class _Offer:
    plugin: str
    value: Any


@dataclass
class PluginHost:
    """Holds the pluggy manager with the built-in and the enabled plugins, and selects strategies."""

    plugin_configs: Mapping[str, Mapping[str, Any]]
    installed: dict[str, InstalledPlugin] = field(default_factory=discover_plugins)
    extra: Iterable[tuple[str, Any]] = ()

    def __post_init__(self) -> None:
        from deepinfer.defaults import BuiltinPlugin

        self.pm = pluggy.PluginManager(hookspecs.PROJECT)
        self.pm.add_hookspecs(hookspecs)
        self.pm.register(BuiltinPlugin(), name=BUILTIN)
        self.pm.register(_QuantizationCheck(self), name=f"{BUILTIN}-quantization")
        self.enabled: dict[str, Any] = {}
        self.disabled: dict[str, Any] = {}  # built (config validated) but not registered
        unknown = sorted(set(self.plugin_configs) - set(self.installed))
        if unknown:
            names = ", ".join(sorted(self.installed)) or "none"
            raise ConfigError(f"plugins.{unknown[0]}: no such plugin is installed (installed: {names})")
        for name, plugin in sorted(self.installed.items()):
            section = dict(self.plugin_configs.get(name, {}))
            enabled = bool(section.pop("enabled", False))
            obj = plugin.load()
            if obj is None:
                if enabled:
                    raise PluginError(f"plugin {name!r} ({plugin.distribution}) failed to import: {plugin.error}")
                logger.warning("plugin %r (%s) failed to import: %s", name, plugin.distribution, plugin.error)
                continue
            instance = self._build(name, obj, section)
            if enabled:
                self.pm.register(instance, name=name)
                self.enabled[name] = instance
            else:
                self.disabled[name] = instance
        for name, obj in self.extra:
            self.pm.register(obj, name=name)
            self.enabled[name] = obj

    @staticmethod
    def _build(name: str, obj: Any, section: dict[str, Any]) -> Any:
        """Validate ``plugins.<name>`` with the plugin's ``config_model`` and build the instance."""
        if not inspect.isclass(obj):
            if section:
                raise ConfigError(f"plugins.{name}.{next(iter(section))}: plugin {name!r} takes no settings")
            return obj
        model: type[BaseModel] | None = getattr(obj, "config_model", None)
        if model is None:
            if section:
                raise ConfigError(f"plugins.{name}.{next(iter(section))}: plugin {name!r} takes no settings")
            return obj()
        try:
            config = model.model_validate(section)
        except ValidationError as exc:
            raise ConfigError(f"plugin {name!r}: " + format_validation_error(exc, f"plugins.{name}.", model)) from None
        try:
            return obj(config)
        except ConfigError:
            raise
        except Exception as exc:
            raise PluginError(f"plugin {name!r} failed to start: {type(exc).__name__}: {exc}") from exc

    # ------------------------------------------------------------------------------------- offers

    def _call_each(self, hook_name: str, **kwargs: Any) -> list[_Offer]:
        """Call ``hook_name`` on every registered plugin separately, remembering who answered."""
        offers = []
        for impl in getattr(self.pm.hook, hook_name).get_hookimpls():
            try:
                value = impl.function(**kwargs)
            except (ConfigError, PluginError):
                raise
            except Exception as exc:
                raise PluginError(
                    f"plugin {impl.plugin_name!r} raised in {hook_name}: {type(exc).__name__}: {exc}"
                ) from exc
            if value is not None:
                offers.append(_Offer(impl.plugin_name, value))
        return offers

    def _disabled_offering(self, hook_name: str, offers: Callable[[Any], bool]) -> str:
        """A hint naming the installed but disabled plugins whose ``hook_name`` answer satisfies
        ``offers`` (API.md §2: an unknown name lists the plugin that would provide it)."""
        names = []
        for name, instance in sorted(self.disabled.items()):
            func = getattr(instance, hook_name, None)
            if not callable(func):
                continue
            try:
                if offers(func()):
                    names.append(name)
            except Exception:  # a hint only; the plugin is not active
                continue
        if not names:
            return ""
        return "; provided by installed but disabled plugin " + ", ".join(
            f"{n!r} (set plugins.{n}.enabled=true)" for n in names)

    def named_offers(self, hook_name: str) -> dict[str, _Offer]:
        """All strategies a provider hook offers, by name; a name offered twice is an error."""
        table: dict[str, _Offer] = {}
        for offer in self._call_each(hook_name):
            for key, value in offer.value.items():
                if key in table:
                    raise ConfigError(
                        f"{hook_name}: the name {key!r} is offered by both plugin "
                        f"{table[key].plugin!r} and plugin {offer.plugin!r}; disable one of them"
                    )
                table[key] = _Offer(offer.plugin, value)
        return table

    def select(self, hook_name: str, chosen: str, config_path: str) -> Any:
        """The strategy named ``chosen`` (``auto``: an enabled plugin's single offer, else the
        built-in's). Unknown names list what is offered and by whom."""
        table = self.named_offers(hook_name)
        if chosen == "auto":
            foreign = sorted(k for k, o in table.items() if o.plugin != BUILTIN)
            if len(foreign) > 1:
                raise ConfigError(f"{config_path}: auto is ambiguous, plugins offer {foreign}; name one")
            if foreign:
                return table[foreign[0]].value
            builtin = [k for k, o in table.items() if o.plugin == BUILTIN]
            return table[builtin[0]].value
        if chosen not in table:
            offered = ", ".join(f"{k} (plugin {o.plugin})" for k, o in sorted(table.items())) or "none"
            hint = self._disabled_offering(hook_name, lambda value: chosen in (value or {}))
            raise ConfigError(f"{config_path}: unknown name {chosen!r}; offered: {offered}{hint}")
        return table[chosen].value

    def check_kv_store(self, chosen: str | None) -> None:
        """Refuse, at start-up, a ``cache.kv_store`` that names a store no enabled plugin offers (the error
        lists the offered stores and a disabled plugin that offers it). ``chosen`` is one name or a chain
        joined by ``+`` (``host+disk``, fastest first); None: no external tier."""
        self.kv_store_factories(chosen)

    def kv_store_factories(self, chosen: str | None) -> list[Any]:
        """The factories (``interfaces.KVStoreFactory``) of the chain ``cache.kv_store`` names, fastest
        first; empty when unset. Unknown, empty or repeated names are a ``ConfigError``."""
        if chosen is None:
            return []
        names = [name.strip() for name in chosen.split("+")]
        table = self.named_offers("deepinfer_kv_stores")
        offered = ", ".join(f"{k} (plugin {o.plugin})" for k, o in sorted(table.items())) or "none"
        if any(not name for name in names) or len(set(names)) != len(names):
            raise ConfigError(f"cache.kv_store: {chosen!r} must be store names joined by '+', each once "
                              f"(e.g. 'host+disk'); offered: {offered}")
        for name in names:
            if name not in table:
                hint = self._disabled_offering("deepinfer_kv_stores", lambda value, n=name: n in (value or {}))
                raise ConfigError(f"cache.kv_store: unknown store {name!r}; offered: {offered}{hint}. "
                                  "Enable the plugin that offers it or leave cache.kv_store unset")
        return [table[name].value for name in names]

    def select_backends(self, hook_name: str, chosen: str, config_path: str,
                        req: RunRequirements, required: frozenset[str] | None = None) -> dict[str, Backend]:
        """Per op, the backend to use: ``chosen`` for the ops it implements (error if it cannot serve
        the run), and for the other ops the highest-priority available backend that fits.

        ``required``: the ops the model calls (``backend_ops`` of the model class; None = every op).
        An op outside it with no fitting backend (e.g. another model family's attention under
        ``kernels.batch_invariant``) gets an ``UnfitBackend`` that raises, naming the gap, if ever used."""
        backends: list[Backend] = [b for offer in self._call_each(hook_name) for b in offer.value]
        names = [b.name for b in backends]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ConfigError(f"{hook_name}: backend name {dupes[0]!r} is offered twice")
        selected: dict[str, Backend] = {}
        if chosen != "auto":
            by_name = {b.name: b for b in backends}
            if chosen not in by_name:
                hint = self._disabled_offering(
                    hook_name, lambda value: any(getattr(b, "name", None) == chosen for b in value or ()))
                raise ConfigError(f"{config_path}: unknown backend {chosen!r}; offered: {sorted(by_name)}{hint}")
            backend = by_name[chosen]
            if not backend.available():
                raise ConfigError(f"{config_path}: backend {chosen!r} is not available on this machine")
            gaps = req.missing(backend.capabilities)
            if gaps:
                raise ConfigError(f"{config_path}: backend {chosen!r} lacks {', '.join(gaps)} for this run")
            selected = dict.fromkeys(backend.ops, backend)
        for op in sorted({op for b in backends for op in b.ops} - set(selected)):
            fitting = [b for b in backends if op in b.ops and b.available() and not req.missing(b.capabilities)]
            if not fitting and required is not None and op not in required:
                selected[op] = UnfitBackend(f"{config_path}: no backend for op {op!r} fits this run ({req})")
                continue
            if not fitting:
                raise ConfigError(f"{config_path}: no backend for op {op!r} fits this run ({req})")
            selected[op] = max(fitting, key=lambda b: b.priority)
        return selected

    # ------------------------------------------------------------------------------------- observers

    def notify(self, hook_name: str, **kwargs: Any) -> None:
        """Call an observer hook on every plugin; a plugin that raises is reported by name."""
        self._call_each(hook_name, **kwargs)

    def has_observers(self, hook_name: str) -> bool:
        return bool(getattr(self.pm.hook, hook_name).get_hookimpls())

    def plugin_stats(self) -> dict[str, dict[str, Any]]:
        """``deepinfer_stats`` of each enabled plugin, by plugin name."""
        return {o.plugin: dict(o.value) for o in self._call_each("deepinfer_stats") if o.plugin != BUILTIN}

    def describe(self) -> list[dict[str, Any]]:
        """Rows for ``deepinfer plugins``: name, distribution, version, enabled, hooks, error."""
        rows = []
        for name, plugin in sorted(self.installed.items()):
            obj = plugin.load()
            rows.append({
                "name": name,
                "distribution": plugin.distribution,
                "version": plugin.version,
                "enabled": name in self.enabled,
                "hooks": _plugin_hooks(obj) if obj is not None else [],
                "error": plugin.error,
            })
        return rows

