"""A client's JSON Schema as vLLM users expect it, before llguidance compiles it.

Plain dict walking (no llguidance, no torch): `normalize_schema` returns a new schema and never
changes the one it is given.

Strict (the default, and `strict: true` in OpenAI's `json_schema` and `function`): properties a
schema does not name are refused, as xgrammar's strict mode (vLLM's default backend) and
OpenAI's strict mode hold a model to a schema:

- An object schema that lists `properties` and says neither `additionalProperties` nor
  `unevaluatedProperties` gets `additionalProperties: false` (keys its `patternProperties`
  match stay allowed, as JSON Schema defines). A name in `required` counts as named.
- The names an object's `allOf` parts (inline, or a local `$ref`) and its `anyOf` / `oneOf`
  alternatives list count as its own, as `unevaluatedProperties: false` would count them.
  llguidance intersects the parts of an `allOf` (JSON Schema's rule), so closing each part on
  its own names would refuse every name of the others: the object is closed over all of them,
  its `allOf` parts are left open (a part that is a `$ref` points at an open copy of the
  definition, added beside it as `<name>.open`), and each alternative is closed over its own
  names plus the object's.
- An array with `prefixItems` (or a draft-4 `items` list) and no `items` (`additionalItems`)
  refuses items past the listed ones.
- An object that lists no properties (`{"type": "object"}`, a map) and an array without `items`
  keep JSON Schema's meaning: any keys, any items.

`strict: false` keeps JSON Schema's own defaults (unnamed properties and items allowed).

Whatever the mode, a `format` that llguidance cannot enforce is dropped (JSON Schema makes
`format` an annotation: the value is then constrained by its type only; `uuid1`..`uuid8`
become a pattern), `oneOf` becomes `anyOf` (llguidance refuses a `oneOf` whose branches it
cannot prove disjoint; where they are disjoint the two mean the same), and the tag a
discriminated union names (`discriminator.propertyName`) is required in each of its branches.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from typing import Any

ENFORCED_FORMATS = frozenset({
    "date-time", "date", "time", "duration", "email", "hostname", "ipv4", "ipv6", "uri", "uuid",
})
"""The string formats llguidance 1.9.1 enforces; any other `format` is dropped."""

_UUID = "^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-%s[0-9a-fA-F]{3}-[89abAB][0-9a-fA-F]{3}-[0-9a-fA-F]{12}$"
FORMAT_PATTERNS = {f"uuid{version}": _UUID % version for version in "12345678"}
"""Formats llguidance does not know that are enforced as a `pattern` instead (when the schema
gives none): pydantic's UUID1..UUID8 write them, and validate the version and the variant."""

MAX_ADDED_NODES = 20_000
"""Most subschemas normalizing may add (names listed beside the ones they close, open copies of
definitions): compositions multiply them (an allOf of two 100-way anyOfs lists 200 names in
each of its 200 branches), and this bounds what one schema can make the walk and llguidance do."""

_DEFINITIONS = ("$defs", "definitions")
_OPEN_KEYS = ("additionalProperties", "unevaluatedProperties")  # an object that says how it treats other keys
_Names = tuple[str, ...]


def normalize_schema(schema: dict[str, Any] | bool, *, strict: bool = True) -> dict[str, Any] | bool:
    """`schema` with the rules of the module doc applied; ValueError for one nested too deeply
    to walk, or one whose compositions would add more than MAX_ADDED_NODES subschemas."""
    if not isinstance(schema, dict):
        return schema
    try:
        return _Normalizer(_require_discriminators(schema), strict).root()
    except RecursionError:
        raise ValueError("the JSON schema nests too deeply") from None


def _require_discriminators(schema: dict[str, Any]) -> dict[str, Any]:
    """`schema`, copied where it changes, with the tag of every discriminated union required
    in each of its branches (OpenAPI's `discriminator.propertyName`, which pydantic writes
    beside a `oneOf`). pydantic leaves a tag that has a default out of `required`, yet refuses
    a member without it: the output must always carry it. A branch that is a local `$ref` has
    its definition changed, wherever else it is used (the tag is then merely always written)."""
    if "discriminator" not in json.dumps(schema):
        return schema
    schema = copy.deepcopy(schema)
    stack: list[Any] = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
            continue
        if not isinstance(node, dict):
            continue
        stack.extend(node.values())
        tag = node.get("discriminator", {}).get("propertyName") if isinstance(node.get("discriminator"), dict) else None
        if not isinstance(tag, str):
            continue
        for branch in _alternatives(node):
            target = _local_target(schema, branch)
            if isinstance(target, dict) and tag in (target.get("properties") or {}):
                required = target.setdefault("required", [])
                if isinstance(required, list) and tag not in required:
                    required.append(tag)
    return schema


