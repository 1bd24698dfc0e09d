"""What the worker keeps per assigned partition: pure policy, no Kafka, no torch.

- `assignment`: the partitions owned and their epochs (the one place that decides whether work is stale).
- `offsets`: done offsets per partition -> the commit watermark.
- `dedup`: a window of recent frame identities per partition -> repeated frames.
"""
