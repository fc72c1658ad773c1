"""Drive the megakernel for ncu: build the layer for S tokens, run `--calls` forwards (routing + persistent kernel).

    ncu --clock-control none --kernel-name regex:'k_experts|k_logits|k_topk' --launch-skip 3 --launch-count 3 \
        python bench/megakernel_profile.py --tokens 1
"""

from __future__ import annotations

import argparse

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=1)
    ap.add_argument("--calls", type=int, default=3)
    ap.add_argument("--config", default="")
    a = ap.parse_args()
    from moetune.runtime.megakernel import MegakernelConfig, MegakernelMoE
    from moetune.runtime.shapes import get_model

    mk = MegakernelMoE(get_model("qwen3-30b"), max_tokens=a.tokens, config=MegakernelConfig.parse(a.config))
    x = torch.randn(a.tokens, mk.model.hidden, device="cuda").to(torch.bfloat16)
    for _ in range(a.calls):
        mk.forward(x)
    torch.cuda.synchronize()
    mk.check()


if __name__ == "__main__":
    main()
