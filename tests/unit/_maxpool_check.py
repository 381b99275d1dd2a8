"""Run by test_maxpool.py in a subprocess with TRITON_INTERPRET=1 (or directly on a GPU): the
gathering backward kernel against PyTorch's max_pool2d backward."""
from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from tr_hydra.ops import maxpool as mp


def main(device: str) -> int:
    torch.manual_seed(0)
    cases = [((2, 5, 13, 11), (3, 2, 1), True), ((2, 70, 9, 20), (3, 2, 1), True), ((3, 4, 8, 8), (2, 2, 0), False),
             ((2, 3, 9, 10), (3, 1, 1), True), ((1, 2, 7, 7), (5, 3, 2), False), ((1, 3, 6, 6), (3, 3, 0), True)]
    dtypes = [torch.float32] + ([torch.bfloat16, torch.float16] if device == "cuda" else [])
    bad = []
    for (shape, (k, s, p), cl) in cases:
        for dt in dtypes:
            x = torch.randn(shape, device=device).relu().to(dt)
            if cl:
                x = x.to(memory_format=torch.channels_last)
            x.requires_grad_()
            y, idx = F.max_pool2d(x, k, s, p, return_indices=True)
            g = torch.randn_like(y)
            (ref,) = torch.autograd.grad(y, x, g)
            off = mp.indices_to_offsets(idx, shape[-1], k, s, p)
            out = torch.empty_strided(shape, mp._grad_strides(g, shape), dtype=dt, device=device)
            mp.gather_backward_launch(g, off, out, k, s, p)
            err = (out.float() - ref.float()).abs().max().item()
            tol = 1e-6 if dt == torch.float32 else 1e-2 * max(1.0, ref.float().abs().max().item())
            if err > tol or out.stride() != ref.stride() and cl:
                bad.append((shape, (k, s, p), cl, dt, err, out.stride(), ref.stride()))
    if bad:
        print("mismatch", bad)
        return 1
    print("ok")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "cuda"))
