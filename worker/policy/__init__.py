"""Per-tenant verdict policy (issue 66), pure: no Kafka, no torch.

- `verdicts`: a policy compiled into per-tenant tables; a frame's verdict (allow, review, flag) and its labels.
"""
