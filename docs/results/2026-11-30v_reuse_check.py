# GPU: a compiled training step of ResNet-50 (fp32 and bf16 autocast) with the blocks made regions against the unmarked
# model's compiled step: weights untouched, gradients and running statistics close
import sys, time, torch
from tr_hydra.models.registry import build_model
from tr_hydra.runtime.block_reuse import INDUCTOR_OPTIONS, mark_block_regions
torch.manual_seed(0)
ref = build_model("resnet50", 100).cuda().to(memory_format=torch.channels_last)
m = build_model("resnet50", 100).cuda().to(memory_format=torch.channels_last); m.load_state_dict(ref.state_dict())
print("marked", mark_block_regions(m), flush=True)
before = {k: v.clone() for k, v in m.state_dict().items() if "running" not in k and "num_b" not in k}
x = torch.randn(32, 3, 64, 64, device="cuda").to(memory_format=torch.channels_last)
for mod, opts in ((m, INDUCTOR_OPTIONS), (ref, {})):
    t = time.perf_counter()
    f = torch.compile(mod, dynamic=False, options=opts)
    f(x).float().square().mean().backward(); torch.cuda.synchronize()
    print("compiled step", round(time.perf_counter() - t, 1), "s", flush=True)
sd = m.state_dict()
print("weights changed:", [k for k, v in before.items() if not torch.equal(sd[k], v)][:5])
g = max(((a.grad - b.grad).norm() / b.grad.norm()).item() for a, b in zip(m.parameters(), ref.parameters()))
s = max(((a.float() - b.float()).norm() / (b.float().norm() + 1e-30)).item() for (k, a), (_, b) in zip(m.state_dict().items(), ref.state_dict().items()) if "running" in k)
print(f"max relative grad difference {g:.2e}, running statistics {s:.2e}", "OK" if g < 1e-3 and s < 1e-4 else "MISMATCH")