def _local_target(root: dict[str, Any], branch: Any) -> Any:
    """A branch itself, or the definition its local `$ref` (`#/$defs/name`) names."""
    ref = branch.get("$ref") if isinstance(branch, dict) else None
    if not isinstance(ref, str):
        return branch
    parts = ref.split("/")
    if len(parts) != 3 or parts[0] != "#" or parts[1] not in _DEFINITIONS:
        return None
    return (root.get(parts[1]) or {}).get(_unescape(parts[2]))


def _may_be_object(node: dict[str, Any]) -> bool:
    kind = node.get("type")
    if kind is None:
        return "const" not in node and "enum" not in node
    return kind == "object" or isinstance(kind, list) and "object" in kind


def _alternatives(node: dict[str, Any]) -> list[Any]:
    return [*_as_list(node.get("anyOf")), *_as_list(node.get("oneOf"))]


def _as_list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def _unique(names: list[str]) -> _Names:
    return tuple(dict.fromkeys(names))


def _escape(token: str) -> str:
    return token.replace("~", "~0").replace("/", "~1")


def _unescape(token: str) -> str:
    return token.replace("~1", "/").replace("~0", "~")


@dataclass(frozen=True, slots=True)
class _Scope:
    """The object an `allOf` composition describes, closed as a whole: the names it always
    evaluates (`fixed`: its properties and its parts') and every name it lists (`everything`:
    those and its alternatives')."""

    fixed: _Names
    everything: _Names

    def inherited(self, group: _Names) -> _Names:
        """What the alternatives of one anyOf allow besides their own names: every name but
        those only that anyOf's branches list."""
        return tuple(n for n in self.everything if n in self.fixed or n not in group)


