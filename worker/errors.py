"""The root of the project's errors, so a caller can tell ours from a bug and an operator's fix from a crash.

`StreamferError` carries `setting`: the configuration key (or ACL, or credential) a user must change, where
there is one. `OperatorError` marks what no restart fixes (bad settings, credentials, ACLs, an unusable
model): the CLI prints its one-line message and exits 2, so a supervisor does not crash-loop on it.
Pure: no Kafka, no torch.
"""

from __future__ import annotations

EXIT_OPERATOR_ERROR = 2


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
