# Probe: BatchNorm+ReLU whose backward takes ReLU's mask from the convolution's output (y) instead of
# reading the ReLU's output (z) again. A: the model as it is; B: bn1 of every block and the stem's
# BN+ReLU through the custom function. Both compiled by Inductor (default mode), fwd+bwd captured in
# one CUDA graph by hand, timed interleaved. Also: each mode profiled (every kernel), gradients compared.
import json, os, sys, time
import torch, torch.nn as nn, torch.nn.functional as F
import torchvision

OUT = os.environ.get("OUT", "/tmp")
torch.backends.cudnn.benchmark = True
dev = "cuda"
MODEL = os.environ.get("MODEL", "cifar")
B = int(os.environ.get("BATCH", "512"))


class _BNReLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, weight, bias, eps):
        yf = y.to(torch.promote_types(y.dtype, torch.float32))
        var, mean = torch.var_mean(yf, dim=(0, 2, 3), correction=0)
        rstd = torch.rsqrt(var + eps)
        scale = weight * rstd
        shift = bias - mean * scale
        z = torch.relu(yf * scale[None, :, None, None] + shift[None, :, None, None]).to(y.dtype)
        ctx.save_for_backward(y, weight, bias, mean, rstd)
        ctx.mark_non_differentiable(mean, var)
        return z, mean, var

    @staticmethod
    def backward(ctx, dz, _dm, _dv):
        y, weight, bias, mean, rstd = ctx.saved_tensors
        yf = y.to(torch.promote_types(y.dtype, torch.float32))
        scale = weight * rstd
        shift = bias - mean * scale
        c = lambda v: v[None, :, None, None]
        # ReLU's mask from y, as the forward computed it (4 reads: Inductor keeps it inside its users)
        d = torch.where(yf * c(scale) + c(shift) > 0, dz.to(yf.dtype), 0.0)
        m = y.numel() // y.shape[1]
        xhat = (yf - c(mean)) * c(rstd)
        dbias = d.sum((0, 2, 3))
        dweight = (d * xhat).sum((0, 2, 3))
        dy = c(scale) * (d - c(dbias / m) - xhat * c(dweight / m))
        return dy.to(y.dtype), dweight, dbias, None


def bn_relu(bn: nn.BatchNorm2d, y):
    if not bn.training:
        return F.relu(bn(y))
    z, mean, var = _BNReLU.apply(y, bn.weight, bn.bias, bn.eps)
    n = y.numel() // y.shape[1]
    with torch.no_grad():
        bn.running_mean.lerp_(mean, bn.momentum)
        bn.running_var.lerp_(var * (n / (n - 1)), bn.momentum)
        bn.num_batches_tracked.add_(1)
    return z


def basic_forward(self, x):
    idt = x if self.downsample is None else self.downsample(x)
    out = bn_relu(self.bn1, self.conv1(x))
    out = self.bn2(self.conv2(out))
    return F.relu(out + idt)


def bottleneck_forward(self, x):
    idt = x if self.downsample is None else self.downsample(x)
    out = bn_relu(self.bn1, self.conv1(x))
    out = bn_relu(self.bn2, self.conv2(out))
    out = self.bn3(self.conv3(out))
    return F.relu(out + idt)


def resnet_forward(self, x):
    x = bn_relu(self.bn1, self.conv1(x))
    x = self.maxpool(x)
    x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
    return self.fc(torch.flatten(self.avgpool(x), 1))


def build(swap):
    torch.manual_seed(0)
    if MODEL == "cifar":
        m = torchvision.models.resnet18(num_classes=10)
        m.conv1 = nn.Conv2d(3, 64, 3, 1, 1, bias=False)
        m.maxpool = nn.Identity()
        res = 32
    else:
        m = torchvision.models.resnet50(num_classes=1000)
        res = 224
    if swap:
        import types
        m.forward = types.MethodType(resnet_forward, m)
        for mod in m.modules():
            if isinstance(mod, torchvision.models.resnet.BasicBlock):
                mod.forward = types.MethodType(basic_forward, mod)
            if isinstance(mod, torchvision.models.resnet.Bottleneck):
                mod.forward = types.MethodType(bottleneck_forward, mod)
    return m.to(dev).to(memory_format=torch.channels_last), res


