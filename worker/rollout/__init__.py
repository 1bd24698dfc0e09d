"""Model rollouts through the control topic (issue 69): the desired model set, the swap between batches, shadow and
canary scoring. Pure (no Kafka, no torch): the loader of a model is injected; the Kafka side is
worker/kafka/rollout.py."""
