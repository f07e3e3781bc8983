"""JSON Schema → the schema xgrammar compiles: every keyword is enforced or refused, never ignored.

xgrammar (0.2) compiles many schemas whose keywords it does not keep: it accepts ``multipleOf:
0.5`` and still writes ``0.3``, ignores the keywords beside an ``anyOf`` or a ``$ref``, draft-7's
``dependencies``, a lookahead in a ``pattern``, a ``required`` name that ``properties`` does
not declare, and a ``minimum`` in a schema without ``type``. ``normalize`` rewrites a schema
into an equivalent (or narrower: every output it admits is valid against the original) one that
xgrammar enforces whole, or raises ``ValueError`` naming the keyword and where it is.

Narrower, never wider: a schema without ``type`` whose keywords all concern numbers gets
``"type": "number"`` (the strings it would also admit are not produced), a ``oneOf`` is compiled
as an ``anyOf`` only when its branches are provably disjoint (then the two mean the same), a
number with an integer ``multipleOf`` becomes an integer.

``strict`` (OpenAI's ``strict: true``, and tool arguments) closes every object schema that
leaves its properties open: ``additionalProperties: false`` where the schema says nothing.

``KEYWORDS`` classifies every JSON Schema keyword (2020-12 and draft-7, plus OpenAPI's
``nullable`` and ``discriminator``): ``enforced``, ``refused`` or ``annotation``; README.md's
keyword table is generated from it (``keyword_table``) and tests/unit/test_schema_keywords.py
proves each row. Keywords outside the JSON Schema vocabulary are annotations, as the
specification says (``x-...`` extensions, ``example``).
"""
from __future__ import annotations

import copy
import json
import math

