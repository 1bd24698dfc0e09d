"""The faults of the suite, one function each: `fault(lab, mode, scale) -> RunOutcome` (None when the fault
cannot be injected here, e.g. a broker restart against a broker the suite does not own).

Each function sets up a run, injects its fault while frames flow or wait, and returns the audit. They
assert nothing: the pytest tests assert on the outcome, the suite runner tabulates it.
"""

from __future__ import annotations

import os
import random
import signal
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from worker.config import KafkaSettings
from worker.frames import Priority, SourceRef

if TYPE_CHECKING:
    from confluent_kafka.admin import AdminClient

from .badinput import catalogue, mutations, oversized
from .harness import DEAD_LETTER, Lab, Outgoing, Run, RunOutcome, Sent, rss_bytes

# The broker's minimum session timeout; max.poll.interval.ms may not be below it.
MIN_SESSION_MS = 6000
# The worker's own group session and poll interval, which TEST_ENV shortens to 6 s: with default worker ids the SIGKILL
# row is the worker on its defaults, where a dynamic member's successor would wait out the 45 s session (also used
# by tests/integration/test_group_membership.py).
DEFAULT_MEMBERSHIP_ENV = {"WORKER_KAFKA_SESSION_TIMEOUT_MS": str(KafkaSettings().session_timeout_ms),
                          "WORKER_KAFKA_MAX_POLL_INTERVAL_MS": str(KafkaSettings().max_poll_interval_ms)}
# Group churn: at least this many leave-and-join cycles per run, however slowly workers start.
MIN_CHURNS = 3
# A restarted broker must be consumed from again within this long (the stated reconnect bound).
RECONNECT_BOUND_S = 30.0


@dataclass(frozen=True)
class Scale:
    backlog: int  # frames published up front for the kill, drain, model and outage faults
    rate_fps: float  # steady rate of the faults that inject while frames flow
    flow_s: float  # how long those publish


QUICK = Scale(backlog=600, rate_fps=100, flow_s=12)
FULL = Scale(backlog=1500, rate_fps=120, flow_s=25)


def _guarded(run: Run, body: Callable[[], None], **finish: object) -> RunOutcome:
    """Run the fault body; whatever happens, leave no worker process behind."""
    try:
        body()
        return run.finish(**finish)  # type: ignore[arg-type]
    except BaseException:
        run.abandon()
        raise


# -- no fault: the control row ---------------------------------------------------------------------------------
def baseline(lab: Lab, mode: str, scale: Scale) -> RunOutcome:
    run = Run(lab, "none (control)", mode)

    def body() -> None:
        run.feed(run.factory.frames(scale.backlog), wait=True)
        run.fleet.start("w0")

    return _guarded(run, body)


# -- process faults -----------------------------------------------------------------------------------------------
def sigkill(lab: Lab, mode: str, scale: Scale, seed: int | None = None) -> RunOutcome:
    """SIGKILL the worker at 20/50/80% progress: mid-batch, at a random moment, after produce before commit;
    each time the same command starts a new process at once, as a supervisor restarts one on the same host. With
    fixed or default worker ids (the worker's own `<hostname>-<slot>`: the restarted process takes the dead one's
    slot) it has the dead one's transactional id and fences its open transaction; with fresh ids it has a new one,
    and the transaction stays open until the broker aborts it, holding the committed offsets of its partitions.
    With default ids the group session is the worker's default too: the successor, a static member under the dead
    one's id, takes its place at once instead of waiting the session out."""
    run = Run(lab, "SIGKILL x3 (20/50/80%)", mode, env=DEFAULT_MEMBERSHIP_ENV if lab.worker_ids == "default" else None)
    seed = random.randrange(2**32) if seed is None else seed
    rng = random.Random(seed)
    run.notes["seed"] = seed  # of the random kill moment

    def random_moment(worker_id: str) -> str:
        time.sleep(rng.uniform(0.0, 0.3))
        return run.kill_now(worker_id)

    def body() -> None:
        run.feed(run.factory.frames(scale.backlog), wait=True)
        run.fleet.start("w0")
        phases = []
        for fraction, kill in ((0.2, run.kill_mid_batch), (0.5, random_moment), (0.8, run.kill_after_produce)):
            if not run.wait_progress(fraction):
                break
            if run.progress() >= 0.97:
                break  # finished before the kill could land: the run would prove nothing more
            at = run.progress()
            phases.append(f"{kill('w0')}@{at:.0%}")
            run.fleet.start("w0")
        run.notes["kills"] = phases

    return _guarded(run, body)