class _Normalizer:
    """One walk over one schema: `root()` builds the normalized copy."""

    __slots__ = ("_root", "_strict", "_copies", "_copy_defs", "_copying", "_added")

    def __init__(self, root: dict[str, Any], strict: bool) -> None:
        self._root = root
        self._strict = strict
        self._copies: dict[tuple[str, _Scope | None], str] = {}  # (ref, scope) -> the open copy's ref
        self._copy_defs: dict[str, dict[str, Any]] = {}  # definitions key -> {name: open copy}
        self._copying = 0  # how many open copies the walk is inside
        self._added = 0  # subschemas added so far

    def _add(self, count: int) -> None:
        self._added += count
        if self._added > MAX_ADDED_NODES:
            raise ValueError(f"the JSON schema's compositions (allOf, anyOf, oneOf) make it too large to hold "
                             f"strictly: more than {MAX_ADDED_NODES} subschemas to add; send it with strict false")

    def root(self) -> dict[str, Any]:
        out = self._schema(self._root)
        for key, copies in self._copy_defs.items():
            out[key] = {**out.get(key, {}), **copies}
        return out

    # ------------------------------------------------------------ the walk

    def _schema(self, node: Any, scope: _Scope | None = None) -> Any:
        """`node` normalized. With `scope`, `node` is a part of that object (an allOf part or
        the target of a $ref beside properties): left open, the object is closed as a whole."""
        if not isinstance(node, dict):
            return node
        if self._copying:
            self._add(1)
        out = dict(node)
        fmt = out.get("format")
        if isinstance(fmt, str) and fmt not in ENFORCED_FORMATS:
            del out["format"]
            if fmt in FORMAT_PATTERNS and "pattern" not in node:
                out["pattern"] = FORMAT_PATTERNS[fmt]
        if scope is None and self._strict and _may_be_object(node) and self._composes(node):
            scope = self._close(node, out)
        self._children(node, out)
        self._compositions(node, out, scope)
        if self._strict:
            self._close_items(node, out)
        return out

    def _composes(self, node: dict[str, Any]) -> bool:
        """Whether `node` describes an object by the names it lists (its own properties or its
        allOf parts'): a plain `$ref` does not (the definition it names is closed on its own)."""
        if "properties" in node:
            return isinstance(node["properties"], dict)  # else not a schema: llguidance refuses it
        return any(self._names(sub) for sub in _as_list(node.get("allOf")))

    def _close(self, node: dict[str, Any], out: dict[str, Any]) -> _Scope:
        """Closes `out` over every name its composition lists, unless it says how it treats
        other keys itself; its scope either way."""
        scope = _Scope(self._fixed(node, set()), self._names(node))
        if not any(k in node for k in _OPEN_KEYS):
            own = node.get("properties", {})
            placeholders = {name: {} for name in scope.everything if name not in own}
            self._add(len(placeholders))
            out["properties"] = {**own, **placeholders}
            out["additionalProperties"] = False
        return scope

    def _children(self, node: dict[str, Any], out: dict[str, Any]) -> None:
        """The subschemas that are values, items or definitions: each normalized on its own."""
        for key in ("properties", "patternProperties", *_DEFINITIONS):
            if isinstance(node.get(key), dict):
                walked = {name: self._schema(sub) for name, sub in node[key].items()}
                out[key] = {**out[key], **walked}  # placeholders the closing added stay
        for key in ("additionalProperties", "items", "additionalItems"):
            value = node.get(key)
            if isinstance(value, dict):
                out[key] = self._schema(value)
            elif isinstance(value, list):
                out[key] = [self._schema(sub) for sub in value]
        if isinstance(node.get("prefixItems"), list):
            out["prefixItems"] = [self._schema(sub) for sub in node["prefixItems"]]

    def _compositions(self, node: dict[str, Any], out: dict[str, Any], scope: _Scope | None) -> None:
        """allOf parts (open within a scope), a `$ref` beside properties likewise, and anyOf /
        oneOf alternatives (a oneOf as anyOf)."""
        if isinstance(node.get("allOf"), list):
            out["allOf"] = [self._part(sub, scope) for sub in node["allOf"]]
        if scope is not None and isinstance(node.get("$ref"), str):
            out["$ref"] = self._open_copy(node["$ref"], scope)
        if isinstance(node.get("anyOf"), list):
            out["anyOf"] = self._group(node["anyOf"], scope)
        if isinstance(node.get("oneOf"), list):
            branches = self._group(node["oneOf"], scope)
            del out["oneOf"]
            if "anyOf" in node:  # both must hold: the former oneOf joins the allOf
                out["allOf"] = [*out.get("allOf", []), {"anyOf": branches}]
            else:
                out["anyOf"] = branches

    def _part(self, sub: Any, scope: _Scope | None) -> Any:
        if scope is None:
            return self._schema(sub)
        if isinstance(sub, dict) and isinstance(sub.get("$ref"), str) and not self._composes(sub):
            return {**sub, "$ref": self._open_copy(sub["$ref"], scope)}
        return self._schema(sub, scope)

    def _group(self, branches: list[Any], scope: _Scope | None) -> list[Any]:
        if scope is None:
            return [self._schema(sub) for sub in branches]
        inherited = scope.inherited(_unique([n for sub in branches for n in self._names(sub)]))
        return [self._alternative(sub, inherited, scope.everything) for sub in branches]

    def _alternative(self, sub: Any, inherited: _Names, order: _Names) -> Any:
        """One anyOf / oneOf branch, closed over its own names plus `inherited`, listed in the
        scope's `order` (llguidance writes an intersection's properties in one branch's order,
        which must agree with the others')."""
        if not (inherited and isinstance(sub, dict) and _may_be_object(sub)) or any(k in sub for k in _OPEN_KEYS):
            return self._schema(sub)  # nothing to add, or the branch says how it treats other keys
        own = sub.get("properties", {})
        if not isinstance(own, dict):
            return self._schema(sub)
        names = {*inherited, *self._names(sub)}
        properties = {name: own.get(name, {}) for name in order if name in names}
        self._add(len(properties) - len(own))
        if isinstance(sub.get("$ref"), str) and not self._composes(sub):
            rest = {k: v for k, v in sub.items() if k != "$ref"}
            return self._schema({**rest, "allOf": [*_as_list(sub.get("allOf")), {"$ref": sub["$ref"]}],
                                 "properties": properties})
        return self._schema({**sub, "properties": {**properties, **own}})

    def _close_items(self, node: dict[str, Any], out: dict[str, Any]) -> None:
        if isinstance(node.get("prefixItems"), list) and "items" not in node and "unevaluatedItems" not in node:
            out["items"] = False
        if isinstance(node.get("items"), list) and "additionalItems" not in node and "unevaluatedItems" not in node:
            out["additionalItems"] = False

    # ------------------------------------------------------------ names an object lists

    def _fixed(self, node: Any, seen: set[str]) -> _Names:
        """Names `node` always evaluates: its properties, its allOf parts' and its $ref's."""
        if not isinstance(node, dict):
            return ()
        names = list(self._fixed_own(node))
        for sub in _as_list(node.get("allOf")):
            names += self._fixed(sub, seen)
        names += self._fixed(self._follow(node, seen), seen)
        return _unique(names)

    def _names(self, node: Any) -> _Names:
        """Every name `node`'s composition lists: fixed ones and its alternatives'."""
        return _unique([*self._fixed(node, set()), *self._alternative_names(node, set())])

    def _alternative_names(self, node: Any, seen: set[str]) -> _Names:
        """Names listed by the alternatives in `node`'s composition (any of them)."""
        if not isinstance(node, dict):
            return ()
        names: list[str] = []
        for sub in _alternatives(node):
            names += self._fixed(sub, seen) + self._alternative_names(sub, seen)
        for sub in [*_as_list(node.get("allOf")), self._follow(node, seen)]:
            names += self._alternative_names(sub, seen)
        return _unique(names)

    @staticmethod
    def _fixed_own(node: dict[str, Any]) -> _Names:
        """The names `node` itself lists: its properties, and those it requires (a required
        name is named, even where `properties` leaves it out)."""
        properties = node.get("properties")
        names = list(properties) if isinstance(properties, dict) else []
        names += [name for name in _as_list(node.get("required")) if isinstance(name, str)]
        return _unique(names)

    def _follow(self, node: dict[str, Any], seen: set[str]) -> Any:
        """The target of `node`'s local $ref, once per walk of names (cycles end there)."""
        ref = node.get("$ref")
        if not isinstance(ref, str) or ref in seen:
            return None
        seen.add(ref)
        return self._resolve(ref)

    def _resolve(self, ref: str) -> Any:
        if not ref.startswith("#"):
            return None  # remote references are llguidance's to refuse
        target: Any = self._root
        for token in filter(None, ref[1:].split("/")):
            key = _unescape(token)
            if isinstance(target, dict) and key in target:
                target = target[key]
            elif isinstance(target, list) and key.isdigit() and int(key) < len(target):
                target = target[int(key)]
            else:
                return None
        return target

    # ------------------------------------------------------------ open copies of definitions

    def _open_copy(self, ref: str, scope: _Scope) -> str:
        """The ref of an open copy of the definition `ref` names, made once per ref (and
        scope, when the definition has alternatives that inherit names from it), or `ref`
        itself when it names no definition of this schema."""
        parts = ref.split("/")
        target = self._resolve(ref)
        if len(parts) != 3 or parts[0] != "#" or parts[1] not in _DEFINITIONS or not isinstance(target, dict):
            return ref
        key = (ref, scope if self._alternative_names(target, set()) else None)
        if key in self._copies:
            return self._copies[key]
        defs_key = parts[1]
        name = self._copy_name(defs_key, _unescape(parts[2]))
        self._copies[key] = copy_ref = f"#/{defs_key}/{_escape(name)}"
        self._copy_defs.setdefault(defs_key, {})[name] = {}  # taken before the walk: it may refer to itself
        self._copying += 1
        try:
            self._copy_defs[defs_key][name] = self._schema(target, scope)
        finally:
            self._copying -= 1
        return copy_ref

    def _copy_name(self, defs_key: str, name: str) -> str:
        taken = {*(self._root.get(defs_key) or {}), *self._copy_defs.get(defs_key, {})}
        candidate, i = f"{name}.open", 1
        while candidate in taken:
            i += 1
            candidate = f"{name}.open{i}"
        return candidate
