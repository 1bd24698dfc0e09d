"""The developer's and operator's tools around the worker, not stages of it: a local broker, publishing frames,
reading results back, the demo and its sample video, dead-letter inspection and replay, consumer lag. The
`worker` command (cli.py) and the test kit (worker.testing) call into them; no stage of the worker imports them."""
