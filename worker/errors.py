"""The root of the project's errors, so a caller can tell ours from a bug and an operator's fix from a crash.

`StreamferError` carries `setting`: the configuration key (or ACL, or credential) a user must change, where
there is one. `OperatorError` marks what no restart fixes (bad settings, credentials, ACLs, an unusable
model): the CLI prints its one-line message and exits 2, so a supervisor does not crash-loop on it. `StartError`:
anything else that failed while the runtime started, one line naming what failed, exit 70.
Pure: no Kafka, no torch.
"""

from __future__ import annotations

EXIT_OPERATOR_ERROR = 2
# An unexpected error (a bug, ours or a library's) while the runtime starts, in `worker run` or `worker check-model`:
# no setting fixes it, and a supervisor or script can tell it from 1 (check-model: an image got no score) and from 2.
# 70 is sysexits.h's EX_SOFTWARE.
EXIT_INTERNAL_ERROR = 70


class StreamferError(Exception):
    """An error of this project; `setting` names what to change, where one thing can fix it."""

    def __init__(self, message: str, setting: str | None = None) -> None:
        super().__init__(message)
        self.setting = setting

    @property
    def message(self) -> str:
        return str(self.args[0]) if self.args else ""


class OperatorError(StreamferError):
    """The worker cannot run until an operator changes configuration, credentials, ACLs or the model."""


class StartError(StreamferError):
    """An unexpected error while the runtime started (loading, warming up or calibrating the models): the message
    names what failed in one line; the original error is its cause (the traceback goes to the debug log)."""
