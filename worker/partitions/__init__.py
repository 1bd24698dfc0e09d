"""What the worker keeps per assigned partition: pure policy, no Kafka, no torch.

- `assignment`: the partitions owned and their epochs (the one place that decides whether work is stale).
- `offsets`: done offsets per partition -> the commit watermark.
- `donemeta`: offsets done beyond a held commit point, compactly, and their bounded commit-metadata text.
- `lifetime`: `PartitionState`, the one verb (`drop_partitions`) every holder of per-partition state answers to.
- `dedup`: a window of recent frame identities per partition -> repeated frames.
"""
