"""The JSON documents every program writes: schema.json, its checks, and the atomic write.

``schema.json`` (next to the package) describes the default run's document at the top level and
the other programs' documents under ``$defs`` (``ladder_document``, ``tp_document``,
``vllm_document``); a run validates
its own document before writing it, so a file in ``bench/results`` always matches the schema.
"""

from __future__ import annotations

import json
import math
from importlib import resources
from pathlib import Path
from typing import Any

from .stats import BenchError

SCHEMA_VERSION = 1


def load_schema() -> dict[str, Any]:
    text = resources.files("bsr_bench").joinpath("schema.json").read_text("utf-8")
    schema: dict[str, Any] = json.loads(text)
    return schema


def _check_finite(obj: Any, where: str = "$") -> None:
    if isinstance(obj, float) and not math.isfinite(obj):
        raise BenchError(f"non-finite number at {where}")
    if isinstance(obj, dict):
        for k, v in obj.items():
            _check_finite(v, f"{where}.{k}")
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            _check_finite(v, f"{where}[{i}]")


def validate(doc: dict[str, Any], definition: str | None = None) -> None:
    """Raise :class:`BenchError` unless ``doc`` holds no NaN/inf and satisfies schema.json.

    Args:
        doc: the document.
        definition: ``None`` for the default run's document (the schema's top level), else the
            name of a document under ``$defs`` (``ladder_document``, ``tp_document``,
            ``vllm_document``).
    """
    import jsonschema

    _check_finite(doc)
    schema = load_schema()
    if definition is not None:
        schema = {
            "$schema": schema["$schema"],
            "$defs": schema["$defs"],
            "$ref": f"#/$defs/{definition}",
        }
    try:
        jsonschema.validate(doc, schema)
    except jsonschema.ValidationError as exc:
        path = "/".join(str(x) for x in exc.absolute_path)
        raise BenchError(
            f"{definition or 'bench'} JSON does not match schema.json at /{path}: {exc.message}"
        ) from exc


def write_json(doc: dict[str, Any], path: Path) -> None:
    """Write ``doc`` to ``path`` whole or not at all (a temporary file renamed over it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=2, allow_nan=False) + "\n", "utf-8")
    tmp.replace(path)
