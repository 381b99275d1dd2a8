"""tr-plan: compose a config, compile it on the meta device and print the memory plan."""
from __future__ import annotations

import json
import sys

from tr_hydra.cli._common import compose, user_errors
from tr_hydra.memory.regions import ALL_REGIONS, SERIES_ORDER, series_of


def _mib(n: int) -> str:
    return f"{n / 2**20:,.2f} MiB"


def plan_table(compiled) -> str:
    pc, plan = compiled.config, compiled.plan
    total = plan.total_bytes
    amp = f"{pc.amp_dtype}" if pc.amp else "off"
    lines = [f"tr_hydra plan  model={pc.model.name} optimizer={pc.optimizer.name} amp={amp} "
             f"ema={'on' if pc.ema else 'off'} bn_folded={'on' if pc.bn_folded else 'off'}  "
             f"fingerprint {pc.fingerprint()}", "",
             f"{'no.':>3} {'region':<22} {'tensors':>7} {'bytes':>15} {'base offset':>15} {'share':>7}"]
    for r in ALL_REGIONS:
        if not plan.is_region_populated(r):
            continue
        n = len(plan.tensors_in(r))
        size = plan.region_size[r]
        share = f"on {plan.shared[r].name}" if r in plan.shared else f"{100.0 * size / total:>6.2f}%"
        lines.append(f"{r.number:>3} {r.name:<22} {n:>7} {size:>15,} {plan.region_base[r]:>15,} {share:>7}")
    if plan.shared:
        lines += ["", "on another region's bytes: "
                  + ", ".join(f"{r.name} on {t.name}" for r, t in plan.shared.items())
                  + " (the backward is the last reader of the 16-bit weights; the gradients are "
                  "written after it, and the weight update rewrites the 16-bit weights after "
                  "reading them: plan.share_grad16)"]
    lines += ["", "per series:"]
    sb = plan.series_bytes()
    for s in SERIES_ORDER:
        if sb.get(s):
            lines.append(f"  {s:<4} {sb[s]:>15,} bytes  {100.0 * sb[s] / total:6.2f}%")
    lines += ["", f"{'variant':<18} {'batch':>5} {'res':>4} {'input bytes':>14} {'logits':>12} "
                  f"{'saved activations':>18}"]
    for v in pc.variants:
        inp = plan.shape_in(plan["input_A.data"], v.name)
        in_bytes = inp[0] * inp[1] * inp[2] * plan["input_A.data"].strides[2] * plan["input_A.data"].dtype.itemsize
        rep = compiled.estimated_shapes[v.name]
        lines.append(f"{v.name:<18} {v.batch:>5} {v.res:>4} {in_bytes:>14,} {str(list(rep.logits)):>12} "
                     f"{_mib(rep.saved_activation_bytes):>18}")
    rec = max((compiled.estimated_shapes[v.name].recompute_transient_bytes for v in pc.variants), default=0)
    sources = {r.estimate for r in compiled.estimated_shapes.values() if r.saved_activation_bytes}
    how = ("Inductor's partition of the largest variant, traced; the others scaled from it" if "partitioner" in sources
           else "what eager autograd saves" if sources <= {"eager"} else "; ".join(sorted(sources)))
    lines += ["", f"arena total: {total:,} bytes ({_mib(total)}) in {len(plan.dtensors)} DTensors",
              f"activation pool estimate (largest train variant, shared graph pool): "
              f"{_mib(compiled.activation_estimate)}"
              + (f" (of which recomputed in the backward, runtime.recompute=pointwise: {_mib(rec)})" if rec else "")
              + f"; saved activations: {how}",
              f"gradients returned by the backward, before their copy into the arena: "
              f"{_mib(compiled.gradient_transient)}",
              f"BLAS workspaces (cuBLAS and cuBLASLt, one stream): {_mib(compiled.library_workspace)}",
              f"predicted device need: {_mib(compiled.predicted_need)}",
              compiled.tuning.describe(), "",
              compiled.program.describe()]
    return "\n".join(lines)


def plan_json(compiled) -> dict:
    plan, pc = compiled.plan, compiled.config
    return {
        "total_bytes": plan.total_bytes,
        "fingerprint": pc.fingerprint(),
        "activation_estimate_bytes": compiled.activation_estimate,
        "gradient_transient_bytes": compiled.gradient_transient,
        "library_workspace_bytes": compiled.library_workspace,
        "predicted_need_bytes": compiled.predicted_need,
        "tuning": compiled.tuning.to_json(),
        "regions": [{"index": int(r), "name": r.name, "base_offset": plan.region_base[r],
                     "total_bytes": plan.region_size[r], "series": series_of(r),
                     "on": plan.shared[r].name if r in plan.shared else None,
                     "populated": plan.is_region_populated(r)} for r in ALL_REGIONS],
        "dtensors": [{"id": t.id, "name": t.name, "region": t.region.name, "shape": list(t.shape),
                      "dtype": t.dtype.value, "offset": t.offset, "slot_bytes": t.slot_bytes}
                     for t in plan.dtensors],
        "variants": [{"name": v.name, "train": v.train, "batch": v.batch, "res": v.res,
                      "saved_activation_bytes": compiled.estimated_shapes[v.name].saved_activation_bytes,
                      "recompute_transient_bytes": compiled.estimated_shapes[v.name].recompute_transient_bytes,
                      "estimate": compiled.estimated_shapes[v.name].estimate}
                     for v in pc.variants],
        "program": {"train": [n.describe() for n in compiled.program.train],
                    "val": [n.describe() for n in compiled.program.val]},
    }


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in argv):
        print("usage: tr-plan [OVERRIDE ...]   e.g. tr-plan model=resnet50 optimizer=lars amp=true\n"
              "Prints the memory plan of the composed config (plan.format=json for JSON).")
        return 0
    from tr_hydra.compiler.compile import compile_plan
    from tr_hydra.resolve import resolve
    with user_errors("tr-plan"):
        cfg = compose(argv)
        pc = resolve(cfg)
        compiled = compile_plan(pc)
    fmt = cfg.plan.format.value if hasattr(cfg.plan.format, "value") else str(cfg.plan.format)
    if fmt == "json":
        print(json.dumps(plan_json(compiled)))
    else:
        print(plan_table(compiled))
    return 0


if __name__ == "__main__":
    sys.exit(main())
