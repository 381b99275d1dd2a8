import json, os, sys, torch, torch.nn.functional as F
torch.backends.cudnn.benchmark = True
dev = "cuda"; dt = torch.bfloat16
N = int(sys.argv[1]) if len(sys.argv) > 1 else 512
x4 = torch.randn(N, 4, 32, 32, device=dev, dtype=dt).contiguous(memory_format=torch.channels_last); x4[:, 3] = 0
x3 = x4[:, :3]
w = torch.randn(64, 3, 3, 3, device=dev, dtype=torch.float32, requires_grad=True)
g = torch.randn(N, 64, 32, 32, device=dev, dtype=dt).contiguous(memory_format=torch.channels_last)

def conv3(x, w): return F.conv2d(x[:, :3], w.to(dt), padding=1)
def conv8(x, w): return F.conv2d(F.pad(x, (0,0,0,0,0,4)), F.pad(w.to(dt), (0,0,0,0,0,5)), padding=1)
def patches(x, K=32):
    xp = F.pad(x[:, :3], (1, 1, 1, 1))
    t = torch.cat([xp[:, :, i:i+32, j:j+32] for i in range(3) for j in range(3)], 1)
    return F.pad(t, (0, 0, 0, 0, 0, K - 27)).contiguous(memory_format=torch.channels_last)
def wmat(w, K=32): return F.pad(w.permute(0, 2, 3, 1).reshape(64, 27), (0, K - 27)).to(dt)
def im2col_conv(x, w): return F.conv2d(patches(x), wmat(w)[:, :, None, None])
def im2col_mm(x, w):
    p = patches(x).permute(0, 2, 3, 1).reshape(-1, 32)
    return (p @ wmat(w).t()).view(x.shape[0], 32, 32, 64).permute(0, 3, 1, 2)

ref = conv3(x4, w.detach()).float()
res = {}
def bench(name, f):
    def step():
        out = f(x4, w); out.backward(g); return out
    s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3): out = step(); w.grad = None
    torch.cuda.current_stream().wait_stream(s)
    err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
    gr = torch.cuda.CUDAGraph()
    w.grad = None
    with torch.cuda.graph(gr):
        for _ in range(20): step()
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ts = []
    for _ in range(5):
        e0.record(); gr.replay(); e1.record(); torch.cuda.synchronize(); ts.append(e0.elapsed_time(e1) / 20)
    # forward alone
    gf = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.stream(s):
        for _ in range(3): f(x4, w)
    torch.cuda.current_stream().wait_stream(s)
    with torch.no_grad():
        with torch.cuda.graph(gf):
            for _ in range(20): f(x4, w)
    tf = []
    for _ in range(5):
        e0.record(); gf.replay(); e1.record(); torch.cuda.synchronize(); tf.append(e0.elapsed_time(e1) / 20)
    res[name] = {"fwd_wgrad_ms": sorted(ts)[2], "fwd_ms": sorted(tf)[2], "rel_err": err}
    print(name, res[name], flush=True)
import traceback
for name, f in [("conv3", conv3), ("conv8", conv8), ("im2col_conv", im2col_conv), ("im2col_mm", im2col_mm)]:
    for nm, fn in ((name, f), (name + "_compiled", torch.compile(f, dynamic=False))):
        try: bench(nm, fn)
        except Exception: traceback.print_exc()
json.dump(res, open(os.path.join(os.environ.get("OUT", "."), f"cifar_stem_b{N}.json"), "w"), indent=1)