def kill_with_held_frame(lab: Lab, mode: str, scale: Scale) -> RunOutcome:
    """A deterministic kill between two batches of one partition that finish out of order: two earlier frames
    wait in the batcher (their shape's bucket is not full; bulk waits 1 s, and an idle runtime does not take
    them early: batching.release_when_idle off) while eight later frames of another shape fill a batch and run.
    The worker is SIGKILLed 0.3 s after that batch ran, before the held frames run. The committed offset
    cannot pass the held frames, so the next owner reads the eight again: exactly-once must not have committed
    their results ahead of their offsets."""
    run = Run(lab, "SIGKILL with an earlier frame held", mode,
              env={"WORKER_BATCHING_BULK_MAX_WAIT_MS": "1000", "WORKER_BATCHING_RARE_SHAPE_MIN_COUNT": "1",
                   "WORKER_BATCHING_PADDING_WASTE_MAX": "0", "WORKER_BATCHING_RELEASE_WHEN_IDLE": "false"})

    def body() -> None:
        run.fleet.start("w0")
        run.feed(run.factory.frames(3), wait=True)  # the worker is assigned and warm once these are done
        if not run.wait(run.caught_up, 120):
            return
        forwards = run.probe_dir / f"forwards.{run.fleet.pid('w0')}"
        before = len(forwards.read_text().split())

        def batches_run() -> list[int]:
            return [int(n) for n in forwards.read_text().split()[before:]]

        held = run.factory.frames(2, shape=(40, 40), priority=Priority.BULK, partition=0, jpeg_every=0)
        later = run.factory.frames(8, shape=(32, 32), priority=Priority.BULK, partition=0, jpeg_every=0)
        run.feed(held + later, wait=True)
        if not run.wait(lambda: len(later) in batches_run(), 30, interval_s=0.005):
            return
        time.sleep(0.3)  # its results are produced (and, if nothing holds them back, committed)
        run.notes["held_ran_before_kill"] = len(batches_run()) > 1
        run.kill_now("w0")
        run.fleet.start("w0")

    return _guarded(run, body)


def sigterm_drain(lab: Lab, mode: str, scale: Scale) -> RunOutcome:
    """SIGTERM with batches in flight: the worker drains, commits and leaves; a new one finds nothing to redo."""
    run = Run(lab, "SIGTERM drain", mode)
    run.zero_duplicates_expected = True

    def body() -> None:
        run.feed(run.factory.frames(scale.backlog), wait=True)
        run.fleet.start("w0")
        run.wait_progress(0.4)
        held = run.fleet.partitions("w0")
        started, signalled = time.monotonic(), time.time()
        rc = run.fleet.terminate("w0")
        # Down from the exit; the drain before it still answers the partitions.
        run.mark_fault(held, began=signalled)
        run.notes["drain_s"] = round(time.monotonic() - started, 1)
        run.notes["drain_rc"] = rc
        run.fleet.start("w0")

    return _guarded(run, body)


