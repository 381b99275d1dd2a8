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


def compose(overrides: list[str], return_hydra_config: bool = False):
    from hydra import compose as hcompose, initialize_config_dir
    with initialize_config_dir(str(config_dir()), version_base="1.3", job_name="tr_hydra"):
        return hcompose("config", overrides=overrides, return_hydra_config=return_hydra_config)


@contextmanager
def user_errors(prog: str):
    """Config, plan and data mistakes exit 2 with one line (traceback with HYDRA_FULL_ERROR=1)."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException
    try:
        yield
    except (TrHydraError, HydraException, OmegaConfBaseException) as e:
        fail(prog, e)
