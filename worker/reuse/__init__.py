"""Verdict reuse: an unchanged frame is answered with its stream's last verdict.

- `policy`: per stream the reference frame and the reuse decision (pure, no clock).
- `thumbnail`: the small grayscale thumbnail and the change between two.
"""
