"""Per convolution: aten's convolution_backward (input and weight gradients, one stream) against
tr_hydra's two-stream op (runtime.backward_streams=2), each captured as a CUDA graph of 20 calls
and replayed; bf16, channels-last. Shapes from torchvision's ResNet-50 (batch 256 and 32) and the
CIFAR ResNet-18 (batch 512). Usage: python3 <this> [out.json]"""
import json
import sys

import torch
import torch.nn as nn

from tr_hydra.models.registry import build_model
from tr_hydra.runtime import backward_streams as bs

aten = torch.ops.aten


def conv_shapes(model: nn.Module, batch: int, res: int):
    """The model's convolutions with an input gradient, once per shape, with how often each
    shape occurs: {(input, weight, stride, padding, groups): count}, in order."""
    out = {}

    def hook(m, inp, _):
        x = inp[0]
        key = (tuple(x.shape), tuple(m.weight.shape), m.stride, m.padding, m.groups)
        if x.requires_grad:  # the first convolution has no input gradient
            out[key] = out.get(key, 0) + 1
    hs = [m.register_forward_hook(hook) for m in model.modules() if isinstance(m, nn.Conv2d)]
    x = torch.empty(batch, 3, res, res, device="meta")
    model.to("meta")(x)
    for h in hs:
        h.remove()
    return out


def timed(fn, reps=20, rounds=5):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    best = float("inf")
    for _ in range(rounds):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        best = min(best, a.elapsed_time(b) / reps)
    return best


def main():
    torch.backends.cudnn.benchmark = True
    cases = {"resnet50_b256": (build_model("resnet50", 1000), 256, 224),
             "resnet50_b32": (build_model("resnet50", 1000), 32, 224),
             "cifar_resnet18_b512": (build_model("resnet18_cifar", 10), 512, 32)}
    dev = torch.device("cuda")
    res = {}
    for name, (model, batch, r) in cases.items():
        rows, tot = [], [0.0, 0.0]
        for (xs, ws, stride, pad, groups), count in conv_shapes(model, batch, r).items():
            x = torch.randn(xs, device=dev, dtype=torch.bfloat16).contiguous(memory_format=torch.channels_last)
            w = torch.randn(ws, device=dev, dtype=torch.bfloat16).contiguous(memory_format=torch.channels_last)
            y = aten.convolution(x, w, None, list(stride), list(pad), [1, 1], False, [0, 0], groups)
            gy = torch.randn_like(y)
            args = (gy, x, w, None, list(stride), list(pad), [1, 1], False, [0, 0], groups)
            one = timed(lambda: aten.convolution_backward(*args, [True, True, False]))
            two = timed(lambda: bs.conv_backward_two_streams(*args))
            rows.append({"x": xs, "w": ws, "stride": stride, "count": count, "one_ms": one, "two_ms": two,
                         "ratio": one / two})
            tot[0] += count * one
            tot[1] += count * two
            print(f"{name} x{list(xs)} w{list(ws)} s{stride[0]} (x{count}): one stream {one:.3f} ms, "
                  f"two {two:.3f} ms, {one / two:.3f}x", flush=True)
        res[name] = {"convs": rows, "one_ms_sum": tot[0], "two_ms_sum": tot[1]}
        print(f"{name}: all its convolution backwards, {tot[0]:.3f} ms one stream, {tot[1]:.3f} ms two, "
              f"{tot[0] / tot[1]:.3f}x", flush=True)
        del model
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
