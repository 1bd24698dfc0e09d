"""Worker bugs the fault suite found that are still open, one constant each: the xfail reason of the tests
that show them (strict: they fail the run as soon as a fix lands, so the marker is removed with the fix) and
the notes of the suite runner's table. docs/reliability.md has the reproductions, and the bugs already fixed."""

EOS_HANGS_AFTER_BROKER_RESTART = (
    "worker bug (exactly-once): after a broker restart ResultSink.commit_transaction blocks for good inside "
    "librdkafka's send_offsets_to_transaction/commit_transaction (their timeout is not honoured when the group "
    "coordinator went away: librdkafka issues #5456, #5511); the loop stops, SIGTERM cannot interrupt the "
    "C call, and nothing watches the loop's liveness")


# Which runs of the suite show which bug, for the runner's table: (fault key, mode) -> (tag, reason).
BY_RUN = {
    (fault, "exactly_once"): ("eos-hang-after-broker-restart", EOS_HANGS_AFTER_BROKER_RESTART)
    for fault in ("broker-restart", "broker-kill9", "output-down")
}
