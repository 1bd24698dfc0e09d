"""Which partitions to read next: pure policy, no Kafka, no torch.

- `priority`: pause less urgent classes while a more urgent class has a backlog in Kafka.
- `fairness`: within a class, read every backlogged partition at the same pace.
"""
