"""Helpers for tests, benchmarks and self-tests: process groups, routing, the transports' selftest, the plain torch MoE baseline (`baselines`), timing (`timing`). Never imported by the data path."""
