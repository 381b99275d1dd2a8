"""tr-bench as a package (``tr_hydra.bench``): its PyTorch baselines compile with tr_hydra's
runtime.inductor_options, its modes and their errors, and what its tables and JSON say of
tr_hydra's start-up."""
from __future__ import annotations

import ast
import dataclasses
import importlib.util
import json
import os
from pathlib import Path

import pytest
import torch

from tr_hydra import bench
from tr_hydra.bench import baselines, report
from tr_hydra.bench.epoch_mix import mix_modes, mix_table, ready_parts
from tr_hydra.bench.modes import pick_modes, runtime_log, tr_runtime
from tr_hydra.errors import ConfigError
from tr_hydra.startup.report import StartupReport

CPU = torch.device("cpu")


def _pc(*overrides: str):
    from tr_hydra.cli._common import compose
    from tr_hydra.resolve import resolve
    return resolve(compose(["model=resnet_mini", "data=synthetic", *overrides]))


def test_the_package_exposes_the_runners_and_never_imports_the_cli():
    assert callable(bench.tr_runner) and callable(bench.pytorch_runner)
    assert importlib.util.find_spec("tr_hydra.bench.__main__") is None  # no `python -m tr_hydra.bench`
    for path in Path(bench.__file__).parent.glob("*.py"):  # function-local imports included
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any(n.startswith("tr_hydra.cli") for n in names), (path.name, names)


def test_compile_as_puts_the_options_on_top_of_the_modes_own_and_they_take_effect():
    from torch._inductor.utils import run_and_get_code

    def f(x):
        return (x.sin() + 1).relu() * x
    x = torch.randn(4, 64)
    codes = {}
    for opts in (None, {"cpp.simdlen": 0}):
        torch._dynamo.reset()
        out, code = run_and_get_code(baselines.compile_as(f, None, opts), x)
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
    opts = {"coordinate_descent_tuning": True}
    for mode in ("compile", "reduce-overhead"):
        bench.pytorch_runner("resnet_mini", 2, 16, 10, mode, CPU, False, options=opts)
        bench.pytorch_runner("resnet_mini", 2, 16, 10, mode, CPU, False)
    assert seen == [{"options": opts}, {},
                    {"options": {"triton.cudagraphs": True, "coordinate_descent_tuning": True}},
                    {"mode": "reduce-overhead"}]
    seen.clear()
    baselines._compiled_step("resnet_mini", 10, CPU, False, opts)
    assert seen == [{"options": opts}]


def test_reduce_overhead_tuned_adds_coordinate_descent_to_the_options(monkeypatch):
    """bench.modes=[reduce-overhead-tuned]: reduce-overhead with runtime.inductor_options and
    Inductor's coordinate descent, as tr_hydra's runtime.tuning=full compiles."""
    from tr_hydra.bench.modes import Mode
    seen = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: seen.append(kw) or fn)
    pc = _pc("+runtime.inductor_options={max_autotune: true}", "model=resnet_mini", "variants.batch_size=2",
             "variants.base_res=16")
    Mode("reduce-overhead-tuned", pc, CPU, warmup=1)
    Mode("reduce-overhead", pc, CPU, warmup=1)
    # reduce-overhead with options: Inductor's CUDA graphs named among them (compile_as)
    graphs = {"triton.cudagraphs": True, "max_autotune": True}
    assert seen == [{"options": graphs | {"coordinate_descent_tuning": True}}, {"options": graphs}]


def test_tr_runner_steps_a_ready_runtime():
    step8, rt = bench.tr_runner("resnet_mini", 4, 16, 10, "none", CPU, False)
    try:
        before = rt.data_wait
        step8()
        assert rt.data_wait > before and rt.compiled.plan.total_bytes > 0
    finally:
        rt.close()


