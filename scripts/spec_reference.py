"""Writes docs/spec-reference.md, the TrainingRun reference, from the spec's JSON Schema (`mortalctl schema`).

    python scripts/spec_reference.py --write   # regenerate the page after a spec field or description changes
    python scripts/spec_reference.py           # print it

The schema is generated from the pydantic models in specs/, whose field descriptions are each field's one
documentation: this page only lays them out, one table per object, in the order a spec's YAML nests them.
tests/test_docs.py fails when the checked-in page differs from what this prints.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from mortal.specs import json_schema

PAGE = Path(__file__).resolve().parents[1] / "docs" / "spec-reference.md"
HEADER = """# TrainingRun spec reference

Every field of a `TrainingRun` document, as `mortalctl apply` reads it (camelCase keys, as written in YAML).
Generated from the spec's JSON Schema (`mortalctl schema`) by `python scripts/spec_reference.py --write`:
do not edit it by hand; the descriptions live in `specs/`. A field left out takes its default; `status` is
written by the controller and ignored by apply.
"""
BOUNDS = (
    ("minimum", ">="),
    ("exclusiveMinimum", ">"),
    ("maximum", "<="),
    ("exclusiveMaximum", "<"),
    ("minLength", "length >="),
    ("minItems", "items >="),
)


def definition_name(schema: dict[str, Any]) -> str | None:
    """The $defs entry a schema refers to (directly or as pydantic's single allOf), else None."""
    if "$ref" in schema:
        return schema["$ref"].rsplit("/", 1)[-1]
    if len(schema.get("allOf", [])) == 1:
        return definition_name(schema["allOf"][0])
    return None


def type_text(schema: dict[str, Any]) -> str:
    """A field's type in words, with a link to the object it holds and its bounds."""
    name = definition_name(schema)
    if name:
        return f"[{name}](#{name.lower()})"
    if "anyOf" in schema:
        return " or ".join(type_text(option) for option in schema["anyOf"])
    if "const" in schema:
        return f"`{json.dumps(schema['const'])}`"
    if "enum" in schema:
        return "one of " + ", ".join(f"`{value}`" for value in schema["enum"])
    kind = schema.get("type", "any")
    if kind == "array":
        text = f"list of {type_text(schema.get('items', {}))}"
    elif kind == "object" and isinstance(schema.get("additionalProperties"), dict):
        text = f"map of string to {type_text(schema['additionalProperties'])}"
    else:
        text = schema.get("format", kind) if kind == "string" else kind
    bounds = [f"{sign} {schema[key]}" for key, sign in BOUNDS if key in schema]
    return " ".join([text, *bounds])


def cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def children(schema: dict[str, Any]) -> list[dict[str, Any]]:
    """The schemas a field's type is made of: a union's options, a list's items, a map's values."""
    found = [schema]
    for option in schema.get("anyOf", []) + schema.get("allOf", []):
        found += children(option)
    for key in ("items", "additionalProperties"):
        if isinstance(schema.get(key), dict):
            found += children(schema[key])
    return found


def object_paths(schema: dict[str, Any]) -> dict[str, list[str]]:
    """Each object definition and the YAML paths where it appears, in the order a document nests them."""
    definitions = schema["$defs"]
    paths: dict[str, list[str]] = {}

    def visit(properties: dict[str, Any], prefix: str) -> None:
        for field, field_schema in properties.items():
            for part in children(field_schema):
                name = definition_name(part)
                if not name:
                    continue
                path = prefix + field + ("[]" if field_schema.get("type") == "array" else "")
                first = name not in paths
                paths.setdefault(name, []).append(path)
                if first and "properties" in definitions[name]:
                    visit(definitions[name]["properties"], path + ".")

    visit(schema["properties"], "")
    return paths


def section(name: str, definition: dict[str, Any], paths: list[str]) -> list[str]:
    lines = [f"## {name}"] + (["", "At " + ", ".join(f"`{path}`" for path in paths) + "."] if paths else [])
    if definition.get("description"):
        lines += ["", cell(definition["description"])]
    if "enum" in definition:
        return lines + ["", "One of " + ", ".join(f"`{value}`" for value in definition["enum"]) + ".", ""]
    required = set(definition.get("required", []))
    lines += ["", "| field | type | default | description |", "|---|---|---|---|"]
    for field, field_schema in definition.get("properties", {}).items():
        default = "required" if field in required else f"`{json.dumps(field_schema.get('default'))}`"
        if field not in required and "default" not in field_schema:
            default = ""
        lines.append(
            f"| `{field}` | {cell(type_text(field_schema))} | {cell(default)} | "
            f"{cell(field_schema.get('description', ''))} |"
        )
    return lines + [""]


def render() -> str:
    schema = json_schema()
    root = {key: schema[key] for key in ("description", "properties", "required") if key in schema}
    lines = [HEADER, *section("TrainingRun", root, [])]
    for name, paths in object_paths(schema).items():
        lines += section(name, schema["$defs"][name], paths)
    return "\n".join(lines).rstrip() + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--write", action="store_true", help=f"write {PAGE.name} instead of printing it")
    args = parser.parse_args()
    if args.write:
        PAGE.write_text(render())
    else:
        print(render(), end="")


if __name__ == "__main__":
    main()
