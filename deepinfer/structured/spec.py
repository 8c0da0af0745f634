"""What a request asks the grammar to enforce (API.md §4 ``structured`` / ``so_args``).

This module checks the *form* of the request at ``SamplingParams`` construction (exactly one kind, the
right types) and turns either form into one ``GrammarSpec``. It never imports xgrammar: whether the
schema itself is valid is the compiler's call, and a schema that fails to compile finishes only its
own request with ``finish_reason="error"``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, Literal

GrammarKind = Literal["json", "regex", "ebnf", "choice"]

# ``structured`` keys → the spec kind; ``so_args["schema_type"]`` values → the spec kind.
_STRUCTURED_KEYS: dict[str, GrammarKind] = {"json_schema": "json", "regex": "regex", "ebnf": "ebnf",
                                             "choice": "choice"}
_SO_SCHEMA_TYPES: dict[str, GrammarKind] = {"json": "json", "regex": "regex", "ebnf": "ebnf"}


@dataclass(frozen=True)
class GrammarSpec:
    """One grammar request, normalized: ``kind`` and its ``source`` text.

    ``json``: the schema as JSON text (a dict is dumped as given: property order is the order in which
    the grammar emits properties); ``regex``/``ebnf``: the pattern or grammar text; ``choice``: the
    alternatives as a JSON list. ``key`` identifies the compiled grammar in the compiler's cache.
    ``trigger``: the grammar applies only once this token sequence has been generated (before it,
    generation is free; empty = from the first token). ``bound``: once this token is generated while
    the trigger is pending, the rest of the trigger is forced token by token and the grammar follows
    (None = no bound). Both are the reference's ``so_args`` keys ``trigger_token_ids`` /
    ``bound_token_id`` and do not change the compiled grammar.
    """

    kind: GrammarKind
    source: str
    trigger: tuple[int, ...] = ()
    bound: int | None = None

    @property
    def key(self) -> str:
        return f"{self.kind}:{self.source}"

    def choices(self) -> list[str]:
        """The alternatives of a ``choice`` spec."""
        if self.kind != "choice":
            raise ValueError(f"GrammarSpec.choices: spec kind is {self.kind!r}, not 'choice'")
        return json.loads(self.source)

    def describe(self) -> str:
        """A short human form for error messages (long schemas are cut)."""
        text = self.source if len(self.source) <= 80 else self.source[:77] + "..."
        return f"{self.kind} {text}"


def parse_spec(structured: Mapping[str, Any] | None, so_args: Mapping[str, Any] | None) -> GrammarSpec | None:
    """The normalized spec of a request, or None when it asks for none.

    Raises ``ValueError`` naming ``SamplingParams.structured`` or ``SamplingParams.so_args`` when the
    form is wrong: both given, not exactly one kind, or a value of the wrong type.
    """
    if structured is not None and so_args is not None:
        raise ValueError("SamplingParams: give either structured or so_args (the reference's form), not both")
    if structured is not None:
        return _from_structured(structured)
    if so_args is not None:
        return _from_so_args(so_args)
    return None


def _from_structured(structured: Mapping[str, Any]) -> GrammarSpec:
    if not isinstance(structured, Mapping):
        raise ValueError(f"SamplingParams.structured must be a dict with one of {sorted(_STRUCTURED_KEYS)}, "
                         f"got {type(structured).__name__}")
    given = [k for k, v in structured.items() if v is not None]
    unknown = sorted(set(structured) - set(_STRUCTURED_KEYS))
    if unknown:
        raise ValueError(f"SamplingParams.structured has unknown key {unknown[0]!r}; "
                         f"allowed: {sorted(_STRUCTURED_KEYS)}")
    if len(given) != 1:
        raise ValueError(f"SamplingParams.structured must set exactly one of {sorted(_STRUCTURED_KEYS)}, "
                         f"got {given or 'none'}")
    name = given[0]
    return _make(_STRUCTURED_KEYS[name], structured[name], f"SamplingParams.structured[{name!r}]")


_SO_KEYS = {"schema_type", "schema"}
_SO_OPTIONAL = {"trigger_token_ids", "bound_token_id"}


def _from_so_args(so_args: Mapping[str, Any]) -> GrammarSpec:
    if (not isinstance(so_args, Mapping) or not set(so_args) >= _SO_KEYS
            or not set(so_args) <= _SO_KEYS | _SO_OPTIONAL):
        raise ValueError('SamplingParams.so_args must be {"schema_type": "json"|"regex"|"ebnf", "schema": ..., '
                         f'optional "trigger_token_ids": [int, ...], "bound_token_id": int}}, got {so_args!r}')
    schema_type = so_args["schema_type"]
    if schema_type not in _SO_SCHEMA_TYPES:
        raise ValueError(f"SamplingParams.so_args['schema_type'] must be one of {sorted(_SO_SCHEMA_TYPES)}, "
                         f"got {schema_type!r}")
    spec = _make(_SO_SCHEMA_TYPES[schema_type], so_args["schema"], "SamplingParams.so_args['schema']")
    trigger = so_args.get("trigger_token_ids")
    trigger = [] if trigger is None else trigger
    if not isinstance(trigger, (list, tuple)) or not all(_is_token(t) for t in trigger):
        raise ValueError("SamplingParams.so_args['trigger_token_ids'] must be a list of non-negative ints, "
                         f"got {trigger!r}")
    bound = so_args.get("bound_token_id")
    if bound is not None:
        if not _is_token(bound):
            raise ValueError(f"SamplingParams.so_args['bound_token_id'] must be a non-negative int or None, "
                             f"got {bound!r}")
        if not trigger:
            raise ValueError("SamplingParams.so_args['bound_token_id'] needs a non-empty trigger_token_ids")
    return replace(spec, trigger=tuple(trigger), bound=bound)


def _is_token(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _make(kind: GrammarKind, value: Any, field: str) -> GrammarSpec:
    if kind == "json":
        if isinstance(value, Mapping):
            try:
                return GrammarSpec(kind, json.dumps(value))
            except (TypeError, ValueError) as exc:
                raise ValueError(f"{field}: the schema dict is not JSON-serializable ({exc})") from None
        if isinstance(value, str) and value.strip():
            return GrammarSpec(kind, value)
        raise ValueError(f"{field} must be a JSON schema as a dict or a non-empty str, got {type(value).__name__}")
    if kind == "choice":
        if (not isinstance(value, (list, tuple)) or not value
                or not all(isinstance(c, str) and c for c in value)):
            raise ValueError(f"{field} must be a non-empty list of non-empty strings, got {value!r}")
        return GrammarSpec(kind, json.dumps(list(value), ensure_ascii=False))
    if not isinstance(value, str) or not value:
        raise ValueError(f"{field} must be a non-empty str, got {value!r}")
    return GrammarSpec(kind, value)