def test_the_modes_and_their_one_line_errors():
    assert pick_modes("auto", CPU) == ["eager", "tr"]
    assert pick_modes("auto", torch.device("cuda")) == ["eager", "compile", "reduce-overhead", "tr", "tr-inductor"]
    assert pick_modes(["reduce-overhead", "tr-inductor", "tr-recompute"], CPU) == \
        ["reduce-overhead", "tr-inductor", "tr-recompute"]
    assert pick_modes("eager, tr", CPU) == ["eager", "tr"]
    for gone in ("tr-streams", "tr-streams-next"):  # deleted modes
        with pytest.raises(ConfigError, match=rf"bench.modes: unknown \['{gone}'\]"):
            pick_modes([gone], CPU)
    with pytest.raises(ConfigError, match=r"unknown \['reduce-overhead'\] with bench.data"):
        pick_modes(["reduce-overhead"], CPU, e2e=True)
    assert pick_modes("auto", CPU, e2e=True) == ["tr", "tr-shards", "tr-synthetic", "dl-compile"]
    assert mix_modes(None, CPU) == ["tr", "eager"]
    with pytest.raises(ConfigError, match="bench.epoch_mix_modes: unknown"):
        mix_modes(["turbo"], CPU)
    with pytest.raises(ConfigError, match=r"bench.modes: expects a list such as \[tr,reduce-overhead\] or auto, got 3"):
        pick_modes(3, CPU)


@pytest.mark.parametrize("override,needle", [
    ("bench.steps=0", "bench.steps: must be >= 1, got 0"),
    ("bench.repeats=0", "bench.repeats: must be >= 1, got 0"),
    ("bench.warmup=-1", "bench.warmup: must be >= 0, got -1"),
    ("bench.data={tmp}/none", "bench.data: {tmp}/none is not a folder (bench.generate=N writes"),
    ("bench.out={tmp}/a_file/b.json", "bench.out: cannot write {tmp}/a_file/b.json: "),  # under a file
])
def test_the_benchs_settings_are_checked_before_anything_is_built(override, needle, capsys, tmp_path):
    from tr_hydra.cli.bench import main
    (tmp_path / "a_file").write_text("")
    with pytest.raises(SystemExit) as e:
        main(["recipe=cpu_smoke", override.format(tmp=tmp_path)])
    err = [l for l in capsys.readouterr().err.splitlines() if l.strip()]
    assert e.value.code == 2 and len(err) == 1 and err[0].startswith(f"tr-bench: error: {needle.format(tmp=tmp_path)}")


def test_the_results_folder_is_made(tmp_path):
    from tr_hydra.bench.report import check_writable, write_json
    path = str(tmp_path / "new" / "r.json")
    check_writable(path)
    assert os.listdir(tmp_path / "new") == []  # its probe file is gone
    write_json({"a": 1}, path, quiet=True)
    assert json.loads(open(path).read()) == {"a": 1}


def test_tr_hydras_modes_runtime_settings():
    rt = _pc().runtime
    assert tr_runtime("tr-recompute", rt) == dataclasses.replace(rt, compile="inductor", recompute="pointwise")
    assert tr_runtime("tr-inductor", rt) == dataclasses.replace(rt, compile="inductor")
    assert tr_runtime("tr", rt) == dataclasses.replace(rt, compile="none")


def test_the_runtimes_progress_lines_go_to_stderr_and_every_line_is_kept(capsys):
    kept = []
    say = runtime_log(kept.append)
    say("compiling 6 variants: train_base here, 5 in 5 parallel processes")
    say("  still warming up train_base after 30s; 5 parallel compiles running")
    err = capsys.readouterr().err.splitlines()
    assert err == ["tr-bench: still warming up train_base after 30s; 5 parallel compiles running"]
    assert len(kept) == 2 and kept[1].startswith("  still")
    runtime_log()("captured 12 CUDA graphs")  # nothing kept, nothing shown
    assert capsys.readouterr().err == ""


def _record(mode: str, rate: float, **kw) -> dict:
    return {"mode": mode, "img_per_sec_median": rate, "spread": 0.01, "peak_bytes": 2**30,
            "first_step_seconds": 1.0, "memory": {}, **kw}


