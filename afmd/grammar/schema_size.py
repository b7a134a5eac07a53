"""How many subschemas a request's JSON schemas hold, counted no further than it may hold.

llguidance compiles a schema one subschema at a time and gives up past a count of them
(``max_size``, "schema too large"): every object subschema it compiles counts at least
once, a ``type`` in it once more. Before the compile, afmd checks each schema against
JSON Schema's metaschema, pure Python holding the GIL at a cost per subschema, whatever
the compiler will say: a schema far past the compiler's count spent seconds of a core
on that check only to be refused by the compiler afterwards. Counting object subschemas
where a schema may hold them, and stopping at the bound, costs no more than the bound
however large the schema is; a schema the compiler could compile is never past it, but
for one that holds tens of thousands of definitions it never refers to (llguidance
compiles only those referred to). The bound is a request's, over all its schemas,
because the check's cost is the request's: tools that each stay under the compiler's
count would otherwise add up to any cost a body can carry.
"""

from __future__ import annotations

from typing import Any

__all__ = ["MAX_SUBSCHEMAS", "subschemas"]

#: Subschemas (and their types) a request's schemas may hold together: llguidance's own
#: count for one schema (its ``SchemaBuilderOptions::max_size``).
MAX_SUBSCHEMAS = 50_000

#: Keywords whose value is one subschema.
_ONE = frozenset({
    "items", "additionalItems", "additionalProperties", "not", "if", "then", "else",
    "contains", "propertyNames", "unevaluatedItems", "unevaluatedProperties",
    "contentSchema",
})
#: Keywords whose value is an array of subschemas (``items`` too, in drafts before 2020-12).
_ARRAY = frozenset({"allOf", "anyOf", "oneOf", "prefixItems", "items"})
#: Keywords whose value maps names to subschemas (``dependencies``: some values are).
_MAP = frozenset({
    "properties", "patternProperties", "$defs", "definitions", "dependentSchemas",
    "dependencies",
})


def subschemas(schema: Any, budget: int) -> int:
    """The object subschemas ``schema`` holds, ``schema`` itself included, each once and
    once more for each type it names, as the compiler counts them at least; counted no
    further than past ``budget``: a count above ``budget`` means "more than it"."""
    count = 0
    stack = [schema]
    while stack:
        value = stack.pop()
        if type(value) is not dict:  # true, false, or not a schema (the metaschema's to say)
            continue
        types = value.get("type")
        count += 1 + (1 if type(types) is str else len(types) if type(types) is list else 0)
        if count > budget:
            return count
        for key, child in value.items():
            if key in _ONE:
                stack.append(child)
            if key in _ARRAY and type(child) is list:
                stack.extend(child)
            elif key in _MAP and type(child) is dict:
                stack.extend(child.values())
    return count
