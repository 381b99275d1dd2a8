"""What both CLIs share: composing the config and turning user mistakes into one line + exit 2."""
from __future__ import annotations

import os
import sys
from contextlib import contextmanager

import tr_hydra.config  # noqa: F401  (registers the schemas)
from tr_hydra.config.locate import config_dir
from tr_hydra.errors import TrHydraError

EXIT_USAGE = 2


def _says_nothing(text: str) -> bool:
    """A cause whose text is only a number adds nothing a person can read: the trainer's
    internal stop (the step's error is raised while it is handled) says just its step."""
    return text.lstrip("-").replace(".", "", 1).isdigit()


def one_line(e: BaseException) -> str:
    """An exception and its causes as one readable line."""
    parts, seen = [], set()
    while e is not None and id(e) not in seen and len(parts) < 3:
        seen.add(id(e))
        text = " ".join(x.strip() for x in str(e).splitlines() if x.strip()
                        and not x.strip().startswith(("full_key", "object_type", "reference_type")))
        if text and text not in parts and not (parts and _says_nothing(text)):
            parts.append(text)
        e = e.__cause__ or (e.__context__ if not e.__suppress_context__ else None)
    return ": ".join(parts) or "unknown error"


def fail(prog: str, e: BaseException):
    if os.environ.get("HYDRA_FULL_ERROR") == "1":
        raise e
    print(f"{prog}: error: {one_line(e)}", file=sys.stderr)
    sys.exit(EXIT_USAGE)


def _short(text: str, n: int = 200) -> str:
    return text if len(text) <= n else f"{text[:n]}... ({len(text):,} characters)"


def parse_overrides(overrides: list[str]) -> list:
    """Hydra's parse of ``overrides``; one that does not parse is one ``ConfigError`` naming it
    (Hydra's own message is a lexer's, over several lines)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException
    from tr_hydra.errors import ConfigError
    parser = OverridesParser.create()
    for o in overrides:
        try:
            parser.parse_overrides([o])
        except OverrideParseException:
            key, _, value = o.partition("=")
            hint = (f": quote the value ({key}='{value}') where it holds spaces, non-ASCII letters or "
                    f"any of ()[]{{}}=,'\"" if value and key.isascii() else "")
            raise ConfigError(f"{_short(o)}: Hydra cannot parse this override{hint}") from None
    return parser.parse_overrides(overrides)


def with_source_defaults(overrides: list[str], cfg) -> list[str]:
    """``data=shards``: the data settings its preparation was made from (normalisation,
    augmentation, classes: ``data.shards.recorded_data``), as overrides put before ``overrides``,
    so that the command line's own still win; ``overrides`` as they are for any other data.
    ``cfg``: what ``overrides`` compose to."""
    name = cfg.data.name
    if getattr(name, "name", name) != "shards" or not cfg.data.root:
        return overrides
    from tr_hydra.cli.rerun import value_text
    from tr_hydra.data.shards import recorded_data
    return [f"data.{k}={value_text(v)}" for k, v in recorded_data(cfg.data.root).items()] + overrides


def compose(overrides: list[str], return_hydra_config: bool = False):
    """The config ``overrides`` compose to (with its hydra node: ``return_hydra_config``); for
    ``data=shards`` on its preparation's data settings (``with_source_defaults``)."""
    cfg = _compose(overrides, return_hydra_config)
    more = with_source_defaults(overrides, cfg)
    return cfg if more == overrides else _compose(more, return_hydra_config)


def without_hydra(cfg):
    """A config composed with its hydra node (``compose(..., return_hydra_config=True)``) as the
    same overrides compose it without: the task's config, typed and checked alike."""
    import copy

    from omegaconf import open_dict
    cfg = copy.deepcopy(cfg)
    with open_dict(cfg):
        del cfg["hydra"]
    return cfg


def _compose(overrides: list[str], return_hydra_config: bool):
    from hydra import compose as hcompose, initialize_config_dir
    from tr_hydra.errors import ConfigError
    parse_overrides(overrides)
    with initialize_config_dir(str(config_dir()), version_base="1.3", job_name="tr_hydra"):
        try:
            return hcompose("config", overrides=overrides, return_hydra_config=return_hydra_config)
        except OSError as e:  # a key Hydra looks up as a config file, too long for a file name
            if e.errno is None:  # Hydra's MissingConfigException is an OSError too: its own line
                raise
            named = [o for o in overrides if e.filename and o.split("=", 1)[0].lstrip("+~") in str(e.filename)]
            key = named[0].split("=", 1)[0] if named else "an override"
            raise ConfigError(f"{_short(key)}: not an option ({e.strerror} when Hydra looks it up)") from None


@contextmanager
def user_errors(prog: str):
    """Config, plan and data mistakes exit 2 with one line (traceback with HYDRA_FULL_ERROR=1)."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException
    try:
        yield
    except (TrHydraError, HydraException, OmegaConfBaseException) as e:
        fail(prog, e)
