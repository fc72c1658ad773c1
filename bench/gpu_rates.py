"""The rates a GPU reaches on the work the MoE layer's floors are made of: reading weights from HBM and bf16
tensor-core GEMMs (the floors of `moetune bench moe`, tuner/measure/moe.py `GPU_RATES`).

    python bench/gpu_rates.py [--work read|gemm|all] [--gbytes 1.21] [--gemm 8192] [--iters 20] [--batch 10]
                              [--warmup 10]

Lines, `<case> median p10 p90 <unit>`, over `--iters` samples, each the mean call of `--batch` calls queued back to
back between two CUDA events (the steady rate: no launch gap or ramp from idle in it; without a CUDA device the same
work on the CPU, timed with perf_counter: the scenarios' smoke runs, which check the plumbing only):
- `read-sum`: `sum` over a contiguous bf16 tensor of `--gbytes` GB (the qwen3-30b experts' 1.21 GB by default, far
  past the L2), fp32 accumulation; TB/s of bytes read.
- `read-gemv`: a batched GEMV over the same bytes as [128, rows, 2048] weights times one vector an expert; TB/s.
- `gemm-bf16`: `torch.mm` of two bf16 `--gemm`-square matrices; TFLOP/s (2 n^3 a call).
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable

import torch

from moetune.tuner.measure.stats import Summary


def timed(fn: Callable[[], object], iters: int, batch: int, warmup: int, cuda: bool) -> list[float]:
    """Seconds a call: `iters` samples, each `batch` calls back to back divided by `batch`."""
    for _ in range(warmup):
        fn()
    if cuda:
        torch.cuda.synchronize()
    out = []
    for _ in range(iters):
        if not cuda:
            t0 = time.perf_counter()
            for _ in range(batch):
                fn()
            out.append((time.perf_counter() - t0) / batch)
            continue
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        # one untimed call first: the GPU is busy when `a` is recorded, so the sample holds no launch gap or ramp
        # from idle (after the previous sample's sync the first timed call waited for its own launch)
        fn()
        a.record()
        for _ in range(batch):
            fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) / 1e3 / batch)
    return out


def line(case: str, rates: list[float], unit: str) -> str:
    s = Summary.of(rates)
    return f"{case} {s.median:.6g} {s.p10:.6g} {s.p90:.6g} {unit}"


def reads(gbytes: float, dev: str, t: Callable[[Callable[[], object]], list[float]]) -> list[str]:
    """read-sum and read-gemv over one bf16 tensor of `gbytes` GB shaped as 128 experts' [rows, 2048] weights."""
    experts, hidden = 128, 2048
    rows = max(1, round(gbytes * 1e9 / (2 * experts * hidden)))
    w = torch.randn(experts, rows, hidden, device=dev).to(torch.bfloat16)
    nbytes = w.numel() * w.element_size()
    out = [line("read-sum", [nbytes / s / 1e12 for s in t(lambda: w.sum(dtype=torch.float32))], "TB/s")]
    v = torch.randn(experts, hidden, 1, device=dev).to(torch.bfloat16)
    y = torch.empty(experts, rows, 1, device=dev, dtype=torch.bfloat16)
    return [*out, line("read-gemv", [nbytes / s / 1e12 for s in t(lambda: torch.bmm(w, v, out=y))], "TB/s")]


def gemm(n: int, dev: str, t: Callable[[Callable[[], object]], list[float]]) -> str:
    x, m = (torch.randn(n, n, device=dev).to(torch.bfloat16) for _ in range(2))
    o = torch.empty(n, n, device=dev, dtype=torch.bfloat16)
    return line("gemm-bf16", [2.0 * n ** 3 / s / 1e12 for s in t(lambda: torch.mm(x, m, out=o))], "TFLOP/s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", choices=("read", "gemm", "all"), default="all", help="which cases to measure")
    ap.add_argument("--gbytes", type=float, default=1.21, help="bytes the reads cover, in GB (1e9)")
    ap.add_argument("--gemm", type=int, default=8192, help="the GEMM's n (n x n times n x n)")
    ap.add_argument("--iters", type=int, default=20, help="samples a case")
    ap.add_argument("--batch", type=int, default=10, help="calls back to back in one sample")
    ap.add_argument("--warmup", type=int, default=10)
    a = ap.parse_args()
    if not (math.isfinite(a.gbytes) and 0 < a.gbytes <= 64) or a.gemm < 64 or a.iters < 1 or a.batch < 1 or a.warmup < 0:
        raise SystemExit("gpu_rates: --gbytes in (0, 64], --gemm >= 64, --iters >= 1, --batch >= 1, --warmup >= 0")
    cuda = torch.cuda.is_available()
    dev = "cuda" if cuda else "cpu"
    print("device", torch.cuda.get_device_name().replace(" ", "_") if cuda else "cpu")

    def t(fn: Callable[[], object]) -> list[float]:
        return timed(fn, a.iters, a.batch, a.warmup, cuda)

    if a.work in ("read", "all"):
        print(*reads(a.gbytes, dev, t), sep="\n")
    if a.work in ("gemm", "all"):
        print(gemm(a.gemm, dev, t))


if __name__ == "__main__":
    main()
