"""The Kafka edge: every librdkafka client of the worker and its tools, and every workaround for its behaviour.

- `client`: bootstrap and security properties, the properties the worker owns, making a client.
- `roles`: one factory per role for the tools' and the test kit's clients (frame producer, transactional output
  producer, results / dead-letter / frame readers, offsets reader, admin), each role's properties defined once.
- `wiring`: the worker's clients (`KafkaClients`) and the check of their settings at start-up.
- `consumer`: `FrameSource`, the consumer of the per-priority input topics (pause/resume, rebalances, commits): I/O
  over the pure `pauses` (the union of four pause sources), `redelivery` (offsets librdkafka delivers twice) and
  `schemagate` (a poll's steps of the schema hold).
- `committed`: pure policy: which assigned partitions wait for their committed offsets before they are read.
- `schemahold`: pure policy: framed frames waiting for their writer schema, per partition in order.
- `schemalookups`: the writer-schema lookups on a thread of their own, and the frames held for them.
- `registry`: the Schema Registry client.
- `membership`: the worker's place in its consumer group (static membership, fencing, leaving).
- `producer`: `ResultSink`, results and dead letters with delivery reports (idempotent or transactional);
  `outputstalls`: pure, which output partitions stopped acknowledging.
- `control`: the control topic's reader (outside the group) and writer; `rollout`: its rollout side (issue 69).
- `errors`: which client errors an operator must fix and which the client rides out.
- `access`: the ACLs the worker needs and the start-up probe for them.
- `topics`: creating the worker's topics.
"""