def zombie(lab: Lab, mode: str, scale: Scale) -> RunOutcome:
    """SIGSTOP one of two workers past its session and poll interval while the other takes over, then SIGCONT:
    the zombie's late output must be fenced (exactly-once) and the zombie must rejoin, not crash."""
    run = Run(lab, "zombie (SIGSTOP > poll interval)", mode,
              env={"WORKER_KAFKA_SESSION_TIMEOUT_MS": str(MIN_SESSION_MS),
                   "WORKER_KAFKA_MAX_POLL_INTERVAL_MS": str(MIN_SESSION_MS)})

    def body() -> None:
        frames = run.factory.frames(int(scale.rate_fps * scale.flow_s))
        run.fleet.start("w0")
        run.fleet.start("w1")
        run.feed(frames, rate_fps=scale.rate_fps)
        run.wait_progress(0.25)
        # Frozen with a batch inside the model: its results are ready the moment the zombie wakes up.
        probe = run.probe_dir / f"forward.{run.fleet.pid('w0')}"
        run.notes["stopped"] = "mid-batch" if run.wait(probe.exists, 15, interval_s=0.002) else "random"
        held = run.fleet.partitions("w0")
        run.fleet.signal("w0", signal.SIGSTOP)
        run.mark_fault(held)
        try:
            time.sleep(MIN_SESSION_MS / 1000 + 3)  # the fault: frozen past session timeout and poll interval
        finally:
            run.fleet.signal("w0", signal.SIGCONT)

    return _guarded(run, body)


# -- group churn --------------------------------------------------------------------------------------------------
def group_churn(lab: Lab, mode: str, scale: Scale, static: bool = True) -> RunOutcome:
    """Three workers; every few seconds one leaves (SIGTERM) and a new process joins, while frames flow. Static
    members (the default) leave the group on SIGTERM as dynamic ones do; `static` False turns membership dynamic."""
    run = Run(lab, "group churn" + ("" if static else " (dynamic members)"), mode,
              env=None if static else {"WORKER_KAFKA_STATIC_MEMBERSHIP": "false"})
    workers = ["w0", "w1", "w2"]

    def body() -> None:
        for w in workers:
            run.fleet.start(w)
        run.feed(run.factory.frames(int(scale.rate_fps * scale.flow_s)), rate_fps=scale.rate_fps)
        deadline = time.monotonic() + scale.flow_s
        i = 0
        while time.monotonic() < deadline or i < MIN_CHURNS:
            run.wait(lambda: False, 3.0)  # supervise for a few seconds, then churn
            worker_id = workers[i % len(workers)]
            # A process still loading its model has joined nothing yet: churn only members.
            run.wait(lambda wid=worker_id: run.fleet.is_up(wid), 60)
            held, signalled = run.fleet.partitions(worker_id), time.time()
            run.fleet.terminate(worker_id)
            run.mark_fault(held, began=signalled)  # down from its exit: the drain before it still answers
            run.fleet.start(worker_id)
            i += 1
        run.notes["churns"] = i

    return _guarded(run, body, timeout_s=240.0)


def sigkill_churn(lab: Lab, mode: str, scale: Scale, seed: int | None = None) -> RunOutcome:
    """Three workers while frames flow; every 2.5 to 5 s one of them that holds partitions is SIGKILLed and a new
    process takes its place (issue 13 found duplicates this way with a new worker id per process, "fresh" here: a
    partition whose committed offset a dead process's open transaction held was read again from its beginning by its
    next owner).
    Every other kill comes after produce, before commit (the broker frozen for a moment, see kill_after_produce),
    so a transaction carrying offsets is left open as a loaded CPU would leave it; the others at random moments.
    The flow lasts twice the scale's at half its rate, so kills land while the group works, not while it loads."""
    run = Run(lab, "SIGKILL churn (3 workers)", mode)
    seed = random.randrange(2**32) if seed is None else seed
    rng = random.Random(seed)
    run.notes["seed"] = seed
    workers = ["w0", "w1", "w2"]

    def body() -> None:
        for w in workers:
            run.fleet.start(w)
        if not run.wait(lambda: all(run.fleet.is_up(w) for w in workers), 120):
            run.notes["stuck"] = "the workers never started"
            return
        run.feed(run.factory.frames(int(scale.rate_fps * scale.flow_s)), rate_fps=scale.rate_fps / 2)
        deadline = time.monotonic() + 2 * scale.flow_s
        kills: list[str] = []
        while time.monotonic() < deadline or len(kills) < MIN_CHURNS:
            run.wait(lambda: False, rng.uniform(2.5, 5.0))  # supervise until the next kill
            # Kill a member holding partitions (its transaction may hold their offsets); a process still loading
            # its model has joined nothing yet.
            if not run.wait(lambda: any(run.fleet.partitions(w) for w in workers), 60):
                break
            victim = rng.choice([w for w in workers if run.fleet.partitions(w)])
            held = len(run.fleet.partitions(victim))
            phase = run.kill_after_produce(victim) if len(kills) % 2 == 0 else run.kill_now(victim)
            kills.append(f"{victim} holding {held}: {phase}")
            run.fleet.start(victim)
        run.notes["kills"] = kills

    return _guarded(run, body, timeout_s=240.0)


