"""The gathering max-pool backward kernel's block sizes, timed in CUDA graphs at ResNet-50's stem (b256)."""
import itertools, sys, torch, torch.nn.functional as F
from tr_hydra.ops import maxpool as mp
torch.manual_seed(0)
N = int(sys.argv[1]) if len(sys.argv) > 1 else 256
x = torch.randn(N, 64, 112, 112, device="cuda", dtype=torch.bfloat16).relu().to(memory_format=torch.channels_last)
y, idx = F.max_pool2d(x, 3, 2, 1, return_indices=True)
off = mp.indices_to_offsets(idx, 112, 3, 2, 1)
g = torch.randn_like(y)
out = torch.empty_strided(x.shape, mp._grad_strides(g, x.shape), dtype=g.dtype, device="cuda")
ref = torch.ops.aten.max_pool2d_with_indices_backward(g, x, [3, 3], [2, 2], [1, 1], [1, 1], False, idx)

def timed(fn, reps=20):
    fn(); torch.cuda.synchronize()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        gr = torch.cuda.CUDAGraph()
        with torch.cuda.graph(gr):
            for _ in range(reps): fn()
    ts = []
    for _ in range(5):
        a, b = torch.cuda.Event(True), torch.cuda.Event(True)
        a.record(); gr.replay(); b.record(); torch.cuda.synchronize(); ts.append(a.elapsed_time(b) / reps)
    return sorted(ts)[2]

# the HBM copy rate in the same run: a device-to-device copy of the output's size
big = torch.empty_like(out); t_copy = timed(lambda: big.copy_(out))
print(f"copy of {out.numel()*2/1e6:.0f} MB: {t_copy:.3f} ms ({2*out.numel()*2/t_copy/1e9:.2f} TB/s read+write)")
print(f"aten max_pool2d_with_indices_backward: {timed(lambda: torch.ops.aten.max_pool2d_with_indices_backward(g, x, [3, 3], [2, 2], [1, 1], [1, 1], False, idx)):.3f} ms")
# Inductor's own backward (indices rebuilt from offsets), compiled alone
def inductor_bwd(g, off):
    i = mp.offsets_to_indices(off, 112, 3, 2, 1)
    return torch.ops.aten.max_pool2d_with_indices_backward(g, x, [3, 3], [2, 2], [1, 1], [1, 1], False, i)
cb = torch.compile(inductor_bwd, dynamic=False)
r2 = cb(g, off); print(f"Inductor's backward, compiled alone: {timed(lambda: cb(g, off)):.3f} ms, equal: {torch.equal(r2, ref)}")
res = []
for bw, bc, nw in itertools.product((8, 16, 32, 64), (32, 64), (2, 4, 8)):
    mp.BLOCK_W, mp.BLOCK_C, mp.NUM_WARPS = bw, bc, nw
    out.zero_(); mp.gather_backward_launch(g, off, out, 3, 2, 1); torch.cuda.synchronize()
    ok = torch.equal(out, ref)
    t = timed(lambda: mp.gather_backward_launch(g, off, out, 3, 2, 1))
    res.append((t, bw, bc, nw, ok))
for t, bw, bc, nw, ok in sorted(res)[:8] + [r for r in res if (r[1], r[2], r[3]) == (16, 64, 4)]:
    print(f"BLOCK_W={bw:3d} BLOCK_C={bc:3d} warps={nw}: {t:.3f} ms  equal={ok}  {(out.numel()*2 + g.numel()*2 + off.numel())/t/1e9:.2f} TB/s of the least traffic")
