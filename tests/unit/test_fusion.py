"""The fusion pass over the step program: what tr-plan prints is the program the executor binds,
and that program steps to the values of the unfused one on the plain-torch reference (the fused
kernels run in Triton's interpreter on CPU, in a subprocess: ``python test_fusion.py``)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

OVERRIDES = ["amp=true", "amp_dtype=fp16", "runtime.device=cpu", "runtime.tuning=none"]


def _programs(argv):
    from tr_hydra.cli._common import compose
    from tr_hydra.compiler.compile import compile_plan
    from tr_hydra.compiler.fusion import fuse_updates
    from tr_hydra.compiler.program import build_program
    from tr_hydra.resolve import resolve
    compiled = compile_plan(resolve(compose(argv)))
    plain = build_program(compiled)
    return compiled, plain, fuse_updates(plain)


def test_tr_plan_prints_the_fused_program(capsys):
    from tr_hydra.cli.plan import main
    argv = OVERRIDES + ["runtime.kernels=triton"]
    compiled, plain, fused = _programs(argv)
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.rstrip().endswith(fused.describe()) and compiled.program == fused
    # the two casts are gone: the weight update reads the 16-bit gradients and writes the copy
    ops = [n.op for n in plain.train]
    assert ops.count("RANGE_CAST_FP16_TO_FP32") == ops.count("RANGE_CAST_FP32_TO_FP16") == 1
    assert [n.op for n in fused.train] == [op for op in ops if not op.startswith("RANGE_CAST_")]
    assert "RANGE_CAST_" not in out
    update = next(n for n in fused.train if n.op == "RANGE_UPDATE_WEIGHT_MOMENTUM")
    assert [k for k, _ in update.fused] == ["grad16", "half"] and update.arg("g_scale") == "inv_loss_scale"
    assert "grad16=G_FC_WEIGHT_FP16..G_DEEP_CONV_FP16  half=A_FC_WEIGHT..A_DEEP_CONV" in update.describe()
    check = next(n for n in fused.train if n.op == "RANGE_CHECK_NAN")
    assert [k for k, _ in check.fused] == ["grad16", "unwritten"]
    assert fused.val == plain.val and fused.val_prologue == plain.val_prologue
    assert main(argv + ["plan.format=json"]) == 0
    program = json.loads(capsys.readouterr().out)["program"]
    assert program["train"] == [n.describe() for n in fused.train]


def test_tr_plan_prints_the_plain_program_for_the_reference_kernels(capsys):
    from tr_hydra.cli.plan import main
    argv = OVERRIDES + ["runtime.kernels=torch"]
    compiled, plain, _ = _programs(argv)
    assert compiled.program == plain and not any(n.fused for n in plain.train)
    assert main(argv) == 0
    assert capsys.readouterr().out.rstrip().endswith(plain.describe())


def test_every_range_op_has_a_binder():
    from tr_hydra.compiler.program import RangeOp
    from tr_hydra.runtime.range_nodes import BINDERS
    assert set(BINDERS) == set(RangeOp)


def test_the_fused_program_steps_to_the_values_of_the_unfused_reference():
    pytest.importorskip("triton")
    root = Path(__file__).parents[2]
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH")) if p))
    out = subprocess.run([sys.executable, __file__], capture_output=True, text=True, env=env, timeout=600, cwd=root)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stdout + out.stderr[-3000:]


def _step_both(steps: int = 3) -> list[str]:
    """A runtime on the reference (the plain program) and one on the fused kernels (the fused
    program) from the same weights, fed the same batches: after each step their weights, momenta
    and 16-bit copies agree to the kernels' rounding, and the fused one's 16-bit copy is the
    cast of its weights, bit for bit."""
    import dataclasses

    import torch

    from tests.helpers import small_config
    from tr_hydra.memory.regions import BIAS_KINDS, MATRIX_KINDS, series_span
    from tr_hydra.runtime.build import Runtime
    failures, rts = [], {}
    for kernels in ("torch", "triton"):
        pc = small_config(amp=True, amp_dtype="fp16", ema=True)
        pc = dataclasses.replace(pc, runtime=dataclasses.replace(pc.runtime, kernels=kernels))
        rts[kernels] = Runtime(pc, log=lambda *_: None, source=False)
    ref, fused = rts["torch"], rts["triton"]
    if any(n.op.startswith("RANGE_CAST_") for n in fused.compiled.program.train) or \
            not any(n.op.startswith("RANGE_CAST_") for n in ref.compiled.program.train):
        failures.append("the fused runtime's program keeps a cast, or the reference's has none")
    spans = {s: series_span(s, kinds) for s, kinds in (("W", MATRIX_KINDS), ("M", MATRIX_KINDS), ("A", MATRIX_KINDS),
                                                       ("E", MATRIX_KINDS))}
    spans["W bias"] = series_span("W", BIAS_KINDS)
    g = torch.Generator().manual_seed(7)
    for t in range(steps):
        img, lab = ref.ex.input_views("train_base", "A")
        x, y = torch.randn(img.shape, generator=g).to(img.dtype), torch.randint(0, 10, lab.shape, generator=g)
        for rt in (ref, fused):
            a, b = rt.ex.input_views("train_base", "A")
            a.copy_(x)
            b.copy_(y)
            rt.ex.train_step("train_base", "A")
        for name, span in spans.items():
            u, v = ref.arena.span(*span).float(), fused.arena.span(*span).float()
            err = ((u - v).norm() / u.norm().clamp_min(1e-30)).item()
            if err > 1e-5:
                failures.append(f"step {t}: {name} differs from the reference by {err:.2e}")
        for k in ("found_inf", "loss_scale", "step"):
            if ref.ex.scalar(k) != fused.ex.scalar(k):
                failures.append(f"step {t}: {k} {fused.ex.scalar(k)}, the reference {ref.ex.scalar(k)}")
        w16 = fused.arena.span(*spans["A"])
        if not torch.equal(w16, fused.arena.span(*spans["W"]).to(w16.dtype)):
            failures.append(f"step {t}: the fused update's 16-bit copy is not the cast of its weights")
    return failures


if __name__ == "__main__":
    found = _step_both()
    print("\n".join(found) or "ok")
    sys.exit(1 if found else 0)