# keyword -> (how, what sluice does with it). ``how``: enforced | refused | annotation.
KEYWORDS: dict[str, tuple[str, str]] = {
    "type": ("enforced", "one type or a list; a schema without it gets the types its other keywords imply"),
    "enum": ("enforced", "values of another `type` than the schema's are dropped (none left: a 400)"),
    "const": ("enforced", "a 400 when it contradicts `type`"),
    "properties": ("enforced", ""),
    "required": ("enforced", "a name `properties` does not declare is added to it (with "
                             "`additionalProperties`' schema)"),
    "additionalProperties": ("enforced", "under `strict`, objects that say nothing are closed"),
    "patternProperties": ("enforced", "each pattern matched against the whole name; no lookaround"),
    "propertyNames": ("enforced", ""),
    "minProperties": ("enforced", ""),
    "maxProperties": ("enforced", ""),
    "unevaluatedProperties": ("enforced", "as `additionalProperties` (the applicators beside it are merged first)"),
    "items": ("enforced", "draft-7's list form as `prefixItems`"),
    "prefixItems": ("enforced", ""),
    "additionalItems": ("enforced", "draft-7: as `items` after `prefixItems`"),
    "unevaluatedItems": ("enforced", "as `items` after `prefixItems`"),
    "minItems": ("enforced", ""),
    "maxItems": ("enforced", ""),
    "minLength": ("enforced", "not together with `pattern` or `format` (refused)"),
    "maxLength": ("enforced", "not together with `pattern` or `format` (refused)"),
    "pattern": ("enforced", "matched against the whole string (as if anchored: narrower, never invalid); "
                            "lookahead/lookbehind and backreferences are refused"),
    "format": ("enforced", "strings: " + ", ".join(sorted(
        ("email", "date", "date-time", "time", "duration", "uuid", "ipv4", "ipv6", "hostname", "uri",
         "uri-reference", "uri-template", "json-pointer", "relative-json-pointer")))
        + "; numbers: int32, int64 (as bounds), float, double; any other is refused"),
    "minimum": ("enforced", ""),
    "maximum": ("enforced", ""),
    "exclusiveMinimum": ("enforced", "a number (draft-4's boolean form is refused)"),
    "exclusiveMaximum": ("enforced", "a number (draft-4's boolean form is refused)"),
    "multipleOf": ("enforced", "integer values (a `number` becomes an `integer`); a fractional one is refused"),
    "anyOf": ("enforced", "keywords beside it are merged into each branch (a 400 where they overlap)"),
    "oneOf": ("enforced", "only when the branches are provably disjoint (by type, `const`/`enum`, or a "
                          "required discriminating property); overlapping branches are refused"),
    "allOf": ("enforced", "merged into one schema when the schemas' keywords do not overlap; refused otherwise"),
    "$ref": ("enforced", "local JSON pointers (`#`, `#/$defs/...`); remote, anchor and relative references "
                         "are refused, and so are validation keywords beside it"),
    "$defs": ("enforced", ""),
    "definitions": ("enforced", ""),
    "nullable": ("enforced", "OpenAPI's: adds `null` to `type`"),
    "not": ("refused", ""),
    "if": ("refused", ""),
    "then": ("refused", ""),
    "else": ("refused", ""),
    "uniqueItems": ("refused", "`false` is accepted"),
    "contains": ("refused", ""),
    "minContains": ("refused", ""),
    "maxContains": ("refused", ""),
    "dependentRequired": ("refused", ""),
    "dependentSchemas": ("refused", ""),
    "dependencies": ("refused", "draft-7"),
    "$dynamicRef": ("refused", ""),
    "$recursiveRef": ("refused", ""),
    "contentEncoding": ("refused", ""),
    "contentMediaType": ("refused", ""),
    "contentSchema": ("refused", ""),
    "title": ("annotation", ""),
    "description": ("annotation", ""),
    "default": ("annotation", ""),
    "examples": ("annotation", ""),
    "deprecated": ("annotation", ""),
    "readOnly": ("annotation", ""),
    "writeOnly": ("annotation", ""),
    "$comment": ("annotation", ""),
    "$schema": ("annotation", ""),
    "$id": ("annotation", "references through it are refused"),
    "$anchor": ("annotation", "references to it are refused"),
    "$dynamicAnchor": ("annotation", ""),
    "$recursiveAnchor": ("annotation", ""),
    "$vocabulary": ("annotation", ""),
    "discriminator": ("annotation", "OpenAPI's; the `oneOf` beside it must still be disjoint"),
}

REFUSED = tuple(k for k, (how, _) in KEYWORDS.items() if how == "refused")
ANNOTATIONS = frozenset(k for k, (how, _) in KEYWORDS.items() if how == "annotation")
# Keywords that hold subschemas rather than constrain the instance where they stand.
_DEFS = ("$defs", "definitions")
_APPLICATORS = ("anyOf", "oneOf", "allOf")
STRING_FORMATS = frozenset(("email", "date", "date-time", "time", "duration", "uuid", "ipv4", "ipv6", "hostname",
                            "uri", "uri-reference", "uri-template", "json-pointer", "relative-json-pointer"))
_INT_FORMATS = {"int32": (-(1 << 31), (1 << 31) - 1), "int64": (-(1 << 63), (1 << 63) - 1)}
_FAMILIES = {
    "number": ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"),
    "string": ("minLength", "maxLength", "pattern"),
    "object": ("properties", "required", "additionalProperties", "patternProperties", "propertyNames",
               "minProperties", "maxProperties", "unevaluatedProperties"),
    "array": ("items", "prefixItems", "minItems", "maxItems", "unevaluatedItems", "additionalItems"),
}
_TYPES = ("null", "boolean", "object", "array", "number", "integer", "string")
MAX_DEPTH = 64


def normalize(schema, strict: bool, field: str):
    """A new schema that xgrammar enforces whole (``schema`` is left alone); ``ValueError``
    naming ``field``, the keyword and its place for what cannot be enforced."""
    return _Normalizer(schema, strict, field).walk(copy.deepcopy(schema), "", 0)


