"""What every settings module shares: the error, the enumerated types, and `setting`, which keeps a field's
description, range and unit next to the field, where docs/configuration.md and the JSON Schema are generated from
(`python -m worker.config.docs`)."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from worker.errors import OperatorError

ENV_PREFIX = "WORKER_"
# The enumerated settings: checked once, when settings load; the rest of the code trusts them.
DeliveryMode = Literal["at_least_once", "exactly_once"]
Precision = Literal["fp32", "fp16", "bf16", "int8"]
Engine = Literal["auto", "torch", "onnxruntime"]
LogFormat = Literal["text", "json"]
LogLevel = Literal["DEBUG", "INFO", "WARNING", "ERROR"]
_SETTING_RE = re.compile(r"^[a-z_]+\.[a-z_.]+$")


class ConfigError(OperatorError, ValueError):
    """Raised when settings are invalid; the message names each bad field and what it accepts.

    Each problem starts with the setting it is about (`section.field: ...`); `setting` is the first one's."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        first = problems[0].split(":", 1)[0].strip() if problems else ""
        super().__init__("invalid worker configuration:\n  - " + "\n  - ".join(problems),
                         setting=first if _SETTING_RE.match(first) else None)


@dataclass(frozen=True)
class FieldDoc:
    """A setting's reference entry. `ge`/`gt`/`le`/`lt`: bounds that do not depend on another setting; `validate`
    enforces them with no check of their own (tests/unit/test_config_docs.py holds the two to each other). `range`
    says in words what they cannot (a bound set by another setting); `hint` what a bound's error and the docs'
    range column add to the bounds (what 0 means, why the limit); `shown_default` replaces a default computed at
    start-up (the worker id)."""

    doc: str
    unit: str = ""
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    range: str = ""
    hint: str = ""
    shown_default: str = ""

    def bounds_text(self) -> str:
        """The numeric bounds with the unit: 1..4096 frames, >= 0 ms, (0, 1], [0, 1); empty without bounds."""
        low, high = self.ge if self.ge is not None else self.gt, self.le if self.le is not None else self.lt
        if low is not None and high is not None and self.gt is None and self.lt is None:
            text = f"{_num(low)}..{_num(high)}"
        elif low is not None and high is not None:
            text = f"{'[' if self.gt is None else '('}{_num(low)}, {_num(high)}{']' if self.lt is None else ')'}"
        elif low is not None:
            text = f"{'>=' if self.gt is None else '>'} {_num(low)}"
        elif high is not None:
            text = f"{'<=' if self.lt is None else '<'} {_num(high)}"
        else:
            return ""
        return f"{text} {self.unit}".strip()

    def range_text(self) -> str:
        """What the docs' range column shows: the bounds, then `range` and `hint` in words."""
        bounds = self.bounds_text()
        if bounds:
            return "; ".join(t for t in (bounds, self.range, self.hint) if t)
        return f"{self.range} ({self.unit})" if self.range and self.unit else self.range or self.unit

    def bound_problem(self, name: str) -> str:
        """The problem a value outside the bounds gets: the setting, the bounds and the hint."""
        return f"{name}: must be {self.bounds_text()}" + (f" ({self.hint})" if self.hint else "")

    def holds(self, value: float) -> bool:
        """Whether `value` is within the numeric bounds."""
        return ((self.ge is None or value >= self.ge) and (self.gt is None or value > self.gt)
                and (self.le is None or value <= self.le) and (self.lt is None or value < self.lt))


def _num(x: float) -> str:
    return f"{x:g}" if isinstance(x, float) else str(x)


def setting(default: Any = dataclasses.MISSING, *, doc: str,
            default_factory: Callable[[], Any] | Any = dataclasses.MISSING, unit: str = "",
            ge: float | None = None, gt: float | None = None, le: float | None = None, lt: float | None = None,
            range: str = "", hint: str = "", shown_default: str = "") -> Any:
    """A dataclass field whose metadata is its reference entry (FieldDoc): what the docs and JSON Schema show."""
    meta = {"doc": FieldDoc(doc=doc, unit=unit, ge=ge, gt=gt, le=le, lt=lt, range=range, hint=hint,
                            shown_default=shown_default)}
    if default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def field_doc(f: dataclasses.Field[Any]) -> FieldDoc:
    """The field's reference entry; a field declared without `setting` is a mistake the docs test names."""
    entry = f.metadata.get("doc")
    if not isinstance(entry, FieldDoc):
        raise TypeError(f"setting {f.name} is declared without worker.config.fields.setting(doc=...)")
    return entry
