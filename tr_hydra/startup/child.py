"""A parallel compile's process: one variant's step, once, so that its compile is saved (and
lands in Inductor's caches) for the training process. Started fresh
(``python -m tr_hydra.startup.child PLAN VARIANT SPLIT DEVICE [--save-forward=PATH] [SENT]``) or
forked by a ``launcher.Launcher`` (``python -m tr_hydra.startup.child --launcher MODULES``)."""
from __future__ import annotations

import json
import sys
import time

from tr_hydra.startup.children import SAVE_FLAG
from tr_hydra.startup.launcher import LAUNCHER_PRELOAD, _launcher_main, die_with_parent

def main(argv: list[str], sent: float | None = None) -> int:
    """One variant's step, once, in a fresh process or one forked by a launcher. ``sent`` (or a
    last argument): when the precompiler asked for the child (``time.time()``), so that it
    reports how long it took to start. Its last line of output is a JSON summary."""
    t_start = time.time()
    if not die_with_parent():
        print("the process that started this compile has ended; nothing to do", flush=True)
        return 1
    save_to = None
    for a in [a for a in argv if a.startswith(SAVE_FLAG)]:
        argv.remove(a)
        save_to = a[len(SAVE_FLAG):]
    if len(argv) == 5:
        sent = float(argv.pop())
    path, name, split, index = argv
    t0 = time.perf_counter()
    import dataclasses
    import pickle

    import torch

    from tr_hydra.runtime.build import Runtime
    from tr_hydra.internals.dynamo import cache_counts, compile_timers, phase_totals
    with open(path, "rb") as f:
        pc = pickle.load(f)
    t_import = time.perf_counter()
    # under ddp: the same plan (world size included, so the same graphs) on the rank's own
    # device, with no process group; the children only compile
    pc = dataclasses.replace(pc, dist=dataclasses.replace(pc.dist, mode="none"))
    if torch.cuda.is_available():
        torch.cuda.set_device(int(index))
    rt = Runtime(pc, log=lambda *_: None, source=False)
    t_runtime = time.perf_counter()  # with the CUDA context
    # cuDNN's algorithm search is the training process's to do (it times on the shared GPU);
    # the compiled code does not depend on it (cudnn.benchmark is not in Inductor's cache key)
    torch.backends.cudnn.benchmark = False
    rec = rt.forwards.record({name: save_to}) if save_to else None
    if split == "train":
        rt.ex.train_step(name, "A")
    else:
        rt.model.eval()
        with rt.ex.folded():
            rt.ex.val_step(name, "A")
    if rt.device.type == "cuda":
        torch.cuda.synchronize(rt.device)
    t_end = time.perf_counter()
    out = dict(cache_counts(), variants=[name], start_s=round(max(0.0, t_start - sent), 2) if sent else None,
               import_s=round(t_import - t0, 3), trainer_s=round(t_runtime - t_import, 3),
               step_s=round(t_end - t_runtime, 3), phases_s=phase_totals(), timers_s=compile_timers(0.1, 30),
               **(rec.report() if rec is not None else {}), done_at=time.time())
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--launcher"]:
        mods = [m for m in sys.argv[2].split(",") if m] if len(sys.argv) > 2 else list(LAUNCHER_PRELOAD)
        sys.exit(_launcher_main(mods, main))
    sys.exit(main(sys.argv[1:]))
