"""Hypothesis strategies from JSON Schema: the subset labkit's OpenAPI document uses (type, const, enum, anyOf,
numeric bounds, array sizes, object properties with required ones and no extras). Written here because
hypothesis-jsonschema 0.23 does not run on current hypothesis releases (it uses internals they removed)."""

from __future__ import annotations

import math
from typing import Any

from hypothesis import strategies as st

UNBOUNDED = 2**64  # integers without a bound range past int64 both ways: the server must refuse them cleanly


def from_schema(schema: dict[str, Any]) -> st.SearchStrategy[Any]:
    """Values that satisfy ``schema`` (refs already inlined)."""
    if "const" in schema:
        return st.just(schema["const"])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    if "anyOf" in schema:
        return st.one_of([from_schema(s) for s in schema["anyOf"]])
    kind = schema.get("type")
    if isinstance(kind, list):
        return st.one_of([from_schema({**schema, "type": k}) for k in kind])
    if kind == "null":
        return st.none()
    if kind == "boolean":
        return st.booleans()
    if kind == "integer":
        low = schema.get("minimum", -UNBOUNDED)
        high = schema.get("maximum", UNBOUNDED)
        # the edges and small values are where the bugs are: weight them
        return st.one_of(st.sampled_from(sorted({low, high, max(low, min(high, 1))})), st.integers(low, high),
                         st.integers(max(low, -3), min(high, 40)))
    if kind == "number":
        low, high = schema.get("minimum", -math.inf), schema.get("maximum", math.inf)
        exclusive = "exclusiveMinimum" in schema
        if exclusive:
            low = schema["exclusiveMinimum"]
        return st.floats(low if math.isfinite(low) else None, high if math.isfinite(high) else None,
                         exclude_min=exclusive, allow_nan=False, allow_infinity=False)
    if kind == "string":
        return st.text(max_size=schema.get("maxLength", 40))
    if kind == "array":
        items = from_schema(schema.get("items", {"type": "integer"}))
        return st.lists(items, min_size=schema.get("minItems", 0), max_size=schema.get("maxItems", 8))
    if kind == "object" or "properties" in schema:
        props = schema.get("properties", {})
        required = set(schema.get("required", ()))
        return st.fixed_dictionaries({k: from_schema(v) for k, v in props.items() if k in required},
                                     optional={k: from_schema(v) for k, v in props.items() if k not in required})
    raise ValueError(f"no strategy for the schema {schema}")
