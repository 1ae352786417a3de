"""One causal FlashAttention-4 backward (the peer, torch) for Nsight Compute, on the same
problem as gpu_backward_profile.py (bf16, 8 heads, D 128, 131072 tokens per batch):

    ncu --kernel-name regex:FlashAttentionBackward --launch-skip 1 --launch-count 1 \\
        python3 tests/scripts/fa4_backward_profile.py [n]

Runs forward + backward three times (the first compiles); nothing is timed here."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks"))

import torch  # noqa: E402
from flash_attn.cute import flash_attn_func  # noqa: E402

import workloads as W  # noqa: E402

n = int(sys.argv[1]) if len(sys.argv) > 1 else 32768
b = W.batch_for(n)
g = torch.Generator(device="cuda").manual_seed(0)
q, k, v, do = (torch.randn((b, n, W.HEADS, W.HEAD_DIM), generator=g, device="cuda",
                           dtype=torch.bfloat16) for _ in range(4))
for t in (q, k, v):
    t.requires_grad_(True)
for _ in range(3):
    o = flash_attn_func(q, k, v, causal=True)
    o = o[0] if isinstance(o, tuple) else o
    torch.autograd.grad(o, (q, k, v), do)
torch.cuda.synchronize()
print("done causal", n, b)
