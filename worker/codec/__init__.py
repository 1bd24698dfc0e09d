"""Avro on the wire: frames and results (`schemas/*.avsc` are the source of truth).

- `schemas`: encode and decode frames and results, and building a result record.
- `resultwriter`: a result record's bytes written by hand, byte for byte what fastavro writes.
"""