def make_step(model, x, t, options=None):
    cm = torch.compile(model, options=options) if options else torch.compile(model)

    def step():
        with torch.autocast("cuda", torch.bfloat16):
            loss = F.cross_entropy(cm(x), t)
        loss.backward()
        return loss
    return step


results = {"model": MODEL, "batch": B}
ncls = 10 if MODEL == "cifar" else 1000
steps = {}
VARIANTS = {"A_native": (False, None), "B_bnrelu": (True, None),
            "C_bnrelu_r8": (True, {"realize_reads_threshold": 8}), "D_native_r8": (False, {"realize_reads_threshold": 8})}
for name in os.environ.get("VARIANTS", "A_native,B_bnrelu").split(","):
    swap, options = VARIANTS[name]
    model, res = build(swap)
    torch.manual_seed(1)
    x = torch.randn(B, 3, res, res, device=dev).to(memory_format=torch.channels_last)
    t = torch.randint(0, ncls, (B,), device=dev)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    step = make_step(model, x, t, options)
    t0 = time.time()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    compile_s = time.time() - t0
    # gradients of one step from fresh grads, for the comparison (state after warm-up differs only in BN stats)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step()
    torch.cuda.synchronize()
    steps[name] = (model, g, step, x, t)
    results.setdefault("compile_s", {})[name] = compile_s
    print(name, "compiled+captured", round(compile_s, 1), "s", flush=True)

# gradients: one eager step of the same weights for reference? compare A vs B after zeroing grads, same BN stats
def one_grad(name):
    model, g = steps[name][:2]
    for p in model.parameters():
        p.grad.zero_()
    g.replay(); torch.cuda.synchronize()
    return [p.grad.clone().float() for p in model.parameters()]

names = list(steps)
ga = one_grad(names[0])
for other in names[1:]:
    gb = one_grad(other)
    rel = [((a - b).norm() / a.norm().clamp_min(1e-30)).item() for a, b in zip(ga, gb)]
    print(f"grad rel diff {names[0]} vs {other} (bf16): max {max(rel):.3g} median {sorted(rel)[len(rel) // 2]:.3g}", flush=True)

# timing, interleaved
times = {k: [] for k in steps}
for rep in range(7):
    for name, (model, g, *_keep) in steps.items():
        for _ in range(10):
            g.replay()
        torch.cuda.synchronize()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        n = 100
        e0.record()
        for _ in range(n):
            g.replay()
        e1.record(); torch.cuda.synchronize()
        times[name].append(e0.elapsed_time(e1) / n)
for k, v in times.items():
    v = sorted(v)
    print(f"{k}: median {v[len(v)//2]:.4f} ms/step  min {v[0]:.4f} max {v[-1]:.4f}  img/s {B / v[len(v)//2] * 1000:,.0f}")
results["ms_per_step"] = times
a = sorted(times[names[0]])[3]
for other in names[1:]:
    print(f"{other} / {names[0]} speed: {a / sorted(times[other])[3]:.4f}x")

# profile: every kernel
from torch.profiler import profile, ProfilerActivity
prof_out = {}
for name, (model, g, *_keep) in steps.items():
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(20):
            g.replay()
        torch.cuda.synchronize()
    ks = {}
    for ev in prof.key_averages():
        if ev.device_type == torch.autograd.DeviceType.CUDA or getattr(ev, "self_device_time_total", 0) > 0:
            dt = getattr(ev, "self_device_time_total", None) or getattr(ev, "self_cuda_time_total", 0)
            ks[ev.key] = (dt / 20 / 1000.0, ev.count / 20)
    prof_out[name] = sorted(((k, round(v[0], 5), v[1]) for k, v in ks.items()), key=lambda r: -r[1])
    tot = sum(r[1] for r in prof_out[name])
    tri = sum(r[1] for r in prof_out[name] if r[0].startswith("triton"))
    ntri = sum(r[2] for r in prof_out[name] if r[0].startswith("triton"))
    print(f"{name}: device {tot:.3f} ms/step, triton {tri:.3f} ms in {ntri:.0f} kernels")
results["profile"] = prof_out
json.dump(results, open(f"{OUT}/bnrelu_probe_{MODEL}.json", "w"), indent=1)
