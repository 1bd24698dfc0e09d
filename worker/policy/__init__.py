"""Per-tenant verdict policy (issue 66), pure: no Kafka, no torch.

- `verdicts`: a policy compiled into per-tenant tables; a frame's verdict (allow, review, flag) and its labels.
- `judge`: the policy in force, a new one taken at the next batch boundary (or refused, with the reason).
"""