def test_the_table_shows_ratios_to_the_best_pytorch_mode_and_a_dash_without_one():
    rows = {line.split()[0]: line for line in report.table([_record("reduce-overhead", 4000.0),
                                                            _record("eager", 2000.0),
                                                            _record("tr-inductor", 4200.0)]).splitlines()}
    assert rows["tr-inductor"].split()[3] == "1.050"  # 4200 / 4000, the best PyTorch mode
    assert rows["eager"].split()[3] == "0.500"
    assert rows["best"] == "best PyTorch mode: reduce-overhead"
    only = report.table([_record("tr-inductor", 7890.9)]).splitlines()
    assert only[1].split()[3] == "-"  # tr_hydra alone: nothing to divide by
    assert "nan" not in "\n".join(only) and "best PyTorch mode" not in "\n".join(only)


def test_the_table_says_what_the_start_up_searched_and_tuned():
    from tr_hydra.internals.autotune_flush import FlushReport
    from tr_hydra.startup.cudnn import PrimeReport
    rep = StartupReport(cudnn=PrimeReport(calls=46, seconds=12.84))
    rec = _record("tr-inductor", 100.0, startup=rep.to_json())
    assert "tr-inductor: cuDNN's search for 46 convolutions before the first step took 12.8s" in report.table([rec])
    rep.cudnn.in_first_compile, rep.cudnn.ahead_seconds, rep.cudnn.waited = True, 41.2, 3.04
    assert ("took 12.8s, at the end of the first compile, after 41.2s on a thread beside it (waited 3.0s)"
            in report.table([_record("tr", 1.0, startup=rep.to_json())]))
    rep.cudnn.ahead_error = "ValueError: no index"
    assert ("at the end of the first compile (the thread's search beside it failed: ValueError: no index)"
            in report.table([_record("tr", 1.0, startup=rep.to_json())]))
    flush = FlushReport()
    flush.benchmarks, flush.cut, flush.full_bytes = 109, 55, 60 * 2**20
    rep = StartupReport(autotune_flush=flush)
    assert "ran 109 benchmarks in the warm-up; 55 flushed L2 with less than 60 MiB" in \
        report.table([_record("tr", 1.0, startup=rep.to_json())])
    text = report.table([_record("tr", 1.0, startup=StartupReport().to_json())])  # a CPU run's: nothing
    assert "cuDNN" not in text and "autotuning" not in text


def _mix(startup: dict | None = None, **r) -> dict:
    r = {"img_per_sec": 8637.0, "first_step_of_all_variants_seconds": 50.8,
         "step_ms_by_variant": {"train_base": 34.94, "train_last": 16.46}, **r}
    if startup is not None:
        r["startup"] = startup
    return {"variants": {"train_base": {"batch": 256, "res": 224, "train": True},
                         "train_last": {"batch": 104, "res": 224, "train": True}}, "modes": {"tr": r}}