def keyword_table() -> str:
    """README.md's keyword table (Markdown), from ``KEYWORDS``: the keywords by how they are
    treated, then what holds for those with a condition."""
    heads = {"enforced": "enforced", "refused": "refused (a 400 naming it)", "annotation": "annotation (no effect)"}
    rows = ["| | keywords |", "| --- | --- |"]
    for how, head in heads.items():
        rows.append(f"| {head} | {', '.join(f'`{k}`' for k, (h, _) in KEYWORDS.items() if h == how)} |")
    notes = [f"- `{k}`: {note}" for k, (_, note) in KEYWORDS.items() if note]
    return "\n".join(rows + [""] + notes)


class _Normalizer:
    def __init__(self, root, strict: bool, field: str) -> None:
        self.root = root
        self.strict = strict
        self.field = field

    def fail(self, path: str, keyword: str, why: str):
        return ValueError(f"{self.field}: JSON Schema keyword {keyword!r} at {path or '/'} is not supported: {why}")

    # ---- one schema ---------------------------------------------------------------------------
    def walk(self, s, path: str, depth: int):
        if isinstance(s, bool):
            return s
        if not isinstance(s, dict):
            raise ValueError(f"{self.field}: the schema at {path or '/'} must be an object or a boolean, "
                             f"got {type(s).__name__}")
        if depth > MAX_DEPTH:
            raise ValueError(f"{self.field}: the schema nests deeper than {MAX_DEPTH} levels at {path}")
        self._refuse(s, path)
        self._draft7_items(s)
        if s.get("nullable") is True:
            self._nullable(s)
        if "$ref" in s:
            self._ref(s, path)
        if "allOf" in s:
            s = self._merge_all_of(s, path)
            if "allOf" in s:
                return self._recurse(s, path, depth)
            return self.walk(s, path, depth + 1)    # what the merged schemas brought is checked too
        for kw in ("anyOf", "oneOf"):
            if kw in s:
                self._distribute(s, kw, path)
        if "oneOf" in s:
            self._one_of(s, path)
        if "$ref" not in s and not any(k in s for k in _APPLICATORS):
            self._infer_type(s)
            self._numbers(s, path)
            self._strings(s, path)
            self._values(s, path)
            self._objects(s, path)
        return self._recurse(s, path, depth)

    def _refuse(self, s: dict, path: str) -> None:
        for kw in REFUSED:
            if kw in s and not (kw == "uniqueItems" and s[kw] is False):
                raise self.fail(path, kw, "the grammar could not enforce it")
        if s.get("uniqueItems") is False:
            del s["uniqueItems"]

    @staticmethod
    def _draft7_items(s: dict) -> None:
        if isinstance(s.get("items"), list):
            s["prefixItems"] = s.pop("items")
            if "additionalItems" in s:
                s["items"] = s.pop("additionalItems")
        elif "additionalItems" in s:
            del s["additionalItems"]       # draft-7 ignores it unless items is a list
        if "unevaluatedItems" in s and "items" not in s:
            s["items"] = s.pop("unevaluatedItems")
        s.pop("unevaluatedItems", None)    # beside items it constrains nothing more

    @staticmethod
    def _nullable(s: dict) -> None:
        del s["nullable"]
        t = s.get("type")
        if isinstance(t, str) and t != "null":
            s["type"] = [t, "null"]
        elif isinstance(t, list) and "null" not in t:
            s["type"] = [*t, "null"]
        if isinstance(s.get("enum"), list) and None not in s["enum"]:
            s["enum"] = [*s["enum"], None]

    def _ref(self, s: dict, path: str) -> None:
        ref = s["$ref"]
        if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
            raise self.fail(path, "$ref", f"only local JSON pointers ('#/...') are, got {ref!r}")
        self.resolve(ref, path)
        beside = _validation_keys(s) - {"$ref"}
        if beside:
            raise self.fail(path, "$ref", f"validation keywords beside it ({', '.join(sorted(beside))}) would be "
                                          "ignored; move them into the referenced schema")

    def resolve(self, ref: str, path: str):
        node = self.root
        for part in ref[2:].split("/") if ref != "#" else ():
            part = part.replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                raise ValueError(f"{self.field}: $ref {ref!r} at {path or '/'} points to nothing")
        return node

    def _merge_all_of(self, s: dict, path: str) -> dict:
        parts = s.pop("allOf")
        if not isinstance(parts, list) or not parts:
            raise ValueError(f"{self.field}: allOf at {path or '/'} must be a non-empty list of schemas")
        if len(parts) == 1 and isinstance(parts[0], dict) and "$ref" in parts[0] and not _validation_keys(s):
            s["allOf"] = parts                  # pydantic's {"allOf": [{"$ref": ...}], "description": ...}
            return s
        merged = {k: v for k, v in s.items()}
        for i, part in enumerate(parts):
            if part is True:
                continue
            if not isinstance(part, dict) or "$ref" in part:
                raise self.fail(f"{path}/allOf/{i}", "allOf", "only schemas without $ref can be merged")
            clash = (_validation_keys(part) & _validation_keys(merged)) - {"$defs", "definitions"}
            if clash:
                raise self.fail(path, "allOf", f"its schemas overlap on {', '.join(sorted(clash))}; "
                                               "merge them into one schema")
            merged.update(part)
        return merged

    def _distribute(self, s: dict, kw: str, path: str) -> None:
        """Keywords beside anyOf/oneOf go into each branch (xgrammar ignores them there)."""
        beside = {k: s[k] for k in _validation_keys(s) - {kw, "discriminator"}}
        if not beside:
            return
        branches = s[kw]
        if not isinstance(branches, list) or not branches:
            raise ValueError(f"{self.field}: {kw} at {path or '/'} must be a non-empty list of schemas")
        out = []
        for i, b in enumerate(branches):
            if b is True:
                b = {}
            if not isinstance(b, dict) or "$ref" in b:
                raise self.fail(path, kw, f"keywords beside it ({', '.join(sorted(beside))}) cannot be merged into "
                                          f"branch {i}, which is a $ref or a boolean")
            clash = _validation_keys(b) & set(beside)
            if clash:
                raise self.fail(path, kw, f"keywords beside it overlap branch {i} on {', '.join(sorted(clash))}")
            out.append({**copy.deepcopy(beside), **b})
        for k in beside:
            del s[k]
        s[kw] = out

    def _one_of(self, s: dict, path: str) -> None:
        branches = s["oneOf"]
        for i in range(len(branches)):
            for j in range(i):
                if not self._disjoint(branches[j], branches[i], 0):
                    raise self.fail(path, "oneOf", f"branches {j} and {i} may both match one value (the grammar "
                                                   "could not keep exactly one); make them disjoint by type, "
                                                   "const/enum or a required property with a const, or use anyOf")
        s["anyOf"] = s.pop("oneOf")

    def _infer_type(self, s: dict) -> None:
        if "type" in s or "const" in s or "enum" in s:
            return
        found = [t for t, kws in _FAMILIES.items() if any(k in s for k in kws)]
        if s.get("format") in STRING_FORMATS and "string" not in found:
            found.append("string")
        if found:
            s["type"] = found[0] if len(found) == 1 else found

    def _numbers(self, s: dict, path: str) -> None:
        types = _types(s)
        fmt = s.get("format")
        if fmt is not None and types and not types & {"string"}:
            if fmt in _INT_FORMATS:
                lo, hi = _INT_FORMATS[fmt]
                s.setdefault("minimum", lo)
                s.setdefault("maximum", hi)
                if "number" in types:
                    s["type"] = _replace_type(s["type"], "number", "integer")
            elif fmt not in ("float", "double"):
                raise self.fail(path, "format", f"{fmt!r} is not a format the grammar enforces")
            del s["format"]
        for kw in ("exclusiveMinimum", "exclusiveMaximum"):
            if isinstance(s.get(kw), bool):
                raise self.fail(path, kw, "draft-4's boolean form; give the bound itself")
        m = s.get("multipleOf")
        if m is None:
            return
        if isinstance(m, bool) or not isinstance(m, (int, float)) or not math.isfinite(m) or m <= 0:
            raise ValueError(f"{self.field}: multipleOf at {path or '/'} must be a positive number, got {m!r}")
        if m != int(m):
            raise self.fail(path, "multipleOf", f"a fractional value ({m!r}) is not enforced; only integer ones are")
        s["multipleOf"] = int(m)
        if "number" in types:
            s["type"] = _replace_type(s["type"], "number", "integer")

    def _strings(self, s: dict, path: str) -> None:
        lengths = [k for k in ("minLength", "maxLength") if k in s]
        for kw in ("pattern", "format"):
            if kw in s and lengths and "string" in _types(s):
                raise self.fail(path, lengths[0], f"together with {kw!r} the lengths would not be enforced")
        if isinstance(s.get("pattern"), str):
            self._pattern(s["pattern"], path, "pattern")
        if isinstance(s.get("patternProperties"), dict):
            for p in s["patternProperties"]:
                self._pattern(p, path, "patternProperties")
        fmt = s.get("format")
        if fmt is not None and fmt not in STRING_FORMATS:
            raise self.fail(path, "format", f"{fmt!r} is not a format the grammar enforces "
                                            f"(it enforces {', '.join(sorted(STRING_FORMATS))})")

    def _pattern(self, pattern: str, path: str, kw: str) -> None:
        why = regex_unsupported(pattern)
        if why:
            raise self.fail(path, kw, why)

    def _values(self, s: dict, path: str) -> None:
        types = _types(s)
        if not types:
            return
        if "const" in s and _type_of(s["const"]) not in _widen(types):
            raise self.fail(path, "const", f"{s['const']!r} is not of the schema's type")
        if isinstance(s.get("enum"), list):
            kept = [v for v in s["enum"] if _type_of(v) in _widen(types)]
            if not kept:
                raise self.fail(path, "enum", "no value is of the schema's type")
            s["enum"] = kept

    def _objects(self, s: dict, path: str) -> None:
        if "object" not in _types(s):
            return
        if "unevaluatedProperties" in s:
            value = s.pop("unevaluatedProperties")
            s.setdefault("additionalProperties", value)
        required = s.get("required")
        if isinstance(required, list):
            props = s.setdefault("properties", {})
            extra = s.get("additionalProperties", True)
            for name in required:
                if isinstance(name, str) and isinstance(props, dict) and name not in props:
                    if "patternProperties" in s:
                        raise self.fail(path, "required", f"{name!r} is not in properties (beside patternProperties)")
                    if extra is False:
                        raise self.fail(path, "required", f"{name!r} is required but additionalProperties "
                                                          "forbids it")
                    props[name] = copy.deepcopy(extra) if isinstance(extra, dict) else {}
        if self.strict and "additionalProperties" not in s:
            s["additionalProperties"] = False

    # ---- subschemas ---------------------------------------------------------------------------
    def _recurse(self, s: dict, path: str, depth: int):
        for kw in ("properties", "patternProperties", *_DEFS):
            if isinstance(s.get(kw), dict):
                s[kw] = {name: self.walk(sub, f"{path}/{kw}/{_escape(name)}", depth + 1)
                         for name, sub in s[kw].items()}
        for kw in ("prefixItems", *_APPLICATORS):
            if isinstance(s.get(kw), list):
                s[kw] = [self.walk(sub, f"{path}/{kw}/{i}", depth + 1) for i, sub in enumerate(s[kw])]
        for kw in ("items", "additionalProperties", "propertyNames"):
            if kw in s:
                s[kw] = self.walk(s[kw], f"{path}/{kw}", depth + 1)
        return s

    # ---- oneOf disjointness -------------------------------------------------------------------
    def _deref(self, s, depth: int):
        while isinstance(s, dict) and "$ref" in s and depth < 16:
            s = self.resolve(s["$ref"], "")
            depth += 1
        if isinstance(s, dict) and isinstance(s.get("allOf"), list) and len(s["allOf"]) == 1:
            return self._deref(s["allOf"][0], depth + 1)
        return s

    def _disjoint(self, a, b, depth: int) -> bool:
        a, b = self._deref(a, depth), self._deref(b, depth)
        if a is False or b is False:
            return True
        if not isinstance(a, dict) or not isinstance(b, dict):
            return False
        ta, tb = _admitted_types(a), _admitted_types(b)
        if ta is not None and tb is not None and not (ta & tb):
            return True
        va, vb = _values_of(a), _values_of(b)
        if va is not None and vb is not None and not (va & vb):
            return True
        return self._discriminated(a, b, depth)

    def _discriminated(self, a: dict, b: dict, depth: int) -> bool:
        pa, pb = a.get("properties"), b.get("properties")
        ra, rb = a.get("required"), b.get("required")
        if not all(isinstance(x, dict) for x in (pa, pb)) or not all(isinstance(x, list) for x in (ra, rb)):
            return False
        for name in set(ra) & set(rb) & set(pa) & set(pb):
            va = _values_of(self._deref(pa[name], depth + 1))
            vb = _values_of(self._deref(pb[name], depth + 1))
            if va is not None and vb is not None and not (va & vb):
                return True
        return False


