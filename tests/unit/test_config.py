"""Every option of every group composes; bad overrides fail with one line; PlanConfig checks."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tr_hydra.cli._common import compose
from tr_hydra.config.locate import config_dir
from tr_hydra.errors import ConfigError
from tr_hydra.resolve import resolve

GROUPS = ["model", "optimizer", "data", "variants", "trainer", "runtime", "plan", "dist", "bench", "recipe"]


def _options(group):
    return sorted(p.stem for p in (config_dir() / group).glob("*.yaml"))


@pytest.mark.parametrize("group,option", [(g, o) for g in GROUPS for o in _options(g)])
def test_every_option_composes(group, option, tmp_path):
    overrides = [f"{group}={option}"]
    if group == "data" and option == "imagefolder":
        overrides.append(f"data.root={tmp_path}")
    if group == "data" and option == "arrays":
        overrides.append(f"data.path={tmp_path / 'x.npz'}")
    cfg = compose(overrides)
    name = getattr(cfg[group], "name", None) if group not in ("recipe",) else None
    if name is not None:
        assert str(getattr(name, "value", name)) == option
    if group == "dist" and option == "ddp":  # needs torchrun: tested in test_distributed.py
        return
    if group not in ("data", "recipe"):  # recipes need data paths: run in test_runs.py
        resolve(cfg)  # passes every value check


def test_top_level_booleans_and_interpolated_classes():
    cfg = compose(["optimizer=lars", "amp=true", "ema=true", "model=resnet50"])
    pc = resolve(cfg)
    assert pc.amp and pc.ema and pc.optimizer.name == "lars" and pc.model.num_classes == 10


@pytest.mark.parametrize("override,needle", [
    ("model=resnet51", "resnet50"),                # unknown option lists the options
    ("model.foo=1", "foo"),                         # unknown key
    ("trainer.epochs=abc", "trainer.epochs"),       # wrong type
    ("optimizer.schedule=linear", "schedule"),      # unknown enum value
    ("optimizer.lr=-1", "optimizer.lr"),            # range checked by PlanConfig
    ("variants.batch_size=0", "variants.batch_size"),
    ("variants.batch_size=100000", "training set size"),
    ("runtime.inductor_options={coordinate_descent_tunning:true}", "runtime.inductor_options.coordinate_descent_tunning"),
    ("runtime.recompute=all", "expected one of [none, pointwise]"),
    ("runtime.tuning=some", "expected one of [auto, none, full]"),
    ("data.decode=cpu", "expected one of [auto, host, gpu]"),
    ("runtime.inductor_options={coordinate_descent_tuning:true}", "runtime.tuning decides it"),
    ("trainer.epochs=-1", "trainer.epochs: must be >= 1"),    # named before what depends on it
    ("variants.val_size=-5", "variants.val_size: must be >= 1 (or null"),
    ("data=arrays", "data.path: required for data=arrays (an .npz with"),
    # options that measured no gain are gone: the usual unknown-key line
    ("runtime.compile_gc=python", "Key 'compile_gc' not in 'RuntimeConfig'"),
    ("runtime.backward_streams=2", "Key 'backward_streams' not in 'RuntimeConfig'"),
    ("variants.pad_last_val=true", "Key 'pad_last_val' not in 'VariantsConfig'"),
    ("data.mmap=true", "Key 'mmap' not in 'DataConfig'"),
])
def test_bad_override_exits_nonzero_with_one_line(override, needle, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    out = subprocess.run([sys.executable, "-m", "tr_hydra.cli.plan", override], cwd=tmp_path,
                         capture_output=True, text=True, env=env)
    assert out.returncode == 2
    lines = [l for l in out.stderr.splitlines() if l.strip()]
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith("tr-plan: error:") and needle in lines[0], lines[0]
    assert "Traceback" not in out.stderr


def test_plan_config_is_frozen_and_fingerprinted():
    pc = resolve(compose([]))
    with pytest.raises(Exception):
        pc.amp = True  # frozen
    assert pc.fingerprint() == resolve(compose(["optimizer.lr=0.5"])).fingerprint()
    assert pc.fingerprint() != resolve(compose(["amp=true"])).fingerprint()


def test_imagefolder_without_images_is_a_config_error(tmp_path):
    (tmp_path / "train" / "a").mkdir(parents=True)
    with pytest.raises(ConfigError, match="holds no images"):
        resolve(compose(["data=imagefolder", f"data.root={tmp_path}"]))


def test_building_a_plan_config_reads_no_file_and_no_environment(monkeypatch):
    """The builder only freezes and checks: given the sizes, the world size and the checked
    Inductor options, a config whose dataset root does not exist, under a torchrun environment
    that says otherwise, gives the plan those values make (written out here by hand), and
    nothing is opened or listed and no variable read while it is built."""
    import collections.abc

    from omegaconf import OmegaConf

    from tr_hydra.config import schema
    from tr_hydra.config.epochs import VariantSpec
    from tr_hydra.config.plan_config import PlanConfig, plan_config_from
    from tr_hydra.config.specs import DataSpec, DistSpec, ModelSpec, RuntimeSpec
    cfg = schema.Config(model=schema.ModelConfig(num_classes=3),
                        data=schema.DataConfig(name=schema.DataName.imagefolder, root="/nonexistent/data",
                                               num_classes=3),
                        variants=schema.VariantsConfig(batch_size=4, val_batch_size=8, base_res=16, val_res=16),
                        runtime=schema.RuntimeConfig(inductor_options={"max_autotune": True}),
                        dist=schema.DistConfig(mode=schema.DistMode.ddp))
    given = dict(train_size=13, val_size=10, world_size=2, inductor_options=(("max_autotune", True),))
    expected = PlanConfig(
        model=ModelSpec(name="resnet_mini", num_classes=3),
        data=DataSpec(name="imagefolder", root="/nonexistent/data", num_classes=3),
        runtime=RuntimeSpec(inductor_options=(("max_autotune", True),)), dist=DistSpec(mode="ddp"),
        world_size=2, batch_size=4, val_batch_size=8, train_size=6, val_size=5,  # 13 // 2, 10 // 2 a rank
        variants=(VariantSpec("train_base", True, 4, 16), VariantSpec("train_last", True, 2, 16),
                  VariantSpec("val_base", False, 5, 16)))
    plan_config_from(cfg, **given)  # what it imports, imported before the watch begins

    class Watched(collections.abc.MutableMapping):
        def __init__(self, env):
            self.env, self.read = env, []

        def __getitem__(self, k):
            self.read.append(k)
            return self.env[k]

        def __contains__(self, k):
            self.read.append(k)
            return k in self.env

        def __iter__(self):
            self.read.append("*")
            return iter(self.env)

        def __len__(self):
            return len(self.env)

        def __setitem__(self, k, v):
            self.env[k] = v

        def __delitem__(self, k):
            del self.env[k]
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("RANK", "0")
    env = Watched(os.environ)
    opened = []
    watching = [True]

    def audit(event, args):
        if watching[0] and event in ("open", "os.listdir", "os.scandir"):
            opened.append((event, args[0]))
    sys.addaudithook(audit)  # stays for the process; records only while watching
    monkeypatch.setattr(os, "environ", env)
    try:
        built = [plan_config_from(cfg, **given), plan_config_from(OmegaConf.structured(cfg), **given)]
    finally:
        watching[0] = False
        monkeypatch.setattr(os, "environ", env.env)
    assert opened == [] and env.read == [], (opened, env.read)
    assert built == [expected, expected]


@pytest.mark.parametrize("override,needle", [
    ("variants.lowres_res=64", "variants.lowres_res"),
    ("trainer.keep_checkpoints=0", "trainer.keep_checkpoints"),
    ("optimizer=adam", None),
    ("data.num_threads=0", "data.num_threads"),
    ("data.num_threads=many", "data.num_threads"),
    ("data.hw_decoder_load=1.5", "data.hw_decoder_load"),
    ("ema_decay=1.5", "ema_decay"),
    ("trainer.label_smoothing=1.0", "trainer.label_smoothing"),
    ("runtime.precompile=-1", "runtime.precompile"),
    ("runtime.precompile=off", "runtime.precompile"),
    ("runtime.saved_store_gb=-1", "runtime.saved_store_gb"),
])
def test_value_ranges(override, needle):
    overrides = [override] + (["variants.lowres_epochs=1"] if "lowres" in override else [])
    if needle is None:
        resolve(compose(overrides + ["optimizer.eps=1e-8"]))
        with pytest.raises(ConfigError, match="optimizer.eps"):
            resolve(compose(overrides + ["optimizer.eps=0"]))
        return
    with pytest.raises(ConfigError, match=needle.replace(".", r"\.")):
        resolve(compose(overrides))


def test_rerun_of_a_config_saved_with_options_since_removed_drops_them_and_says_so(tmp_path, capsys):
    """A run saved while runtime.stem, runtime.compile_gc and variants.pad_last_val were options
    reruns without them (what they chose is fixed now), named on one line; every other value
    is kept, inductor options whole, and the overrides compose."""
    import yaml

    from tr_hydra.cli.rerun import rerun_overrides
    (tmp_path / ".hydra").mkdir()
    cfg = {"model": {"name": "resnet_mini", "width": 8},
           "runtime": {"compile": "none", "stem": "conv", "compile_gc": "deferred",
                       "inductor_options": {"max_autotune": True}},
           "variants": {"batch_size": 32, "pad_last_val": False}, "seed": 5}
    (tmp_path / ".hydra" / "config.yaml").write_text(yaml.safe_dump(cfg))
    got = rerun_overrides(tmp_path)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and all(k in err[0] for k in ("runtime.stem", "runtime.compile_gc",
                                                       "variants.pad_last_val")), err
    assert not any(k in o for o in got for k in ("stem", "compile_gc", "pad_last_val")), got
    assert {"model.width=8", "runtime.compile='none'", "variants.batch_size=32", "seed=5",
            "runtime.inductor_options={max_autotune:true}",
            "runtime.tuning='none'"} <= set(got), got  # saved before runtime.tuning: it did not tune
    pc = resolve(compose(got))
    assert pc.model.width == 8 and pc.seed == 5 and pc.runtime.inductor_options == (("max_autotune", True),)
    assert pc.runtime.tuning == "none"


def test_rerun_of_a_run_that_asked_for_coordinate_descent_tunes_again(tmp_path, capsys):
    """Saved before runtime.tuning: coordinate descent through runtime.inductor_options is
    runtime.tuning=full now (the map is left without it), said on one line."""
    import yaml

    from tr_hydra.cli.rerun import rerun_overrides
    (tmp_path / ".hydra").mkdir()
    cfg = {"runtime": {"inductor_options": {"coordinate_descent_tuning": True}}, "seed": 5}
    (tmp_path / ".hydra" / "config.yaml").write_text(yaml.safe_dump(cfg))
    got = rerun_overrides(tmp_path)
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["--rerun: runtime.inductor_options.coordinate_descent_tuning is runtime.tuning=full now"]
    pc = resolve(compose(got))
    assert pc.runtime.tuning == "full" and pc.runtime.inductor_options == ()
    (tmp_path / ".hydra" / "config.yaml").write_text(yaml.safe_dump({"runtime": {"tuning": "auto"}}))
    assert "runtime.tuning='auto'" in rerun_overrides(tmp_path)  # saved with it: as saved


def test_rerun_of_a_run_saved_before_data_decode_decodes_on_the_gpu_as_it_did(tmp_path):
    """Saved before data.decode: every CUDA run decoded its JPEGs with nvJPEG, shards included, so
    the rerun asks for data.decode=gpu (the default would decode shards on the host: other
    pixels); a config saved with it reruns as saved."""
    import yaml

    from tr_hydra.cli.rerun import rerun_overrides
    (tmp_path / ".hydra").mkdir()
    cfg = {"data": {"name": "digits", "num_threads": 2}, "seed": 5}
    (tmp_path / ".hydra" / "config.yaml").write_text(yaml.safe_dump(cfg))
    got = rerun_overrides(tmp_path)
    assert "data.decode='gpu'" in got and "data.num_threads=2" in got, got
    assert resolve(compose(got)).data.decode == "gpu"
    cfg["data"]["decode"] = "auto"
    (tmp_path / ".hydra" / "config.yaml").write_text(yaml.safe_dump(cfg))
    assert "data.decode='auto'" in rerun_overrides(tmp_path)


def test_the_runtime_yaml_holds_every_schema_option_with_its_default_and_a_doc():
    """conf/runtime/default.yaml and the schema declare the same options with the same
    defaults, each with a one-line comment."""
    import dataclasses
    import enum
    import re

    import yaml

    from tr_hydra.config.schema import RuntimeConfig
    text = (config_dir() / "runtime" / "default.yaml").read_text()
    values = yaml.safe_load(text)
    fields = {f.name: f.default.value if isinstance(f.default, enum.Enum) else f.default
              for f in dataclasses.fields(RuntimeConfig)}
    assert values == fields
    lines = [ln for ln in text.splitlines() if re.match(r"^[a-z_]+:", ln)]
    assert len(lines) == len(fields) and all("# " in ln for ln in lines), lines


def test_inductor_options_are_checked_and_kept_as_sorted_pairs():
    """runtime.inductor_options: names and value types from this PyTorch's Inductor config
    (nested maps dotted); an unknown name, a wrong type or an option the runtime owns is a
    one-line ConfigError naming the key."""
    import torch._inductor.config as ic
    pc = resolve(compose(["runtime.inductor_options={max_autotune:true,"
                          "triton:{persistent_reductions:false},max_autotune_gemm_backends:ATEN}"]))
    opts = pc.runtime.inductor_options
    assert opts == (("max_autotune", True), ("max_autotune_gemm_backends", "ATEN"),
                    ("triton.persistent_reductions", False))
    assert all(name in ic.get_config_copy() for name, _ in opts)
    assert hash(pc.runtime) == hash(pc.runtime)  # the spec stays hashable
    assert resolve(compose([])).runtime.inductor_options == ()
    assert resolve(compose(["runtime.inductor_options={triton:{multi_kernel:0}}"])
                   ).runtime.inductor_options == (("triton.multi_kernel", 0),)
    for override, needle in [
        ("runtime.inductor_options={coordinate_descent_tunning:true}", "not an Inductor option"),
        ("runtime.inductor_options={persistent_reductions:false}", "did you mean triton.persistent_reductions"),
        ("runtime.inductor_options={max_autotune:3}", "expects bool, got 3"),
        ("runtime.inductor_options={coordinate_descent_tuning:true}", "runtime.tuning decides it"),
        ("runtime.inductor_options=3", "expects a map such as"),
        ("runtime.inductor_options={max_autotune_gemm_backends:true}", "expects str"),
        ("runtime.inductor_options={triton:{cudagraphs:true}}", "captures the whole step"),
        ("runtime.inductor_options={triton:{multi_kernel:1}}", "1 not supported: .*loading compiled kernels"),
    ]:
        with pytest.raises(ConfigError, match=f"runtime.inductor_options.*{needle}") as e:
            resolve(compose([override]))
        assert "\n" not in str(e.value)


def test_every_runtime_option_has_a_row_in_the_readme():
    """The README's "Runtime options" table documents each key of the runtime schema, and no
    key that does not exist."""
    import dataclasses
    import re
    from pathlib import Path
    from tr_hydra.config.schema import RuntimeConfig
    text = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = text.split("### Runtime options (`runtime.`)", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `([a-z_]+)` \|", section, flags=re.M)
    assert len(rows) == len(set(rows)) and sorted(rows) == sorted(f.name for f in dataclasses.fields(RuntimeConfig)), rows