def test_the_mix_table_says_what_each_child_and_the_main_process_compiled():
    children = {"train_last": {"ok": True, "seconds": 43.4, "start": "fork", "start_s": 0.1, "import_s": 2.0,
                               "trainer_s": 3.0, "step_s": 40.0, "kernels_tuned": 80, "kernels_kept": 53,
                               "kernels_unpaid": 12, "kernels_loaded": 4, "candidates_ahead": 560,
                               "saved_s": {"train_last": 34.5}},
                "val_last": {"ok": False, "seconds": 17.8, "start": "fork", "step_s": 15.0,
                             "saved_s": {"val_last": 2.0}, "saved_errors": {"val_last": "RuntimeError: cannot serialize"}},
                "val_base": {"ok": None, "seconds": 0.0}}
    rep = StartupReport(children=children, launcher_ready_s=3.8, loaded_s={"train_last": 0.59},
                        warmup_work={"train_base": {"compiled": 3, "loaded": 0, "coordesc_benchmarks": 2410},
                                     "train_last": {"compiled": 0, "loaded": 3}})
    lines = mix_table(_mix(rep.to_json())).splitlines()
    line = next(ln for ln in lines if "parallel compiles" in ln)
    assert line.startswith("tr: parallel compiles (fork; the launcher could fork after 3.8s): ")
    assert ("train_last 43.4s (start 0.1s, import 2.0s, runtime 3.0s, step 40.0s, 80 kernels tuned, 53 small "
            "ones kept, 12 too short to pay, 4 as tuned before, 560 candidates compiled ahead, compiled whole and "
            "saved in 34.5s)") in line
    assert "val_last 17.8s (failed) (step 15.0s, not saved (RuntimeError: cannot serialize))" in line
    assert "val_base here" in line
    assert "tr: the main process loaded 1 saved compile in 0.6s: train_last 0.59s" in lines
    assert ("tr: main process's graphs per variant: train_base compiled 3, loaded 0, 2,410 coordinate-descent "
            "benchmarks; train_last compiled 0, loaded 3") in lines
    rep = StartupReport(children=children, launcher_error="OSError: no fork")
    assert "the launcher failed: OSError: no fork" in mix_table(_mix(rep.to_json()))
    text = mix_table(_mix(StartupReport().to_json()))  # a CPU run: no compile, no lines about them
    assert "parallel" not in text and "saved compile" not in text and "graphs per variant" not in text
    assert "tr: " not in mix_table(_mix())  # a PyTorch mode's record: no start-up at all


def test_the_mix_table_says_which_loads_came_from_the_store():
    rep = StartupReport(loaded_s={"train_last": 0.59, "val_base": 0.3}, from_store=["train_last", "val_base"])
    line = next(ln for ln in mix_table(_mix(rep.to_json())).splitlines() if "saved compile" in ln)
    assert line.endswith("; 2 of them kept by an earlier run (runtime.saved_store_gb), no child compiled them"), line
    rep.preloaded = ["train_last", "val_base"]
    line = next(ln for ln in mix_table(_mix(rep.to_json())).splitlines() if "saved compile" in ln)
    assert line.endswith("no child compiled them; 2 loaded on a thread during cuDNN's search"), line
    rep.whole_compile_s = {"train_base": 41.27}
    assert "tr: compiled whole here, to be kept (runtime.saved_store_gb): train_base 41.3s" \
        in mix_table(_mix(rep.to_json())).splitlines()


def test_the_time_to_the_first_steps_is_split_into_parts_that_add_up():
    from tr_hydra.startup.cudnn import PrimeReport
    rep = StartupReport(phases={"start_children": 0.5, "record_convs": 1.0}, cudnn=PrimeReport(calls=3, seconds=2.0),
                        warmup_seconds={"train_base": 30.0, "val_base": 5.0}, graph_seconds=1.5)
    parts = ready_parts(rep, built=4.0, captured=42.0, ready=47.0)
    assert parts == {"runtime": 4.0, "start_children": 0.5, "record_convs": 1.0, "prime_cudnn": 2.0,
                     "warmup": 35.0, "graphs": 1.5, "capture_other": pytest.approx(2.0), "first_steps": 1.0}
    assert sum(parts.values()) == pytest.approx(47.0)
    rep.cudnn.in_first_compile = True  # then inside the first variant's warm-up
    assert ready_parts(rep, 4.0, 42.0, 47.0)["prime_cudnn"] == 0.0
    mix = _mix(None, ready_seconds=parts, process_seconds_before_runtime=2.5,
               first_step_of_all_variants_seconds=47.0)
    line = next(ln for ln in mix_table(mix).splitlines() if "first step of every variant" in ln)
    assert line.startswith("tr: first step of every variant after 47.0s (49.5s since the process started, "
                           "2.5s before the runtime): runtime 4.0s, start children 0.5s, record convs 1.0s")


