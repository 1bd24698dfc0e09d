"""The micro-batcher: pure policy that turns polled frames into GPU batches. No Kafka, no torch; time comes
from an injected clock (the same clock, in seconds, as `Frame.received_at`). Not thread-safe: one loop owns it.

`MicroBatcher` (batcher.py) is the stage's one entry point; it decides nothing itself and hands each decision to
the module named for it:
  groups.py        the pending frames: per class, groups of one shape and lane; inside a group, tenants' turns
  lanes.py         the lanes, and which frames take the fallback lane
  sizing.py        a group's cap, trigger and due time: preferred sizes, byte and device-memory caps, cost model
  formation.py     what a released group's batch takes: overdue frames, the top-up, padding partners
  selection.py     which class's batch goes next: weights, the ordering and slack rules
  expiry.py        frames past their max_age_ms, set aside
  backpressure.py  classes_to_pause(), poll_room() and the hard cap
  batch.py         the `Batch` handed out, and the shape a frame is batched by

Guarantees and decisions, in the order the batcher applies them (the module deciding each in brackets):

Groups and lanes [groups, sizing, formation]. A frame joins the group of its class and batch shape
  (`batch_shape`): the model's fixed input (height, width) when the contract has one, since frames of any
  resolution become that same input (720p and 1080p frames for a 224x224 model share batches, and no batch is
  padded), else the frame's own height and width; with the frame's channels. A group is released
  - full: when it holds its *trigger* size: the largest preferred size (settings.preferred_batch_sizes plus the
    runner's CUDA-graph buckets) that fits its cap, else the cap itself; the cap is min(the class's
    max_batch_size, max_batch_bytes // frame tensor bytes), and on a GPU at most the largest batch device
    memory takes for the input the device runs (worker.devices.memory: what the devices take together, the
    executor splitting a batch larger than one device takes). Reason "full" when the trigger is the class's
    max_batch_size, "bytes" when the memory cap is what bounds it, else "preferred" (Triton: a batch of the
    largest preferred size goes at once);
  - deadline: when its oldest frame has waited its class's max_wait_ms. The batch takes every overdue frame
    (up to the cap) and is then topped up to the largest preferred size that holds them all and that the
    group (plus padding partners, below) can fill; when no preferred size fits in between, it takes all it
    can, and the runner pads it to its next bucket. One padded batch beats a 16+8+4+2+1 split, and no frame is
    ever left past its wait: while a group still has an overdue frame it stays due, so the caller draining
    pop_batch() gets every overdue frame in that same call sequence;
  - idle: pop_batch(idle=True), which the loop calls when no batch is running and its last poll took all the
    consumer had fetched: every group with a frame counts as due (a partial one leaves with reason "idle").
    Waiting for a fuller batch only saves time while the runtime is busy; on a backlog polls come back full and
    while a batch runs the next one fills, so batches still grow with the load.
  Padding ("padded" lane): a deadline batch short of its trigger may take frames of other shapes of the same
  class and channel count, closest pixel area first, padded to the largest height and width, while
  padded pixels / batch padded pixels <= padding_waste_max and the padded tensor stays <= max_batch_bytes (and,
  on a GPU, the batch within the memory policy's largest for the padded shape).
  Channels are never mixed. Partner frames leave before their own wait is up, which only shortens it.
Fallback lane [lanes]. A frame whose tensor alone exceeds max_batch_bytes runs alone (never dropped). A shape seen
  fewer than rare_shape_min_count times (this frame included) within rare_shape_window_ms goes to the fallback
  lane: due at once, in batches of up to fallback_max_batch_size frames of its class and shape, so an odd
  shape neither waits nor holds a common shape's batch back.
Classes [selection]. Each pop_batch() serves one class among those with a due batch, by smooth weighted round
  robin on the class weights (realtime first when all are due, since it weighs most), with two rules on top:
  - ordering: a less urgent class may go ahead of a more urgent due class only with frames that arrived
    before that class's oldest pending frame, so a realtime frame is never released after a bulk frame that
    arrived later while both are due;
  - slack: and only when no more urgent due class with a deadline (latency_budget_ms or max_age_ms) is
    at risk: backlogged (more than a batch pending, its oldest past its wait), or its oldest due frame would
    miss its budget or expire if the less urgent batch (predicted time, cost model) ran before its own.
  So under overload the model serves realtime first, then standard; bulk (no deadline) waits, and standard
  sheds (expires) before realtime. With slack to spare, weights share the device and nothing starves. Within a
  class, the due group with the oldest frame goes first. pop_batch(max_priority) considers only classes at
  least that urgent (the loop's reserved realtime slot).
Cost model [sizing] (optional, worker.batching.costmodel, learned from measured batches). Per group:
  - trigger: with adaptive_batch_size, the measured size with the most frames per device second (reason
    "cost"), within the group's cap (so within its class's max_batch_size), instead of the static trigger above;
  - cap: for standard and bulk, the largest size predicted to run within max_blocking_ms (reason "blocking"),
    so a realtime batch waits behind at most one such batch. The bound holds while realtime is present (a
    realtime frame pending, or one arrived within realtime_quiet_ms; 0: always): with no realtime traffic it
    would only cost throughput, so lower classes then fill to full size;
  - budget: a batch of a class with latency_budget_ms takes at most the frames its oldest frame can wait for
    and still finish within the budget (unless that frame is already past it: then throughput), and a partial
    group is due by the latest start that still meets the budget, if that comes before its max_wait_ms.
  Without a cost model or a measurement for the shape, the static sizes and waits apply.
Tenants [groups]. Inside a group, frames are taken overdue-first and, within each of these two tiers, by deficit
  round robin over tenants (quantum = settings.tenant_weights[tenant], default 1; state kept across
  batches). Bound: a tenant of weight w with n frames in a tier, among tenants of total weight W with frames
  in that tier, has all n taken within (ceil(n / w) + 1) * W frames taken from that tier. E.g. with 2 tenants
  of weight 1, one flooding 1000 frames and one sending 10, the 10 all leave in the first 32-frame batch.
  Overdue-first means a flood never holds another tenant's frame past its own wait when the caller drains.
Expiry [expiry]. A frame whose capture_ts_ms/1000 + class max_age_ms/1000 < clock() (max_age_ms 0: never) is never
  put in a batch: pop_batch() sets it aside and pop_expired() returns it.
Backpressure [backpressure] (classes_to_pause). A class pauses when its own pending frames or bytes reach its
  pending_share of max_pending_frames / max_pending_bytes (defaults: realtime 1, standard 0.5, bulk 0.25) and
  resumes below 75% of that; every class pauses when all classes together reach the caps, until they are below
  75% of them or realtime holds nothing (the others are bounded by their shares, so their frames alone never keep
  realtime paused). Less urgent classes therefore wait in Kafka (bulk has no deadline), never in realtime's room.
  poll_room() says how many frames the source may read so a still-reading class overshoots by one poll at most.
  When realtime is backlogged (at least its max_batch_size frames pending and its oldest past its max_wait_ms)
  bulk pauses, and standard too once more than 2 * that are pending; they resume only once
  realtime is drained (no frame pending). A standard backlog pauses nothing: bulk gets no model time while
  standard is at risk (the slack rule) and holds at most its share. The hysteresis matters:
  librdkafka drops a paused partition's prefetched messages (which also takes them out of the shared fetch
  queue ahead of realtime), so pausing on every late frame made all classes slower. A steady stream within
  capacity pauses nothing. Call it after dispatching what the runtime has room for, so that frames still due
  are the backlog.
  A frame's bytes are its batch tensor's share: at the model's fixed input size when it has one (a 1080p
  frame bound for 224x224 holds a 224x224 row), else at the frame's own size. poll_room() also bounds the
  frames read by the bytes left, at the largest frame seen so far; a frame's size is only known once read,
  so max_pending_bytes pauses reading but may be passed by one poll of frames larger than any before.
  add() raises BatcherFullError past twice max_pending_frames (except into an empty batcher): the source
  did not pause.
next_due() is the earliest of the groups' release times and the next expiry (a time <= now means now),
  so the caller can sleep until then.
Cost. add() and a release are O(log n) in the group's pending frames; pop_batch() and next_due() also scan
  the groups (one per class and shape in use), never the frames; discard() alone walks every frame.
"""

from worker.batching.batch import Batch, BatcherFullError, batch_shape
from worker.batching.batcher import MicroBatcher
from worker.batching.lanes import LANE_EXACT, LANE_FALLBACK, LANE_PADDED

__all__ = [
    "LANE_EXACT",
    "LANE_FALLBACK",
    "LANE_PADDED",
    "Batch",
    "BatcherFullError",
    "MicroBatcher",
    "batch_shape",
]
