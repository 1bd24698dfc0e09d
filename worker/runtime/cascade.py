"""A model set's policy, pure: which frames a cascaded model runs on, and the one verdict of a frame (a single model
is a set of one: its verdict is the model's own).

A model with a cascade condition (`run_if_model`, `run_if_label`, `run_if_score`) runs only on the frames where
that earlier model ran and scored the label at or above the score; the others are skipped with the reason,
which the result carries. The frame's verdict: the first model's scores (what a single-model result carried), the
labels every model flagged, and the model that decided: the first that flagged the frame, else the last that
ran (each model that ran cleared it).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from worker.frames import ModelVerdict, Verdict


@dataclass(frozen=True)
class CascadeRule:
    """Run a model only where `model` scored `label` at or above `score`."""

    model: str
    label: str
    score: float

    def skip_reason(self, earlier: Mapping[str, ModelVerdict]) -> str:
        """Why the model does not run on a frame given the earlier models' verdicts on it; "" when it runs."""
        before = earlier.get(self.model)
        if before is None or before.verdict is None:
            return f"skipped: {self.model} did not run on this frame"
        got = before.verdict.scores.get(self.label, 0.0)
        if got >= self.score:
            return ""
        return f"skipped: {self.model} scored {self.label} {got:.4f} < {self.score:g}"


def combine(outputs: Sequence[ModelVerdict]) -> Verdict:
    """One verdict from every model's output on a frame, in the set's order (module docstring). A set of one gives
    its model's own verdict: `models` and `decided_by` stay empty, as a single model's result always had them."""
    if len(outputs) == 1 and outputs[0].verdict is not None:
        return outputs[0].verdict
    ran = [o for o in outputs if o.verdict is not None]
    if not ran:
        raise ValueError("combine: no model ran on the frame (the first model always does)")
    flagged: list[str] = []
    for o in ran:
        assert o.verdict is not None
        flagged.extend(label for label in o.verdict.flagged_labels if label not in flagged)
    deciding = next((o for o in ran if o.verdict is not None and o.verdict.flagged), ran[-1])
    first = ran[0].verdict
    assert first is not None
    return Verdict(scores=dict(first.scores), flagged_labels=tuple(flagged), detections=first.detections,
                   models=tuple(outputs), decided_by=deciding.model)


def describe_outputs(verdict: Verdict) -> tuple[str, ...]:
    """One line per model of a set (or per detector's boxes) for a person reading a check: what each found."""
    lines = []
    for o in verdict.models or ():
        if o.verdict is None:
            lines.append(f"{o.model}: {o.skipped}")
            continue
        found = _found(o.verdict) if o.verdict.detections or not o.detector else "no boxes"
        lines.append(f"{o.model}: {found}" + (" (decided)" if o.model == verdict.decided_by else ""))
    if not verdict.models and verdict.detections:
        lines.append(_found(verdict))
    return tuple(lines)


def _found(v: Verdict) -> str:
    if v.detections:
        boxes = ", ".join(f"{d.label} {d.score:.3f} at x={d.x:.0f} y={d.y:.0f} {d.width:.0f}x{d.height:.0f}"
                          for d in v.detections)
        return f"{len(v.detections)} box(es): {boxes}; flagged {', '.join(v.flagged_labels) or '-'}"
    scores = ", ".join(f"{label} {score:.4f}" for label, score in v.scores.items())
    return f"{scores}; flagged {', '.join(v.flagged_labels) or '-'}"
