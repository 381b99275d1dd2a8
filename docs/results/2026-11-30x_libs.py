"""List / evict (posix_fadvise DONTNEED) / read (sequentially) the CUDA libraries torch loads."""
import glob, os, sys, time, site
roots = [p for p in site.getsitepackages() + [site.getusersitepackages()] if os.path.isdir(p)]
import importlib.util
tl = os.path.join(os.path.dirname(importlib.util.find_spec("torch").origin), "lib")
files = glob.glob(os.path.join(tl, "*.so*"))
for r in roots:
    files += glob.glob(os.path.join(r, "nvidia", "**", "*.so*"), recursive=True)
files = sorted(set(f for f in files if os.path.isfile(f)))
what = sys.argv[1]
sel = [f for f in files if (len(sys.argv) < 3 or any(k in f for k in sys.argv[2].split(",")))]
t = time.perf_counter(); n = 0
for f in sel:
    fd = os.open(f, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        if what == "list":
            print(f"{size/2**20:9.1f} MiB {f}")
        elif what == "evict":
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        elif what == "read":
            while os.read(fd, 1 << 24):
                pass
        n += size
    finally:
        os.close(fd)
print(f"{what}: {len(sel)} files, {n/2**30:.2f} GiB, {time.perf_counter()-t:.1f} s", flush=True)
