"""Measurement: the EP benchmark, the trial worker subprocess and the fabric micro-benchmarks."""
