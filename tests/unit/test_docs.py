"""The configuration reference documents every setting that exists, and nothing that does not."""

import dataclasses
import re
from pathlib import Path

from worker.config import Settings

DOCS = Path(__file__).resolve().parents[2] / "docs"


def _fields(cls, prefix=""):
    for f in dataclasses.fields(cls):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if dataclasses.is_dataclass(default):
            yield from _fields(type(default), f"{prefix}{f.name}.")
        else:
            yield f.name


def test_every_setting_is_documented():
    text = (DOCS / "configuration.md").read_text()
    documented = set(re.findall(r"^\| `([a-z0-9_]+)` \|", text, flags=re.M))
    sections = [(section.name, section.default_factory()) for section in dataclasses.fields(Settings)]
    # `models` (a model set: [models.<name>] tables of [model]'s fields) is a setting of its own.
    existing = {name for n, default in sections
                for name in (_fields(type(default)) if dataclasses.is_dataclass(default) else [n])}
    assert existing - documented == set(), "settings missing from docs/configuration.md"
    assert documented - existing == set(), "docs/configuration.md documents settings that do not exist"