# -- broker faults --------------------------------------------------------------------------------------------------
def _broker_bounce(lab: Lab, mode: str, scale: Scale, name: str, kill: bool, outage_s: float,
                   env: dict[str, str] | None = None, backlog: bool = False) -> RunOutcome | None:
    if lab.broker is None or lab.broker.running() is None:
        return None
    run = Run(lab, name, mode, env=env)
    broker = lab.broker

    def body() -> None:
        if backlog:  # the worker holds fetched frames and produces into a full queue while the broker is away
            run.feed(run.factory.frames(scale.backlog * 2), wait=True)
            run.fleet.start("w0")
            run.wait_progress(0.2)
        else:  # frames keep coming (and queue in the feeder) while the broker is away
            run.fleet.start("w0")
            run.feed(run.factory.frames(int(scale.rate_fps * scale.flow_s)), rate_fps=scale.rate_fps)
            run.wait_progress(0.3)
        before_address = lab.bootstrap
        stopping = time.time()
        broker.stop(kill=kill)
        run.mark_fault(began=stopping)
        try:
            time.sleep(outage_s)
        finally:
            broker.start()
        up = time.monotonic()
        if lab.bootstrap != before_address:
            run.abort(f"the broker came back at {lab.bootstrap}, not at {before_address}, so no client can "
                      "reconnect: LocalKafka's restart did not keep its port")
            return
        before = run.watch.committed() or 0
        if run.wait(lambda: (run.watch.committed() or 0) > before or run.caught_up(), RECONNECT_BOUND_S):
            run.notes["resumed_after_s"] = round(time.monotonic() - up, 1)
        else:
            run.abort(f"no offset committed within {RECONNECT_BOUND_S:.0f} s of the broker's return (the stated "
                      "reconnect bound)")

    return _guarded(run, body)


def broker_restart(lab: Lab, mode: str, scale: Scale) -> RunOutcome | None:
    """The broker stops cleanly mid-stream and comes back on the same address: no operator action needed."""
    return _broker_bounce(lab, mode, scale, "broker restart (clean)", kill=False, outage_s=2.0)


def broker_kill9(lab: Lab, mode: str, scale: Scale) -> RunOutcome | None:
    """The broker is SIGKILLed mid-transaction (it recovers its logs on start) and comes back."""
    return _broker_bounce(lab, mode, scale, "broker kill -9", kill=True, outage_s=2.0)


def output_path_down(lab: Lab, mode: str, scale: Scale) -> RunOutcome | None:
    """A full output path: the broker is unreachable for 10 s while the worker holds a backlog, with a producer
    queue of 16 messages, so produce() hits a full queue: backpressure, and nothing lost."""
    return _broker_bounce(lab, mode, scale, "output path down 10 s (queue full)", kill=False, outage_s=10.0,
                          env={"WORKER_KAFKA_PRODUCER_OVERRIDES": "queue.buffering.max.messages=16"}, backlog=True)


