"""What a request asks the grammar to enforce (API.md §4 ``structured`` / ``so_args``).

This module checks the *form* of the request at ``SamplingParams`` construction (exactly one kind, the
right types) and turns either form into one ``GrammarSpec``. It never imports xgrammar: whether the
schema itself is valid is the compiler's call, and a schema that fails to compile finishes only its
own request with ``finish_reason="error"``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
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
    """

    kind: GrammarKind
    source: str

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


def _from_so_args(so_args: Mapping[str, Any]) -> GrammarSpec:
    if not isinstance(so_args, Mapping) or set(so_args) != {"schema_type", "schema"}:
        raise ValueError('SamplingParams.so_args must be {"schema_type": "json"|"regex"|"ebnf", "schema": ...}, '
                         f"got {so_args!r}")
    schema_type = so_args["schema_type"]
    if schema_type not in _SO_SCHEMA_TYPES:
        raise ValueError(f"SamplingParams.so_args['schema_type'] must be one of {sorted(_SO_SCHEMA_TYPES)}, "
                         f"got {schema_type!r}")
    return _make(_SO_SCHEMA_TYPES[schema_type], so_args["schema"], "SamplingParams.so_args['schema']")


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
