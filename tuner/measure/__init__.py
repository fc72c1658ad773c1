"""Measurement: the EP benchmark, the trial worker subprocess and the fabric micro-benchmarks."""

# the most timed calls, rounds, rotated inputs or chained forwards one benchmark takes (`bench ep/moe/knobs`, a
# `profile --plan`'s iters, repeats and compare_rounds): `bench moe --iters 100000000000000000000` was taken and ran
# practically forever. A million calls of 10 us is 10 s on a GPU (hours on a CPU)
COUNT_MAX = 1_000_000
