"""The JSON Schema of a TrainingRun document, for `mortalctl schema` and editors' YAML language servers.

Generated from the pydantic models, so the schema's descriptions are the fields' one documentation.
Use it in an editor with a first line such as
`# yaml-language-server: $schema=./trainingrun.schema.json`.
"""

from __future__ import annotations

from typing import Any

from mortal.specs.run import TrainingRun

SCHEMA_DIALECT = "https://json-schema.org/draft/2020-12/schema"


def json_schema() -> dict[str, Any]:
    """The TrainingRun schema (camelCase keys, as written in YAML), input mode: defaults are optional."""
    schema = TrainingRun.model_json_schema(by_alias=True, mode="validation")
    return {"$schema": SCHEMA_DIALECT, "$id": "mortal/v1/TrainingRun", **schema}
