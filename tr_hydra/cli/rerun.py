"""Rerun a past run from its run dir: every value of its saved config becomes an explicit
override (so today's defaults cannot change it). Only the task's config is replayed: nothing of
the saved ``hydra.yaml`` (where it ran, its logging, its sweeper or launcher) comes along, so a
rerun is one run in a new ``outputs/<date>/<time>`` (a ``hydra.run.dir=...`` on the rerun's own
command line is honoured, and refused by tr-train if that dir holds another run's results), and a
saved file cannot point the rerun at a path outside its own run dir. Keys that are no longer
options (what they chose is fixed behaviour now) are dropped, and named; a value an older run
saved unresolved (``${oc.env:...}``) is named too, since it is resolved again now."""
from __future__ import annotations

import dataclasses
import re
import sys
from pathlib import Path

from tr_hydra.errors import ConfigError

SKIP = {"recipe"}  # a recipe's values are already in the saved config
RESOLVER = re.compile(r"\$\{[\w.]+:")  # ${oc.env:...}, ${now:...}: not a plain reference to a key


def value_text(v) -> str:
    """A plain value (a saved config's) as the text of an override that sets exactly it."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, (list, tuple)):
        return "[" + ",".join(value_text(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ",".join(f"{k}:{value_text(x)}" for k, x in v.items()) + "}"
    return quoted(str(v))


def quoted(s: str) -> str:
    """``s`` as one quoted override value (a path with spaces, ``=``, non-ASCII letters...)."""
    s = s.replace("\\", "\\\\").replace("'", "\\'")
    return f"'{s}'"


def _overrides(config: dict, schema, prefix: str = "") -> tuple[list[str], list[str]]:
    """Overrides that set every value of ``config`` (a saved config's section of the dataclass
    ``schema``), and the keys ``schema`` no longer has. A field of a dataclass type is a
    section, set key by key; any other field is set whole (a map such as
    ``runtime.inductor_options`` too)."""
    fields = {f.name: f for f in dataclasses.fields(schema)}
    out, gone = [], []
    for k, v in config.items():
        f = fields.get(k)
        if f is None:
            gone.append(prefix + k)
            continue
        if not prefix and k in SKIP:
            continue
        sub = f.default_factory() if f.default_factory is not dataclasses.MISSING else None
        if isinstance(v, dict) and dataclasses.is_dataclass(sub):
            more, lost = _overrides(v, type(sub), f"{prefix}{k}.")
            out, gone = out + more, gone + lost
        else:
            if isinstance(v, str) and RESOLVER.search(v):
                print(f"--rerun: {prefix}{k} was saved unresolved ({v}); it is resolved again now, "
                      f"and may differ from the original's", file=sys.stderr)
            out.append(f"{prefix}{k}={value_text(v)}")
    return out, gone


def _tuning_of_older_runs(config: dict) -> None:
    """A config saved before ``runtime.tuning`` existed: its runs tuned only where
    ``runtime.inductor_options`` asked for coordinate descent, which ``runtime.tuning`` now
    decides (``full`` or ``none``: the rerun compiles as the original did)."""
    rt = config.get("runtime")
    if not isinstance(rt, dict) or "tuning" in rt:
        return
    opts = rt.get("inductor_options")
    asked = opts.pop("coordinate_descent_tuning", False) if isinstance(opts, dict) else False
    rt["tuning"] = "full" if asked else "none"
    if isinstance(opts, dict) and not opts:
        rt["inductor_options"] = None
    if asked:
        print("--rerun: runtime.inductor_options.coordinate_descent_tuning is runtime.tuning=full now",
              file=sys.stderr)


def _decode_of_older_runs(config: dict) -> None:
    """A config saved before ``data.decode`` existed: its CUDA runs decoded every JPEG on the GPU
    (nvJPEG), shards included, which ``data.decode=gpu`` repeats (a CPU run decodes on the host
    whatever it says)."""
    data = config.get("data")
    if isinstance(data, dict) and "decode" not in data:
        data["decode"] = "gpu"


def rerun_overrides(run_dir: str | Path, quiet: bool = False) -> list[str]:
    """The saved config of the run in ``run_dir`` as overrides (``quiet``: without the notes on
    stderr, for a resume, which keeps the run's own record).""" 
    import yaml
    hydra_dir = Path(run_dir) / ".hydra"
    cfg_path = hydra_dir / "config.yaml"
    if not cfg_path.is_file():
        raise ConfigError(f"--rerun: {cfg_path} not found (is {run_dir} a tr-train run dir?)")
    from tr_hydra.config.schema import Config
    config = yaml.safe_load(cfg_path.read_text()) or {}
    if quiet:
        import contextlib
        import io
        with contextlib.redirect_stderr(io.StringIO()):
            return rerun_overrides(run_dir)
    _tuning_of_older_runs(config)
    _decode_of_older_runs(config)
    overrides, gone = _overrides(config, Config)
    if gone:
        print(f"--rerun: {', '.join(gone)} {'is' if len(gone) == 1 else 'are'} no longer "
              f"{'an option' if len(gone) == 1 else 'options'} (what they chose is fixed now); dropped",
              file=sys.stderr)
    return overrides
