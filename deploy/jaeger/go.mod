// A module of its own for building Jaeger's all-in-one binary (build.sh); nothing here is imported by the worker.
module streamfer/deploy/jaeger

go 1.24
