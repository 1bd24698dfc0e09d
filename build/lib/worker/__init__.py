"""streamfer: a Kafka-driven streaming inference worker for video moderation."""

__version__ = "0.1.0"
