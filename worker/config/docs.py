"""The configuration reference, generated from the fields: the tables of docs/configuration.md (between its
`<!-- reference:SECTION -->` markers; the prose around them is written by hand) and the JSON Schema of the TOML
file, schemas/worker-config.schema.json.

    python -m worker.config.docs           rewrite both from worker/config
    python -m worker.config.docs --check   exit 1 naming what is stale (tests/unit/test_config_docs.py runs it)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
import types
import typing
from pathlib import Path
from typing import Any, Literal

from worker.config.batching import BatchingSettings, ClassSettings
from worker.config.fields import FieldDoc, field_doc
from worker.config.settings import Settings

DOCS_PATH = Path("docs/configuration.md")
SCHEMA_PATH = Path("schemas/worker-config.schema.json")
COMMAND = "python -m worker.config.docs"
# Each section's table sits between these; a section without its marker pair in the docs is an error.
_MARKER = re.compile(r"(<!-- reference:(?P<key>[a-z_.]+) [^\n]*-->\n)(?P<body>.*?)(<!-- /reference:(?P=key) -->)",
                     re.S)
CLASSES_KEY = "batching.classes"


def _top_level_settings() -> list[str]:
    hints = typing.get_type_hints(Settings)
    return [f.name for f in dataclasses.fields(Settings) if not dataclasses.is_dataclass(hints[f.name])]


def section_types() -> dict[str, type]:
    """The sections of the TOML file ([kafka], [batching], ...) by name, in declaration order."""
    hints = typing.get_type_hints(Settings)
    return {f.name: hints[f.name] for f in dataclasses.fields(Settings) if dataclasses.is_dataclass(hints[f.name])}


def _fields(cls: type) -> list[tuple[dataclasses.Field[Any], Any]]:
    hints = typing.get_type_hints(cls)
    return [(f, hints[f.name]) for f in dataclasses.fields(cls)]


def _default(f: dataclasses.Field[Any]) -> Any:
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return f.default


def shown_value(value: Any) -> str:
    """A default as the docs show it: TOML's spelling, in backticks; "empty" for an empty string."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return f"{value:g}" if isinstance(value, float) else str(value)
    if isinstance(value, str):
        return f"`{value}`" if value else "empty"
    if isinstance(value, tuple | list):
        return "`[" + ", ".join(json.dumps(v) for v in value) + "]`"
    if isinstance(value, dict):
        return "`{" + ", ".join(f"{k} = {json.dumps(v)}" for k, v in value.items()) + "}`"
    raise TypeError(f"no docs spelling for a default of type {type(value).__name__}")


def _choices(hint: Any) -> tuple[str, ...]:
    args = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
    return tuple(str(c) for a in args if typing.get_origin(a) is Literal for c in typing.get_args(a))


def _range(hint: Any, entry: FieldDoc) -> str:
    choices = _choices(hint)
    if choices and typing.get_origin(hint) is Literal:
        return ", ".join(f"`{c}`" for c in choices)
    return entry.range_text()


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def section_table(cls: type) -> str:
    """One section's reference table: every field that is not a table of its own."""
    rows = ["| field | default | range | meaning |", "|---|---|---|---|"]
    for f, hint in _fields(cls):
        if dataclasses.is_dataclass(hint):
            continue
        entry = field_doc(f)
        default = entry.shown_default or shown_value(_default(f))
        rows.append(f"| `{f.name}` | {_cell(default)} | {_cell(_range(hint, entry))} | {_cell(entry.doc)} |")
    return "\n".join(rows) + "\n"


def setting_table(name: str) -> str:
    """A top-level setting that is not a section of fields (`models`: a table of [model]-like tables)."""
    f = next(f for f in dataclasses.fields(Settings) if f.name == name)
    entry = field_doc(f)
    rows = ["| field | default | range | meaning |", "|---|---|---|---|",
            f"| `{name}` | {_cell(entry.shown_default or shown_value(_default(f)))} | {_cell(entry.range)} | "
            f"{_cell(entry.doc)} |"]
    return "\n".join(rows) + "\n"


def classes_table() -> str:
    """[batching.realtime], [batching.standard], [batching.bulk]: one table, a default per class."""
    classes = [(f.name, _default(f)) for f, hint in _fields(BatchingSettings) if hint is ClassSettings]
    names = " / ".join(name for name, _ in classes)
    rows = [f"| field | defaults ({names}) | range | meaning |", "|---|---|---|---|"]
    for f, hint in _fields(ClassSettings):
        entry = field_doc(f)
        defaults = " / ".join(shown_value(getattr(value, f.name)) for _, value in classes)
        rows.append(f"| `{f.name}` | {defaults} | {_cell(_range(hint, entry))} | {_cell(entry.doc)} |")
    return "\n".join(rows) + "\n"


def reference_tables() -> dict[str, str]:
    """Every generated table by its marker key: each section's name, and batching.classes."""
    tables = {name: section_table(cls) for name, cls in section_types().items()}
    tables[CLASSES_KEY] = classes_table()
    tables.update({name: setting_table(name) for name in _top_level_settings()})
    return tables


