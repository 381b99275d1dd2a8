"""A run's record: ``.hydra/config.yaml`` (every value, resolved), ``overrides.yaml`` (the
command line's task overrides) and ``hydra.yaml`` (how Hydra ran it), written by tr_hydra once the
run dir is its own (Hydra's own writer is off: ``hydra.output_subdir: null``), each whole or not at
all. The record says what the run's weights are of: a resume of the run keeps it, and may change
only what cannot change what the run computes, each change named in the run's log."""
from __future__ import annotations

from pathlib import Path

from tr_hydra.errors import ConfigError
from tr_hydra.files import write_atomic

RECORD = ".hydra"

# what a resume may change: how long the run goes on, how it reports and keeps checkpoints, how
# its compiles are prepared; never the model, data, optimizer, schedule's shape or numerics
RESUME_MAY_CHANGE = ("trainer.epochs", "trainer.max_steps", "trainer.log_every", "trainer.progress",
                     "trainer.checkpoint_every", "trainer.keep_checkpoints", "runtime.precompile",
                     "runtime.saved_store_gb", "resume")
# sections a training run never reads (other commands' settings)
NOT_THE_RUNS = ("bench.", "prepare.", "plan.format", "recipe")


def saved_config(run_dir) -> dict | None:
    """The run dir's saved config (``.hydra/config.yaml``); None where there is none readable."""
    import yaml
    try:
        c = yaml.safe_load((Path(run_dir) / RECORD / "config.yaml").read_text())
    except (OSError, yaml.YAMLError):
        return None
    return c if isinstance(c, dict) else None


def _flat(d, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and v and not prefix + k == "runtime.inductor_options":
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = v
    return out


def _resolved(cfg) -> dict:
    from omegaconf import OmegaConf
    return OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)


def resume_changes(run_dir, cfg) -> list[str]:
    """What a resume of the run in ``run_dir`` changes against its saved config, as
    ``key old -> new``; a change of anything else than ``RESUME_MAY_CHANGE`` is refused in one
    line (a resume continues that run; a new one goes into another dir)."""
    saved = saved_config(run_dir)
    if saved is None:
        return []
    old, new = _flat(saved), _flat(_resolved(cfg))
    changed = _diff(old, new)
    _refuse(f"resume: {run_dir}", old, new, changed)
    return [f"{k} {old.get(k)!r} -> {new.get(k)!r}" for k in changed if k != "resume"]


def _diff(old: dict, new: dict) -> list[str]:
    """The keys whose values differ; a saved key that is no longer an option (the composed
    ``new`` holds every option) is not one: what it chose is fixed now, and --rerun drops it too."""
    return [k for k in sorted(set(old) | set(new))
            if old.get(k) != new.get(k) and not k.startswith(NOT_THE_RUNS) and k in new
            and not (isinstance(old.get(k), str) and "${" in old[k])]  # saved unresolved by older runs


def _refuse(where: str, old: dict, new: dict, changed: list[str]) -> None:
    refused = [k for k in changed if k not in RESUME_MAY_CHANGE]
    if refused:
        what = "; ".join(f"{k} {old.get(k)!r} there, {new.get(k)!r} here" for k in refused[:4])
        more = f" (and {len(refused) - 4} more)" if len(refused) > 4 else ""
        raise ConfigError(f"{where} holds a run of another config ({what}{more}); a resume "
                          f"continues that same run and may change only {', '.join(RESUME_MAY_CHANGE[:-1])}: "
                          f"pick another hydra.run.dir for a new run")


def explicit_changes(run_dir, saved: dict, cfg, overrides: list[str]) -> None:
    """Before a resume composes from the run's saved config: what the command line's own
    ``overrides`` (``cfg``: what they compose to today) change against it must be a change a
    resume may make; a value they leave out comes from the saved config, whatever today's
    default is."""
    named = [o.split("=", 1)[0].lstrip("+~") for o in overrides]
    named = [k for k in named if k != "recipe"]  # a recipe's values are in the saved config
    old, new = _flat(saved), _flat(_resolved(cfg))
    _refuse(f"hydra.run.dir={run_dir} already", old, new, [k for k in _diff(old, new)
                                if any(k == n or k.startswith(n + ".") for n in named)])


def write_record(run_dir, cfg, hydra_cfg) -> None:
    """The record of a new run: the config resolved (a rerun replays these values, not what an
    interpolation says on another day), the task's overrides, and Hydra's settings; a write
    that fails is one ``DiskError`` naming the file."""
    import yaml
    from omegaconf import OmegaConf
    d = Path(run_dir) / RECORD
    try:
        d.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        from tr_hydra.errors import disk_error
        raise disk_error("record", d, e, "create") from None
    try:
        hydra = OmegaConf.to_container(hydra_cfg, resolve=True, enum_to_str=True)
    except Exception:  # noqa: BLE001 - what Hydra leaves unresolved outside a job is saved as it is
        hydra = OmegaConf.to_container(hydra_cfg, resolve=False, enum_to_str=True)
    task = OmegaConf.to_container(hydra_cfg.overrides.task, resolve=False)  # as typed
    try:
        for name, obj in (("config.yaml", _resolved(cfg)), ("overrides.yaml", task), ("hydra.yaml", {"hydra": hydra})):
            write_atomic(d / name, yaml.safe_dump(obj, sort_keys=False).encode(), what="record")
    except Exception:
        for p in (d / "config.yaml", d / "overrides.yaml", d / "hydra.yaml", d):  # whole or absent
            try:
                p.rmdir() if p == d else p.unlink(missing_ok=True)
            except OSError:
                pass
        raise
