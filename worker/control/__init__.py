"""The control topic, pure (issue 66; the form issue 69's rollouts extend): its records, and the state a worker and
`worker policy` derive from reading it (the last record per key). The Kafka I/O is worker/kafka/control.py."""