def regex_unsupported(pattern: str) -> str | None:
    """Why xgrammar would not enforce ``pattern`` (lookaround, which it compiles and ignores), or
    None. Escapes and character classes are skipped over."""
    i, in_class = 0, False
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            i += 2
            continue
        if in_class:
            in_class = c != "]"
        elif c == "[":
            in_class = True
            if pattern[i + 1:i + 2] == "]":
                i += 1
        elif pattern.startswith(("(?=", "(?!", "(?<=", "(?<!"), i):
            kind = pattern[i:i + 4] if pattern[i + 2] == "<" else pattern[i:i + 3]
            return f"lookaround ({kind}...) at position {i} of {pattern!r} is not enforced"
        i += 1
    return None


def _validation_keys(s: dict) -> set[str]:
    return {k for k in s if k not in ANNOTATIONS and k not in _DEFS}


def _escape(name: str) -> str:
    return name.replace("~", "~0").replace("/", "~1")


def _types(s: dict) -> set[str]:
    t = s.get("type")
    if isinstance(t, str):
        return {t}
    if isinstance(t, list):
        return {x for x in t if isinstance(x, str)}
    return set()


def _widen(types: set[str]) -> set[str]:
    return types | {"integer"} if "number" in types else types


def _replace_type(t, old: str, new: str):
    if isinstance(t, str):
        return new if t == old else t
    out = [new if x == old else x for x in t]
    return list(dict.fromkeys(out))


def _type_of(v) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, int) or (isinstance(v, float) and v.is_integer()):
        return "integer"
    if isinstance(v, float):
        return "number"
    if isinstance(v, str):
        return "string"
    return "array" if isinstance(v, list) else "object"


def _admitted_types(s: dict) -> set[str] | None:
    """The JSON types a schema can match (integer counted as number too), or None if any."""
    if "const" in s or isinstance(s.get("enum"), list):
        vals = [s["const"]] if "const" in s else s["enum"]
        out = {_type_of(v) for v in vals}
    else:
        out = _types(s)
        if not out:
            return None
    return out | {"number"} if "integer" in out else (out | {"integer"} if "number" in out else out)


def _values_of(s) -> set[str] | None:
    if not isinstance(s, dict):
        return None
    if "const" in s:
        return {json.dumps(s["const"], sort_keys=True)}
    if isinstance(s.get("enum"), list):
        return {json.dumps(v, sort_keys=True) for v in s["enum"]}
    return None
