"""`worker dlq show` and `worker dlq replay`: what the dead-letter topic holds, and publishing dead-lettered frames
again once their cause (a model, a setting, a topic limit) is fixed. See docs/operations.md.

`entries`: one dead letter parsed, which ones a command selects, reading topics, the replay ledger's records.
`show`: the counts and the newest dead letters. `replay`: the decisions and the transactional publisher. The
commands' functions are `worker.tools.dlq.show.show` and `worker.tools.dlq.replay.replay`; the names below are
re-exported for callers of the former single module.
"""

from worker.tools.dlq.entries import (
    LEDGER_SUFFIX,
    DeadLetterEntry,
    DeadLetterToolError,
    Selection,
    is_replayed,
    iso_ms,
    ledger_topic,
    parse_duration_ms,
    parse_entry,
    parse_time_ms,
    read_ledger,
    replay_selection,
)
from worker.tools.dlq.replay import (
    EXIT_REPLAY_FAILED,
    Original,
    ReplayFailed,
    ReplayItem,
    ReplayMessage,
    ReplayReport,
    expires,
    ledger_record,
    replay_message,
    skip_reason,
)
from worker.tools.dlq.show import DeadLetterSummary, entry_json, render_summary

__all__ = [
    "EXIT_REPLAY_FAILED", "LEDGER_SUFFIX", "DeadLetterEntry", "DeadLetterSummary", "DeadLetterToolError", "Original",
    "ReplayFailed", "ReplayItem", "ReplayMessage", "ReplayReport", "Selection", "entry_json", "expires",
    "is_replayed", "iso_ms", "ledger_record", "ledger_topic", "parse_duration_ms", "parse_entry", "parse_time_ms",
    "read_ledger", "render_summary", "replay_message", "replay_selection", "skip_reason",
]