def render_docs(text: str) -> str:
    """`text` (docs/configuration.md) with every marked table replaced by the generated one. ValueError when a
    table has no marker pair, or a marker names no table, so a new section cannot go undocumented."""
    tables = reference_tables()
    found = [m.group("key") for m in _MARKER.finditer(text)]
    missing, unknown = sorted(set(tables) - set(found)), sorted(set(found) - set(tables))
    if missing or unknown:
        raise ValueError(f"{DOCS_PATH}: reference markers missing for {missing}, unknown for {unknown}; each table "
                         f"sits between <!-- reference:KEY (...) --> and <!-- /reference:KEY -->")
    return _MARKER.sub(lambda m: m.group(1) + tables[m.group("key")] + m.group(4), text)


def _type_schema(hint: Any, entry: FieldDoc | None) -> dict[str, Any]:
    bounds = {} if entry is None else {k: v for k, v in (("minimum", entry.ge), ("exclusiveMinimum", entry.gt),
                                                         ("maximum", entry.le), ("exclusiveMaximum", entry.lt))
                                       if v is not None}
    origin = typing.get_origin(hint)
    if hint is Any:
        return {}
    if hint is bool:
        return {"type": "boolean"}
    if hint is int:
        return {"type": "integer", **bounds}
    if hint is float:
        return {"type": "number", **bounds}
    if hint is str:
        return {"type": "string"}
    if origin is Literal:
        return {"enum": list(typing.get_args(hint))}
    if origin is tuple and dataclasses.is_dataclass(typing.get_args(hint)[0]):
        # A set of tables, each under its own name in the file ([models.<name>]).
        return {"type": "object", "additionalProperties": _type_schema(typing.get_args(hint)[0], None)}
    if origin is tuple:
        return {"type": "array", "items": _type_schema(typing.get_args(hint)[0], None)}
    if origin is dict:
        return {"type": "object", "additionalProperties": _type_schema(typing.get_args(hint)[1], None)}
    if origin in (typing.Union, types.UnionType):
        return {"anyOf": [_type_schema(a, entry) for a in typing.get_args(hint)]}
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return _object_schema(hint)
    raise TypeError(f"no JSON Schema for the setting type {hint}")


def _json_default(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {k: _json_default(v) for k, v in dataclasses.asdict(value).items()}
    if isinstance(value, tuple | list):
        return [_json_default(v) for v in value]
    return value


def _object_schema(cls: type) -> dict[str, Any]:
    properties: dict[str, Any] = {}
    for f, hint in _fields(cls):
        entry = field_doc(f)
        extra = _range(hint, entry) if typing.get_origin(hint) is not Literal else ""
        description = entry.doc + (f" (range: {extra})" if extra else "")
        properties[f.name] = {"description": description, **_type_schema(hint, entry)}
        default = _default(f)
        if default is not dataclasses.MISSING and not dataclasses.is_dataclass(hint):
            properties[f.name]["default"] = _json_default(default)
    schema: dict[str, Any] = {"type": "object", "additionalProperties": False, "properties": properties}
    if cls.__doc__ and not cls.__doc__.startswith(cls.__name__ + "("):  # a docstring, not the dataclass signature
        schema["description"] = " ".join(cls.__doc__.split())
    return schema


def json_schema() -> dict[str, Any]:
    """The JSON Schema (2020-12) of the TOML file (`worker run --config`); environment variables set the same
    fields. Enumerations list the declared spelling; the loader also takes them in any case."""
    schema = _object_schema(Settings)
    return {"$schema": "https://json-schema.org/draft/2020-12/schema",
            "title": "streamfer worker configuration (the TOML file of `worker run --config`)",
            "description": f"Generated by `{COMMAND}` from worker/config; do not edit by hand.", **schema}


def schema_text() -> str:
    return json.dumps(json_schema(), indent=2, ensure_ascii=False) + "\n"


def stale(root: Path) -> list[str]:
    """The generated files under `root` that differ from what the fields give now."""
    out = []
    docs = (root / DOCS_PATH).read_text(encoding="utf-8")
    if render_docs(docs) != docs:
        out.append(str(DOCS_PATH))
    schema = root / SCHEMA_PATH
    if not schema.is_file() or schema.read_text(encoding="utf-8") != schema_text():
        out.append(str(SCHEMA_PATH))
    return out


def write(root: Path) -> list[str]:
    """Rewrite the stale generated files under `root`; returns those written."""
    written = stale(root)
    docs = root / DOCS_PATH
    docs.write_text(render_docs(docs.read_text(encoding="utf-8")), encoding="utf-8")
    (root / SCHEMA_PATH).write_text(schema_text(), encoding="utf-8")
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=COMMAND, description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if a generated file is stale")
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[2],
                        help="the checkout holding docs/ and schemas/ (default: this one)")
    args = parser.parse_args(argv)
    if args.check:
        found = stale(args.root)
        for path in found:
            print(f"{path}: stale; run `{COMMAND}` and commit the result", file=sys.stderr)
        return 1 if found else 0
    for path in write(args.root):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
