"""Helpers for tests, benchmarks and self-tests: process groups, routing, the transports' selftest. Never imported by the data path."""