def partitions_lost_mid_batch(lab: Lab, mode: str, scale: Scale) -> RunOutcome | None:
    """The broker freezes (SIGSTOP, so its address is kept) past the session timeout while a batch is inside
    the model: the worker loses its partitions and gets them back. The batch then finishes; its results
    belong to partitions this worker no longer held when they finished, so (exactly-once) they must not be
    committed, and nothing may crash."""
    broker = lab.pausable.running() if lab.pausable else None
    if broker is None:
        return None
    stall_s = 12.0
    run = Run(lab, "partitions lost mid-batch", mode, model="stall_model",
              env={"STREAMFER_REL_STALL_S": str(stall_s), "WORKER_KAFKA_SESSION_TIMEOUT_MS": str(MIN_SESSION_MS),
                   "WORKER_KAFKA_MAX_POLL_INTERVAL_MS": str(MIN_SESSION_MS)})

    def body() -> None:
        run.fleet.start("w0")
        run.feed(run.factory.frames(scale.backlog // 4, marked=(5,)), wait=True)
        stall = run.probe_dir / f"stall.{run.fleet.pid('w0')}"
        if not run.wait(stall.exists, 60, interval_s=0.01):
            run.notes["stuck"] = "the stalling batch never started"
            return
        os.kill(broker.pid, signal.SIGSTOP)
        run.mark_fault()
        try:
            time.sleep(MIN_SESSION_MS / 1000 + 2)  # the fault: the coordinator is silent past the session timeout
        finally:
            os.kill(broker.pid, signal.SIGCONT)

    return _guarded(run, body)


# -- cluster faults (three nodes, replication factor 3, min ISR 2) ---------------------------------------------------
# How long a killed node stays down, and how long two nodes stay down (no quorum, no ISR of 2: all writes stop).
NODE_OUTAGE_S = 10.0
QUORUM_OUTAGE_S = 20.0
CLUSTER_SESSION_MS = 45_000
# Commits must resume within this long of the nodes' return: longer than RECONNECT_BOUND_S, since a fenced
# node's partitions and coordinators move back and a stuck exactly-once producer is replaced (15 s) first.
CLUSTER_RESUME_BOUND_S = 60.0


def _cluster_admin(lab: Lab) -> AdminClient:
    from confluent_kafka.admin import AdminClient

    return AdminClient({"bootstrap.servers": lab.bootstrap, **(lab.broker.client_properties() if lab.broker else {})})


def _leader_of(lab: Lab, topic: str, partition: int = 0) -> int:
    return _cluster_admin(lab).list_topics(topic, timeout=10).topics[topic].partitions[partition].leader


def _group_coordinator(lab: Lab, group: str) -> int:
    admin = _cluster_admin(lab)
    return admin.describe_consumer_groups([group], request_timeout=10)[group].result(10).coordinator.id


def _nodes_down(lab: Lab, mode: str, scale: Scale, name: str, pick: Callable[[Run], list[int]],
                outage_s: float) -> RunOutcome | None:
    """Frames flow through a three-node cluster; the nodes `pick` names are SIGKILLed, stay down `outage_s`, and
    come back. The worker rides it out without a restart: nothing lost, exactly-once nothing duplicated."""
    broker = lab.broker
    if broker is None or broker.nodes != 3 or broker.running() is None:
        return None
    # The default session timeout a user gets (45 s), not the suite's 6 s: a SIGKILLed node stays the registered
    # leader of its partitions (the coordinators' too) until the controller fences it (broker.session.timeout.ms,
    # 9 s), so a 6 s session loses the group on every coordinator kill.
    run = Run(lab, name, mode, env={"WORKER_KAFKA_SESSION_TIMEOUT_MS": str(CLUSTER_SESSION_MS),
                                    "WORKER_KAFKA_MAX_POLL_INTERVAL_MS": str(CLUSTER_SESSION_MS)})

    def body() -> None:
        run.fleet.start("w0")
        run.feed(run.factory.frames(int(scale.rate_fps * scale.flow_s)), rate_fps=scale.rate_fps)
        run.wait_progress(0.3)
        nodes = pick(run)
        run.notes["killed_nodes"] = nodes
        for node in nodes:
            broker.stop_node(node, kill=True)
        run.mark_fault()
        try:
            run.wait(lambda: False, outage_s)  # the fault, while supervising the worker
        finally:
            broker.start(timeout_s=180)
        up = time.monotonic()
        before = run.watch.committed() or 0
        if run.wait(lambda: (run.watch.committed() or 0) > before or run.caught_up(), CLUSTER_RESUME_BOUND_S):
            run.notes["resumed_after_s"] = round(time.monotonic() - up, 1)
        else:
            run.abort(f"no offset committed within {CLUSTER_RESUME_BOUND_S:.0f} s of the nodes' return")

    return _guarded(run, body, timeout_s=240.0)


def leader_killed(lab: Lab, mode: str, scale: Scale) -> RunOutcome | None:
    """The leader of an input partition is SIGKILLed mid-stream (and of the results partitions it led)."""
    return _nodes_down(lab, mode, scale, "partition leader killed (3 nodes)",
                       lambda run: [_leader_of(lab, run.topics.realtime)], NODE_OUTAGE_S)


def group_coordinator_killed(lab: Lab, mode: str, scale: Scale) -> RunOutcome | None:
    """The node coordinating the worker's consumer group is SIGKILLed: commits and heartbeats move."""
    return _nodes_down(lab, mode, scale, "group coordinator killed (3 nodes)",
                       lambda run: [_group_coordinator(lab, run.topics.group)], NODE_OUTAGE_S)


def _transaction_coordinator(lab: Lab) -> int:
    """The leader of __transaction_state, which the broker makes for the first transactional producer: on a fresh
    cluster (at-least-once runs first) a throwaway one makes it."""
    admin = _cluster_admin(lab)
    if "__transaction_state" not in admin.list_topics(timeout=10).topics:
        from confluent_kafka import Producer

        Producer({"bootstrap.servers": lab.bootstrap, "transactional.id": f"make-txn-state-{time.time_ns()}",
                  **(lab.broker.client_properties() if lab.broker else {})}).init_transactions(60)
    return _leader_of(lab, "__transaction_state")


def transaction_coordinator_killed(lab: Lab, mode: str, scale: Scale) -> RunOutcome | None:
    """The leader of __transaction_state (one partition here: every transactional id's coordinator) is SIGKILLed
    mid-transaction. At-least-once has no transactions: the same node is killed as a control."""
    return _nodes_down(lab, mode, scale, "transaction coordinator killed (3 nodes)",
                       lambda run: [_transaction_coordinator(lab)], NODE_OUTAGE_S)


def two_nodes_down(lab: Lab, mode: str, scale: Scale) -> RunOutcome | None:
    """Two of three nodes down for 20 s: no controller quorum and fewer in-sync replicas than min.insync.replicas,
    so nothing can be written; the worker waits and resumes when they return."""
    def pick(run: Run) -> list[int]:
        leader = _leader_of(lab, run.topics.results)
        return [leader, 1 + leader % 3]

    return _nodes_down(lab, mode, scale, "two of three nodes down 20 s", pick, QUORUM_OUTAGE_S)


# -- model faults -------------------------------------------------------------------------------------------------
def slow_model(lab: Lab, mode: str, scale: Scale) -> RunOutcome:
    """Batches that take 8 s, longer than max.poll.interval.ms (6 s): no rebalance, and the lag drains to 0."""
    stall_s = 8.0
    run = Run(lab, "model stalls 8 s > poll interval 6 s", mode, model="stall_model",
              env={"STREAMFER_REL_STALL_S": str(stall_s), "WORKER_KAFKA_SESSION_TIMEOUT_MS": str(MIN_SESSION_MS),
                   "WORKER_KAFKA_MAX_POLL_INTERVAL_MS": str(MIN_SESSION_MS)})
    count = scale.backlog // 2
    # A tenth in (and, at full scale, six tenths in); the marked frames get results like the rest.
    stalls = (count // 10,) if scale is QUICK else (count // 10, count * 6 // 10)

    def body() -> None:
        run.feed(run.factory.frames(count, marked=stalls), wait=True)
        run.fleet.start("w0")
        run.faults_injected += len(stalls)

    outcome = _guarded(run, body)
    events = outcome.notes["events"]
    if events.get("revoked") or events.get("lost") or events.get("assigned", 0) > 1:
        outcome.notes["stuck"] = f"rebalanced while the model stalled: {events}"
    return outcome


def poison_model(lab: Lab, mode: str, scale: Scale) -> RunOutcome:
    """A model that raises on some inputs: only those frames are dead-lettered, the rest of their batch is scored."""
    run = Run(lab, "model raises on 1 in 10 frames", mode, model="poison_model")
    count = scale.backlog // 2
    marked = range(3, count, 10)

    def body() -> None:
        items = [it if it.sent.kind != "marked" else _expect(it, DEAD_LETTER)
                 for it in run.factory.frames(count, marked=marked)]
        run.feed(items, wait=True)
        run.fleet.start("w0")
        run.faults_injected += len(marked)

    return _guarded(run, body)


def _expect(item: Outgoing, expect: str) -> Outgoing:
    return Outgoing(item.topic, item.key, Sent(item.sent.kind, expect, item.sent.frame_id), item.record, item.raw)


# -- bad input ----------------------------------------------------------------------------------------------------
def bad_input(lab: Lab, mode: str, scale: Scale, seed: int = 0) -> RunOutcome:
    """Every kind of damaged message, and seeded mutations of valid ones, interleaved with good frames on the
    same partitions: each bad one dead-lettered with a reason, every good one scored."""
    run = Run(lab, "bad input (catalogue + mutations)", mode)
    bad = catalogue(seed) + mutations(40, seed)
    return _guarded(run, lambda: _interleave(run, bad))


def oversized_input(lab: Lab, mode: str, scale: Scale) -> RunOutcome:
    """Messages at the client's size limit, valid and not, between good frames."""
    run = Run(lab, "oversized input (~1 MB)", mode)
    return _guarded(run, lambda: _interleave(run, oversized()))


def _interleave(run: Run, bad: list) -> None:
    items: list[Outgoing] = []
    good = iter(run.factory.frames(len(bad) * 3))
    for i, b in enumerate(bad):
        items.extend(next(good) for _ in range(3))
        topic = run.topics.inputs[i % 3]
        items.append(Outgoing(topic, f"bad-{i}".encode(), Sent(b.kind, b.expect), raw=b.value))
    run.fleet.start("w0")
    run.feed(items, wait=True)
    run.faults_injected += len(bad)


# -- soak -------------------------------------------------------------------------------------------------------------
def soak(lab: Lab, mode: str, seconds: float, rate_fps: float = 100.0) -> RunOutcome:
    """A steady open-loop rate for `seconds`: p99 latency of the first and last thirds (from intended send
    time), and the worker's RSS growth after warm-up (the first third)."""
    run = Run(lab, f"soak {seconds:.0f} s @ {rate_fps:.0f} fps", mode, batch_sleep_ms=2)
    samples: list[tuple[float, int]] = []  # (seconds into the soak, RSS bytes)
    lags: list[int] = []

    def body() -> None:
        run.fleet.start("w0")
        run.feed(run.factory.frames(20), wait=True)  # wait for the worker to be assigned and warm
        run.wait(run.caught_up, 120)
        start = time.monotonic()
        feeder = run.feed(run.factory.frames(int(seconds * rate_fps)), rate_fps=rate_fps)
        pid = run.fleet.pid("w0")
        while feeder.is_alive():
            rss = rss_bytes(pid)
            if rss is not None:
                samples.append((time.monotonic() - start, rss))
            lag = run.watch.lag()
            if lag is not None:
                lags.append(lag)
            run.wait(lambda: not feeder.is_alive(), 1.0)
        run.notes["max_send_lag_ms"] = round(feeder.max_send_lag_s * 1000, 1)

    outcome = _guarded(run, body)
    outcome.notes["soak"] = soak_report(run, samples, lags, seconds)
    return outcome


def soak_report(run: Run, samples: list[tuple[float, int]], lags: list[int], seconds: float) -> dict:
    intended = {ref: t for f in run.feeders[1:] for ref, t in f.intended.items()}
    t0 = min(intended.values(), default=0.0)
    thirds: list[list[float]] = [[], [], []]
    for r in run.results:
        t = intended.get(SourceRef(r["source_topic"], r["source_partition"], r["source_offset"]))
        if t is not None:
            thirds[min(2, int((t - t0) / (seconds / 3)))].append(r["end_to_end_ms"])

    def pct(values: list[float], q: float) -> float | None:
        if not values:
            return None
        values = sorted(values)
        return round(values[min(len(values) - 1, int(q * len(values)))], 1)

    warm = [rss for t, rss in samples if t < seconds / 3]
    late = [rss for t, rss in samples if t >= seconds * 2 / 3]
    mib = 1024 * 1024
    baseline = max(warm) if warm else None
    growth = (max(late) - baseline) if (late and baseline) else None
    first, last = pct(thirds[0], 0.99), pct(thirds[2], 0.99)
    return {
        "results_per_third": [len(t) for t in thirds],
        "p50_ms": [pct(t, 0.5) for t in thirds],
        "p99_ms": [pct(t, 0.99) for t in thirds],
        "p999_ms": [pct(t, 0.999) for t in thirds],
        "p99_drift_ms": round(last - first, 1) if first is not None and last is not None else None,
        "rss_warm_mib": round(baseline / mib, 1) if baseline else None,
        "rss_end_mib": round(late[-1] / mib, 1) if late else None,
        "rss_growth_mib": round(growth / mib, 1) if growth is not None else None,
        "rss_median_first_last_mib": [round(statistics.median(warm) / mib, 1) if warm else None,
                                      round(statistics.median(late) / mib, 1) if late else None],
        "max_lag": max(lags, default=None),
    }


# The table's faults, in order; the ones that need the mode run in each mode asked for.
FAULTS: dict[str, Callable[[Lab, str, Scale], RunOutcome | None]] = {
    "none": baseline,
    "sigkill": sigkill,
    "kill-held-frame": kill_with_held_frame,
    "sigterm": sigterm_drain,
    "zombie": zombie,
    "churn": group_churn,
    "churn-dynamic": lambda lab, mode, scale: group_churn(lab, mode, scale, static=False),
    "sigkill-churn": sigkill_churn,
    "lost-mid-batch": partitions_lost_mid_batch,
    "broker-restart": broker_restart,
    "broker-kill9": broker_kill9,
    "output-down": output_path_down,
    "slow-model": slow_model,
    "poison-model": poison_model,
    "bad-input": bad_input,
    "oversized": oversized_input,
    "leader-killed": leader_killed,
    "group-coordinator-killed": group_coordinator_killed,
    "txn-coordinator-killed": transaction_coordinator_killed,
    "two-nodes-down": two_nodes_down,
}

# The faults that replace a worker process: the ones the runner repeats with each worker-id policy (WORKER_IDS),
# where the others keep one process per worker and its id does not matter.
REPLACE_WORKERS = ("sigkill", "kill-held-frame", "sigterm", "churn", "churn-dynamic", "sigkill-churn")

# Faults that need a three-node cluster of their own (Lab.with_own_cluster); skipped on any other lab.
CLUSTER_FAULTS = ("leader-killed", "group-coordinator-killed", "txn-coordinator-killed", "two-nodes-down")
