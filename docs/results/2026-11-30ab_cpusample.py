"""Sample the host's CPU while a command runs: busy cores over time, and CPU seconds per process
(with its parent, so trees can be summed). Usage: python3 cpusample.py OUT.json -- cmd args..."""
import json, os, subprocess, sys, time

HZ = os.sysconf("SC_CLK_TCK")
NCPU = os.cpu_count()


def stat_total():
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    idle = v[3] + v[4]
    return sum(v), idle


def procs():
    out = {}
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        try:
            with open(f"/proc/{p}/stat") as f:
                s = f.read()
            r = s.rfind(")")
            comm = s[s.find("(") + 1:r]
            f2 = s[r + 2:].split()
            ppid, ut, st, cut, cst = int(f2[1]), int(f2[11]), int(f2[12]), int(f2[13]), int(f2[14])
            out[int(p)] = (comm, ppid, (ut + st) / HZ, (cut + cst) / HZ)
        except (OSError, IndexError, ValueError):
            pass
    return out


def main():
    path = sys.argv[1]
    cmd = sys.argv[sys.argv.index("--") + 1:]
    base = set(procs())
    t0 = time.time()
    child = subprocess.Popen(cmd)
    seen, cmdlines, timeline = {}, {}, []
    last = stat_total()
    while True:
        time.sleep(0.5)
        now = stat_total()
        dt, di = now[0] - last[0], now[1] - last[1]
        last = now
        ps = procs()
        for pid, v in ps.items():
            if pid in base:
                continue
            if pid not in cmdlines:
                try:
                    with open(f"/proc/{pid}/cmdline", "rb") as f:
                        cmdlines[pid] = f.read().replace(b"\0", b" ").decode(errors="replace")[:200]
                except OSError:
                    cmdlines[pid] = ""
            first = seen.get(pid, (None, time.time() - t0))[1]
            seen[pid] = (v, first, time.time() - t0)
        timeline.append((round(time.time() - t0, 1), round((dt - di) / dt * NCPU, 2) if dt else 0.0))
        if child.poll() is not None:
            break
    res = {"rc": child.returncode, "wall": round(time.time() - t0, 1), "ncpu": NCPU, "timeline": timeline,
           "procs": {pid: {"comm": v[0], "ppid": v[1], "cpu": round(v[2], 2), "cpu_reaped": round(v[3], 2),
                           "first": round(first, 1), "last": round(lastt, 1), "cmd": cmdlines.get(pid, "")}
                     for pid, (v, first, lastt) in seen.items()}}
    with open(path, "w") as f:
        json.dump(res, f)
    busy = [b for _, b in timeline]
    print(f"cpusample: wall {res['wall']} s, mean busy cores {sum(busy) / max(1, len(busy)):.2f} of {NCPU}, "
          f"process cpu {sum(p['cpu'] for p in res['procs'].values()):.1f} s", flush=True)
    sys.exit(child.returncode)


main()
