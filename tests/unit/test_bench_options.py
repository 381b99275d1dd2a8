"""tr-bench gives its torch.compile baselines tr_hydra's runtime.inductor_options."""
from __future__ import annotations

import torch

from tr_hydra import bench


def test_compile_as_puts_the_options_on_top_of_the_modes_own_and_they_take_effect():
    from torch._inductor.utils import run_and_get_code

    def f(x):
        return (x.sin() + 1).relu() * x
    x = torch.randn(4, 64)
    codes = {}
    for opts in (None, {"cpp.simdlen": 0}):
        torch._dynamo.reset()
        out, code = run_and_get_code(bench.compile_as(f, None, opts), x)
        torch.testing.assert_close(out, f(x))
        codes[bool(opts)] = "\n".join(code)
    assert "Vectorized" in codes[False] and "Vectorized" not in codes[True]


def test_the_pytorch_modes_compile_with_the_options(monkeypatch):
    seen = []
    real = torch.compile

    def recording(fn, **kw):
        seen.append(kw)
        return real(fn, backend="eager")
    monkeypatch.setattr(torch, "compile", recording)
    cpu = torch.device("cpu")
    opts = {"coordinate_descent_tuning": True}
    for mode in ("compile", "reduce-overhead"):
        bench.pytorch_runner("resnet_mini", 2, 16, 10, mode, cpu, False, options=opts)
        bench.pytorch_runner("resnet_mini", 2, 16, 10, mode, cpu, False)
    assert seen == [{"options": opts}, {},
                    {"options": {"triton.cudagraphs": True, "coordinate_descent_tuning": True}},
                    {"mode": "reduce-overhead"}]
    seen.clear()
    bench._compiled_step("resnet_mini", 10, cpu, False, opts)
    assert seen == [{"options": opts}]


def _record(mode: str, rate: float) -> dict:
    return {"mode": mode, "img_per_sec_median": rate, "spread": 0.01, "peak_bytes": 2**30,
            "first_step_seconds": 1.0, "memory": {}}


def test_the_table_shows_ratios_to_the_best_pytorch_mode_and_a_dash_without_one():
    from tr_hydra.cli.bench import table
    rows = {line.split()[0]: line for line in table([_record("reduce-overhead", 4000.0),
                                                     _record("eager", 2000.0),
                                                     _record("tr-inductor", 4200.0)]).splitlines()}
    assert rows["tr-inductor"].split()[3] == "1.050"  # 4200 / 4000, the best PyTorch mode
    assert rows["eager"].split()[3] == "0.500"
    assert rows["best"] == "best PyTorch mode: reduce-overhead"
    only = table([_record("tr-inductor", 7890.9)]).splitlines()
    assert only[1].split()[3] == "-"  # tr_hydra alone: nothing to divide by
    assert "nan" not in "\n".join(only) and "best PyTorch mode" not in "\n".join(only)


def test_the_input_pipelines_kernels_are_a_group_of_their_own():
    from tr_hydra.cli.bench import _group
    dali = "DALI / nvJPEG (decode, resize, normalise)"
    assert _group("void dali::kernels::resampling::BatchedSeparableResampleKernel<...>") == dali
    assert _group("void dali::kernels::color::ColorConversionKernel<float>") == dali  # not a convolution
    assert _group("nvjpeg::decodeHuffmanGPU_kernel") == dali
    assert _group("sm90_xmma_fprop_implicit_gemm_bf16bf16_bf16f32_f32_nhwckrsc_nhwc") == "convolution (cuDNN)"
    assert _group("triton_poi_fused__native_batch_norm_legit_functional_relu_5") == "Inductor (Triton)"
    assert _group("_update_kernel") == "tr_hydra range kernels"
