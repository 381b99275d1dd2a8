"""Tuned Triton kernels against the device-to-device copy's bandwidth (docs/performance.md).

With this folder on PYTHONPATH, TR_PROBE_KBW=<file.jsonl> and the Inductor option
benchmark_kernel=true, every kernel that coordinate descent tunes is recorded: its bytes (Inductor's
own count), its time before and after tuning (alone: its in-place buffers cloned once, not in
every timed call as Inductor's own bench does), and a 256 MiB copy timed in the same process.
`python sitecustomize.py <file.jsonl>` sums them per process and lists the kernels that lose most.
"""
import collections
import json
import os
import sys


def _install(path):
    import torch
    from torch._inductor.runtime.triton_heuristics import CachingAutotuner

    tune, copy = CachingAutotuner.coordinate_descent_tuning, []

    def copy_gbps():
        if not copy:
            from triton.testing import do_bench
            a = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")
            b = torch.empty_like(a)
            copy.append(2 * a.numel() / (do_bench(lambda: b.copy_(a), warmup=20, rep=100) * 1e-3) / 1e9)
        return copy[0]

    def alone(owner, launcher, args, kwargs):
        # Inductor's own bench clones a kernel's in-place buffers inside every timed call, which
        # adds a copy of them to the time of each kernel that writes in place: clone them once
        from triton.testing import do_bench
        cargs, ckwargs = owner.maybe_clone_args(set(), *args, **kwargs)
        stream = torch.cuda.current_stream().cuda_stream
        return do_bench(lambda: launcher(*cargs, **ckwargs, stream=stream), warmup=10, rep=50)

    def recorded(self, launcher, *args, **kwargs):
        base = alone(self, launcher, args, kwargs)
        best = tune(self, launcher, *args, **kwargs)
        rec = {"pid": os.getpid(), "name": self.inductor_meta.get("kernel_name"),
               "gb": self.inductor_meta.get("kernel_num_gb"), "base_ms": base,
               "ms": alone(self, best, args, kwargs), "ms_with_clone": self.bench(best, *args, **kwargs),
               "in_place": bool(self.mutated_arg_names), "copy_gbps": copy_gbps(), "cfg": str(best.config)}
        with open(path, "a") as f:
            f.write(json.dumps(rec) + "\n")
        return best

    CachingAutotuner.coordinate_descent_tuning = recorded


def summarize(path, top=12):
    by = collections.defaultdict(list)
    for line in open(path):
        r = json.loads(line)
        if r.get("gb") and r.get("ms"):
            by[r["pid"]].append(r)
    for pid, rs in by.items():
        bw = rs[0]["copy_gbps"]
        gb, ms = sum(r["gb"] for r in rs), sum(r["ms"] for r in rs)
        ideal = gb / bw * 1e3
        print(f"process {pid}: {len(rs)} kernels, {gb:.2f} GB, tuned {ms:.3f} ms (untuned "
              f"{sum(r['base_ms'] for r in rs):.3f}); at the copy's {bw:.0f} GB/s {ideal:.3f} ms, "
              f"{100 * ideal / ms:.1f}%")
        if all("ms_with_clone" in r for r in rs):
            print(f"   timed as Inductor's bench times them (in-place buffers cloned in each call): "
                  f"{sum(r['ms_with_clone'] for r in rs):.3f} ms, {sum(r['in_place'] for r in rs)} kernels in place")
        for frac in (0.85, 1.0):
            lost = sum(max(0.0, r["ms"] - r["gb"] / bw * 1e3 / frac) for r in rs)
            print(f"   every kernel below {frac:.0%} of the copy brought to it: {lost:.3f} ms less")
        for r in sorted(rs, key=lambda r: r["ms"] - r["gb"] / bw * 1e3, reverse=True)[:top]:
            print(f"   {r['name'][:64]:64} {r['gb'] * 1e3:7.1f} MB {r['ms']:.4f} ms "
                  f"{100 * r['gb'] / (r['ms'] * 1e-3) / bw:5.1f}%")


if __name__ == "__main__":
    summarize(sys.argv[1])
elif os.environ.get("TR_PROBE_KBW"):
    _install(os.environ["TR_PROBE_KBW"])
