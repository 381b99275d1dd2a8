"""aot_compile artifacts against Dynamo cache-hit loads, ResNet-50 bf16 training step, GPU."""
import json, os, sys, time, traceback, torch, torchvision
mode, out = sys.argv[1], sys.argv[2]
dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
torch.manual_seed(0)
model = torchvision.models.resnet50(num_classes=1000).to(dev).to(memory_format=torch.channels_last)
res = int(os.environ.get("RES", "224")); ba, bb = int(os.environ.get("BA", "64")), int(os.environ.get("BB", "32"))
xa = torch.randn(ba, 3, res, res, device=dev).to(memory_format=torch.channels_last)
xb = torch.randn(bb, 3, res, res, device=dev).to(memory_format=torch.channels_last)
f = torch.compile(model, dynamic=False)
import torch._dynamo
if hasattr(torch._dynamo.config, "enable_aot_compile"):
    torch._dynamo.config.enable_aot_compile = True
R0 = {"has_load": hasattr(torch.compiler, "load_compiled_function")}
R = {"torch": torch.__version__, **R0}
def sync():
    if dev.type == "cuda": torch.cuda.synchronize()
def step(fn, x):
    with torch.autocast(dev.type, dtype=torch.bfloat16):
        out = fn(x)
    g = torch.autograd.grad(out.float().sum(), [model.fc.weight, model.conv1.weight])
    sync()
    return [t.float().cpu() for t in g]
def evalstep(fn, x):
    model.eval()
    try:
        with torch.no_grad(), torch.autocast(dev.type, dtype=torch.bfloat16):
            o = fn(x)
        sync(); return o.float().cpu()
    finally:
        model.train()
def timed(name, thunk):
    t = time.perf_counter()
    try:
        v = thunk(); R[name] = round(time.perf_counter() - t, 3); return v
    except Exception as e:
        R[name] = "FAILED " + repr(e)[:300]; traceback.print_exc(); return None
if mode.startswith("save"):
    if mode == "save":
        timed("regular_A_compile", lambda: step(f, xa))
        timed("regular_B_compile", lambda: step(f, xb))
        timed("regular_B_eval_compile", lambda: evalstep(f, xb))
    def aot_train():
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            c = torch.compile(model.forward, fullgraph=True, dynamic=False).aot_compile(((xb,), {}))
        step(lambda x: c(model, x), xb)
        c.save_compiled_function(out + "/b_train.aot")
    timed("aot_B_train_compile_and_save", aot_train)
    def aot_eval():
        model.eval()
        try:
            with torch.no_grad(), torch.autocast(dev.type, dtype=torch.bfloat16):
                c = torch.compile(model.forward, fullgraph=True, dynamic=False).aot_compile(((xb,), {}))
        finally:
            model.train()
        evalstep(lambda x: c(model, x), xb)
        c.save_compiled_function(out + "/b_eval.aot")
    timed("aot_B_eval_compile_and_save", aot_eval)
else:
    timed("regular_A_load", lambda: step(f, xa))
    gb = timed("regular_B_load", lambda: step(f, xb))
    eb = timed("regular_B_eval_load", lambda: evalstep(f, xb))
    def load(p):
        with open(p, "rb") as fh:
            fn = torch.compiler.load_compiled_function(fh)
        fn.disable_guard_check()
        return fn
    ce = timed("aot_B_eval_load", lambda: load(out + "/b_eval.aot"))
    if ce is not None:
        e2 = timed("aot_B_eval_first", lambda: evalstep(lambda x: ce(model, x), xb))
        if e2 is not None and eb is not None:
            R["aot_eval_equal"] = torch.equal(e2, eb); R["aot_eval_maxdiff"] = (e2 - eb).abs().max().item(); R["eval_absmax"] = eb.abs().max().item()
    c = timed("aot_B_train_load", lambda: load(out + "/b_train.aot"))
    if c is not None:
        g2 = timed("aot_B_train_first_step", lambda: step(lambda x: c(model, x), xb))
        if g2 is not None and gb is not None:
            R["aot_train_grads_equal"] = all(torch.equal(a, b) for a, b in zip(gb, g2))
            R["aot_train_grad_maxdiff"] = max((a - b).abs().max().item() for a, b in zip(gb, g2))
        timed("aot_B_train_second_step", lambda: step(lambda x: c(model, x), xb))
        timed("regular_B_second_step", lambda: step(f, xb))
print(json.dumps(R))
with open(f"{out}/{mode}.json", "w") as fh:
    json.dump(R, fh, indent=1)