def test_the_profiles_kernel_groups():
    dali = "DALI / nvJPEG (decode, resize, normalise)"
    g = report.kernel_group
    assert g("void dali::kernels::resampling::BatchedSeparableResampleKernel<...>") == dali
    assert g("void dali::kernels::color::ColorConversionKernel<float>") == dali  # not a convolution
    assert g("nvjpeg::decodeHuffmanGPU_kernel") == dali
    assert g("sm90_xmma_fprop_implicit_gemm_bf16bf16_bf16f32_f32_nhwckrsc_nhwc") == "convolution (cuDNN)"
    assert g("triton_poi_fused__native_batch_norm_legit_functional_relu_5") == "Inductor (Triton)"
    assert g("_update_kernel") == "tr_hydra range kernels"
    assert g("maxpool_gather_backward_kernel") == "tr_hydra max pooling backward"


def test_the_settings_lines_say_where_tr_hydras_model_computes_differently():
    pc = _pc()
    assert report.settings_lines(pc, "cpu") == []  # the CPU runs the model's own stem and pooling
    cuda = report.settings_lines(pc, "cuda")
    model_own = "; the PyTorch modes run the model's own"
    # resnet_mini: a 3x3 stride-1 stem and no max pooling, so those two paths are off, saying why
    assert ("tr_hydra stem: off, no stride-2 convolution over the image (conv1: 3x3 stride 1): plain convolution"
            in cuda), cuda
    assert not any("multiple of" in ln for ln in cuda)  # fp32: the image as it is
    assert "tr_hydra max pooling: off, no nn.MaxPool2d in the model" in cuda, cuda
    assert any(ln.startswith("tr_hydra ReLU: ") and "one-bit mask" in ln and ln.endswith(model_own) for ln in cuda)
    assert not any("16-bit gradient" in ln for ln in cuda)  # fp32: nothing converted
    amp = report.settings_lines(dataclasses.replace(pc, amp=True), "cuda")
    assert any("its input zero-padded to a multiple of 8 channels (16-bit autocast)" in ln for ln in amp), amp
    r50 = report.settings_lines(_pc("model=resnet50"), "cuda")
    assert f"tr_hydra stem: conv1 computed as a space-to-depth convolution{model_own}" in r50, r50
    assert any(ln.startswith("tr_hydra max pooling: maxpool's backward gathers") for ln in r50), r50
    assert any(ln.startswith("tr_hydra with Inductor stores a 16-bit gradient that several kernels read in 16 bits")
               for ln in amp), amp
    opts = report.settings_lines(_pc("+runtime.inductor_options={max_autotune: true}"), "cpu")
    line = ("Inductor options (runtime.inductor_options), for tr_hydra and every torch.compile mode alike: "
            "max_autotune=True")
    assert opts == [line]
    assert not any(w in ln for ln in amp for w in ("compile_gc", "cudnn_benchmark_limit", "stem_channels",
                                                    "runtime.maxpool"))


def test_the_host_and_where_bytecode_is_kept(monkeypatch, tmp_path):
    import os
    import sys

    from tr_hydra import bytecode
    monkeypatch.setattr(bytecode, "_KEPT", {"path": str(tmp_path / "bc")})
    info = report.host_info(CPU)
    assert info["bytecode"] == f"kept by tr_hydra in {tmp_path / 'bc'}"
    assert info["cores"] == os.cpu_count() and info["python_loop_ms"] > 0 and "gpu" not in info
    assert report.host_line(info).startswith(f"host: {info['cpu']}, {info['cores']} cores;")
    monkeypatch.setattr(bytecode, "_KEPT", {})
    monkeypatch.setattr(sys, "pycache_prefix", None)
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    assert report.host_info(CPU)["bytecode"] == "not written"
    assert report.python_loop_ms(2_000_000) > 3 * report.python_loop_ms(200_000)


def test_the_json_is_written_whole(tmp_path, capsys):
    import json
    path = tmp_path / "b.json"
    report.write_json({"modes": [1]}, str(path))
    assert json.loads(path.read_text()) == {"modes": [1]} and not (tmp_path / "b.json.tmp").exists()
    assert capsys.readouterr().out == f"results in {path}\n"
    report.write_json({"modes": []}, str(path), quiet=True)
    assert capsys.readouterr().out == "" and json.loads(path.read_text()) == {"modes": []}
