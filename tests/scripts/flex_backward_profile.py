"""One FlexAttention (FA4 backend) backward, the peer of the masked workloads, for Nsight
Compute, on the problem of gpu_backward_profile.py (bf16, 8 heads, D 128, 131072 tokens per
batch; the mask's metadata from benchmarks/workloads.py, as bench_total.py builds it):

    ncu --kernel-name regex:BackwardSm90 --launch-skip 1 --launch-count 1 \\
        python3 tests/scripts/flex_backward_profile.py [mask] [n]

Builds the block mask once, then runs forward + backward three times (the first compiles);
nothing is timed here."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks"))

import torch  # noqa: E402
from torch.nn.attention.flex_attention import create_block_mask, flex_attention  # noqa: E402

import workloads as W  # noqa: E402

mask = sys.argv[1] if len(sys.argv) > 1 else "shared_prompt"
n = int(sys.argv[2]) if len(sys.argv) > 2 else 8192
dev = "cuda"
L, b = W.seq_len(mask, n), W.batch_for(n)
md = W.metadata_for(mask, n)
mm, mb = W.torch_mask_mods(mask, n, md, torch, dev)
bm = torch.compile(create_block_mask)(mb, None if md is None else b, None, L, L, device=dev)
bm.mask_mod = mm      # the attention kernel's mask_mod (the same mask, constant width)
g = torch.Generator(device=dev).manual_seed(0)
q, k, v, do = (torch.randn((b, W.HEADS, L, W.HEAD_DIM), generator=g, device=dev,
                           dtype=torch.bfloat16) for _ in range(4))
for t in (q, k, v):
    t.requires_grad_(True)
fn = torch.compile(flex_attention)
for _ in range(3):
    o = fn(q, k, v, block_mask=bm, kernel_options={"BACKEND": "FLASH"})
    torch.autograd.grad(o, (q, k, v), do)
torch.cuda.synchronize()
print("done", mask, n, b)
