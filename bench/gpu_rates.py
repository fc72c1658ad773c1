"""The rates a GPU reaches on the work the MoE layer's floors are made of: reading weights from HBM and bf16
tensor-core GEMMs (the floors of `moetune bench moe`, tuner/measure/moe.py `GPU_RATES`).

    python bench/gpu_rates.py [--gbytes 1.21] [--gemm 8192] [--iters 50] [--warmup 10]

Cases, one line each, `<case> median p10 p90 <unit>` over per-call CUDA-event timings (without a CUDA device the same
work on the CPU, timed with perf_counter: the scenario's smoke run, which checks the plumbing only):
- `read-sum`: `torch.sum` over a contiguous bf16 tensor of `--gbytes` GB (the qwen3-30b experts' 1.21 GB by default,
  far past the L2), fp32 accumulation; TB/s of bytes read.
- `read-gemv`: a batched GEMV over the same bytes as [128, rows, 2048] weights times one vector an expert; TB/s.
- `gemm-bf16`: `torch.mm` of two bf16 `--gemm`-square matrices; TFLOP/s (2 n^3 a call).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def timed(fn, iters: int, warmup: int, cuda: bool) -> list[float]:
    """Seconds a call, each call between its own CUDA events (the device drained before the first)."""
    for _ in range(warmup):
        fn()
    if not cuda:
        out = []
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
        return out
    torch.cuda.synchronize()
    out = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) / 1e3)
    return out


def line(case: str, rates: list[float], unit: str) -> str:
    v = sorted(rates)
    q = statistics.quantiles(v, n=10, method="inclusive") if len(v) > 1 else [v[0]] * 9
    return f"{case} {statistics.median(v):.4f} {q[0]:.4f} {q[-1]:.4f} {unit}"


def reads(gbytes: float, dev: str, iters: int, warmup: int, cuda: bool) -> list[str]:
    """read-sum and read-gemv over one bf16 tensor of `gbytes` GB shaped as 128 experts' [rows, 2048] weights."""
    experts, hidden = 128, 2048
    rows = max(1, round(gbytes * 1e9 / (2 * experts * hidden)))
    w = torch.randn(experts, rows, hidden, device=dev).to(torch.bfloat16)
    nbytes = w.numel() * w.element_size()
    s = timed(lambda: w.sum(dtype=torch.float32), iters, warmup, cuda)
    out = [line("read-sum", [nbytes / t / 1e12 for t in s], "TB/s")]
    v = torch.randn(experts, hidden, 1, device=dev).to(torch.bfloat16)
    y = torch.empty(experts, rows, 1, device=dev, dtype=torch.bfloat16)
    s = timed(lambda: torch.bmm(w, v, out=y), iters, warmup, cuda)
    return [*out, line("read-gemv", [nbytes / t / 1e12 for t in s], "TB/s")]


def gemm(n: int, dev: str, iters: int, warmup: int, cuda: bool) -> str:
    x, m = (torch.randn(n, n, device=dev).to(torch.bfloat16) for _ in range(2))
    o = torch.empty(n, n, device=dev, dtype=torch.bfloat16)
    s = timed(lambda: torch.mm(x, m, out=o), iters, warmup, cuda)
    return line("gemm-bf16", [2.0 * n ** 3 / t / 1e12 for t in s], "TFLOP/s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gbytes", type=float, default=1.21, help="bytes the reads cover, in GB (1e9)")
    ap.add_argument("--gemm", type=int, default=8192, help="the GEMM's n (n x n times n x n)")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=10)
    a = ap.parse_args()
    if a.gbytes <= 0 or a.gemm < 64 or a.iters < 1 or a.warmup < 0:
        raise SystemExit("gpu_rates: --gbytes > 0, --gemm >= 64, --iters >= 1 and --warmup >= 0")
    cuda = torch.cuda.is_available()
    dev = "cuda" if cuda else "cpu"
    print("device", torch.cuda.get_device_name().replace(" ", "_") if cuda else "cpu")
    for ln in [*reads(a.gbytes, dev, a.iters, a.warmup, cuda), gemm(a.gemm, dev, a.iters, a.warmup, cuda)]:
        print(ln)


if __name__ == "__main__":
    main()
