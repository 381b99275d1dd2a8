"""tr-bench: PyTorch's best practice and tr_hydra side by side, one process, same model, batch
and precision (tr-train overrides). Every mode is built first (time to first step, peak
memory), then timed interleaved: each repeat runs every mode once, so drift affects all alike.
bench.epoch_mix=true also times a whole schedule of variants (bench.cold=true: each mode in a
process of its own, with empty compiler caches); bench.data=<JPEG folder> measures end to end.

    tr-bench model=resnet50 amp=true variants.batch_size=256 variants.base_res=224
"""
from __future__ import annotations

import dataclasses
import os
import sys

from tr_hydra.cli._common import compose, user_errors


def _progress(msg: str) -> None:
    print(f"tr-bench: {msg}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        return 0
    from tr_hydra.bench.epoch_mix import COLD_PARENT_VAR
    cold_mode = bool(os.environ.get(COLD_PARENT_VAR))  # read before die_with_parent takes it
    if cold_mode:  # a cold mode's process ends with the bench that started it
        from tr_hydra.startup.launcher import die_with_parent
        if not die_with_parent(COLD_PARENT_VAR):
            print("tr-bench: the bench that started this cold mode has ended", file=sys.stderr)
            return 1
    from tr_hydra.bench import report
    from tr_hydra.errors import ConfigError
    from tr_hydra.resolve import resolve
    from tr_hydra.runtime.build import pick_device
    with user_errors("tr-bench"):
        cfg = compose(argv)
        pc = resolve(cfg)
        b = cfg.bench
        if b.cold and not b.epoch_mix:
            raise ConfigError("bench.cold: applies to the epoch mix; add bench.epoch_mix=true")
        for key, least in (("steps", 1), ("repeats", 1), ("warmup", 0), ("generate", 0)):
            if b[key] < least:
                raise ConfigError(f"bench.{key}: must be >= {least}, got {b[key]}")
        if b.data and not b.generate and not os.path.isdir(b.data):
            raise ConfigError(f"bench.data: {b.data} is not a folder (bench.generate=N writes N generated JPEGs "
                              "into it first)")
        report.check_writable(b.out)
        device = pick_device(pc)
        if b.data:
            out = _end_to_end(pc, b, device)
        else:
            if pc.data.name != "synthetic":  # the step is what is measured; data comes from the device
                pc = dataclasses.replace(pc, data=dataclasses.replace(pc.data, name="synthetic"))
            out = _steps(argv, pc, b, device)
            if isinstance(out, int):  # stopped by a signal
                return out
    for line in report.settings_lines(pc, device.type):
        print(line)
    if not cold_mode:  # after the timings; a cold mode's own process has its bench's
        out["host"] = report.host_info(device)
        print(report.host_line(out["host"]))
    report.write_json(out, b.out)
    return 0


def _end_to_end(pc, b, device) -> dict:
    from tr_hydra.bench.end_to_end import e2e_table, end_to_end
    from tr_hydra.bench.report import profile_table
    out = end_to_end(pc, b, device)
    print(e2e_table(out["modes"]))
    profiles = [r["profile"] for r in out["modes"] if "profile" in r]
    if profiles:
        print(profile_table(profiles))
        for p in profiles:
            print(f"{p['mode']}, profiled steps: the host waited {p['data_wait_ms_per_step']:.2f} ms "
                  f"per step for batches")
    return out


def _steps(argv: list[str], pc, b, device) -> dict | int:
    """The step modes, timed interleaved, then the profile and the epoch mix if asked; the
    results, or an exit status if a signal stopped the cold mix."""
    from tr_hydra.bench import epoch_mix as em
    from tr_hydra.bench.modes import Mode, as_list, pick_modes
    from tr_hydra.bench.report import profile_mode, profile_table, table, write_json
    modes = pick_modes(b.modes, device)
    built = []
    for i, m in enumerate(modes):  # progress on stderr: building a compiled mode takes minutes
        _progress(f"building {m} ({i + 1}/{len(modes)})")
        built.append(Mode(m, pc, device, b.warmup, b.single_buffer))
        _progress(f"{m} ready, first step after {built[-1].first_seconds:.1f}s")
    for r in range(b.repeats):
        for m in built:  # interleaved repeats
            m.time(b.steps)
        if built:
            _progress(f"repeat {r + 1}/{b.repeats} timed")
    records = [m.record() for m in built]
    out = {"config": pc.describe(), "runtime": dataclasses.asdict(pc.runtime), "device": str(device),
           "batch": pc.batch_size, "res": pc.variant("train_base").res, "steps": b.steps, "repeats": b.repeats,
           "modes": records}
    if records:  # before the profile and the epoch mix, which take minutes
        print(table(records), flush=True)
        for m in built:
            if m.rt is not None:
                print(f"{m.name}: {m.rt.compiled.tuning.describe()}")
    if b.profile:
        out["profile"] = [profile_mode(m) for m in built]
        print(profile_table(out["profile"]))
    if b.epoch_mix:
        mm = None if b.epoch_mix_modes == "auto" else as_list(b.epoch_mix_modes, "bench.epoch_mix_modes")
        if b.cold:  # the processes of their own get the device memory the modes above held
            for m in built:
                m.close()
            del built[:]
            if device.type == "cuda":
                import torch
                torch.cuda.empty_cache()

            def partial(mix):
                write_json(dict(out, epoch_mix=dict(mix, complete=False)), b.out, quiet=True)
            prev = em.sigterm_raises()
            try:
                out["epoch_mix"] = em.epoch_mix_cold(argv, pc, device, mm, out_path=b.out, on_progress=partial)
            except (em.Terminated, KeyboardInterrupt) as e:
                sig = "SIGTERM" if isinstance(e, em.Terminated) else "SIGINT"
                _progress(f"stopped by {sig}; the modes that finished are in {b.out or 'bench.json'}")
                return 143 if sig == "SIGTERM" else 130
            finally:
                if prev is not None:
                    import signal
                    signal.signal(signal.SIGTERM, prev)
        else:
            out["epoch_mix"] = em.epoch_mix(pc, device, mm)
        print(em.mix_table(out["epoch_mix"]))
    return out


if __name__ == "__main__":
    sys.exit(main())
