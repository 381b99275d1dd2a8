"""Python's bytecode kept in tr_hydra's cache where the environment keeps none
(``tr_hydra.bytecode``): when it is kept and when Python is left alone, that Python then really
writes and reads it there (and nothing beside the sources), that processes started from there
do the same, and that the command-line tools do it before PyTorch is imported."""
from __future__ import annotations

import importlib.util
import os
import py_compile
import subprocess
import sys
import textwrap

import pytest

from tr_hydra import bytecode


@pytest.fixture
def quiet_python(monkeypatch, tmp_path):
    """This process as in an environment that writes no bytecode and sets no prefix."""
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    monkeypatch.setattr(sys, "pycache_prefix", None)
    monkeypatch.setattr(bytecode, "_KEPT", {})
    monkeypatch.setenv("TR_HYDRA_CACHE", str(tmp_path / "cache"))
    env = {"PYTHONDONTWRITEBYTECODE": "1"}
    return env


def test_auto_keeps_it_in_the_cache_when_python_writes_none_and_torch_has_none(quiet_python, monkeypatch, tmp_path):
    monkeypatch.setattr(bytecode, "installed_with_bytecode", lambda package="torch": False)
    env = quiet_python
    path = bytecode.keep(env)
    assert path == str((tmp_path / "cache" / "bytecode").resolve())
    assert sys.pycache_prefix == path and sys.dont_write_bytecode is False
    # PYTHONDONTWRITEBYTECODE gone for the processes it starts
    assert env == {"PYTHONPYCACHEPREFIX": path, bytecode.KEPT_ENV: path}
    assert bytecode.kept() == path
    note = bytecode.note_once()
    assert path in note and "TR_HYDRA_BYTECODE_CACHE=off" in note
    assert bytecode.note_once() == ""  # once per process


@pytest.mark.parametrize("case", ["off", "user_prefix_env", "user_prefix_sys", "python_writes", "torch_has_it"])
def test_python_is_left_as_it_is(quiet_python, monkeypatch, case):
    env = quiet_python
    monkeypatch.setattr(bytecode, "installed_with_bytecode", lambda package="torch": case == "torch_has_it")
    if case == "off":
        env[bytecode.ENV] = "off"
    elif case == "user_prefix_env":
        env["PYTHONPYCACHEPREFIX"] = "/somewhere"
    elif case == "user_prefix_sys":
        monkeypatch.setattr(sys, "pycache_prefix", "/somewhere")
    elif case == "python_writes":
        monkeypatch.setattr(sys, "dont_write_bytecode", False)
    before = (dict(env), sys.pycache_prefix, sys.dont_write_bytecode)
    assert bytecode.keep(env) is None
    assert (env, sys.pycache_prefix, sys.dont_write_bytecode) == before
    assert bytecode.kept() is None and bytecode.note_once() == ""


def test_a_path_given_is_used_even_where_torch_has_bytecode(quiet_python, monkeypatch, tmp_path):
    monkeypatch.setattr(bytecode, "installed_with_bytecode", lambda package="torch": True)
    env = quiet_python
    env[bytecode.ENV] = str(tmp_path / "bc")
    assert bytecode.keep(env) == str((tmp_path / "bc").resolve())
    assert (tmp_path / "bc").is_dir()


def test_an_unwritable_folder_leaves_python_alone(quiet_python, monkeypatch, tmp_path):
    env = quiet_python
    (tmp_path / "file").write_text("x")
    env[bytecode.ENV] = str(tmp_path / "file" / "bc")  # under a file: cannot be made
    assert bytecode.keep(env) is None and sys.dont_write_bytecode is True


def test_installed_with_bytecode_looks_beside_the_sources(tmp_path, monkeypatch):
    pkg = tmp_path / "probe_pkg_bc"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("X = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert bytecode.installed_with_bytecode("probe_pkg_bc") is False
    py_compile.compile(str(pkg / "__init__.py"), cfile=importlib.util.cache_from_source(str(pkg / "__init__.py")))
    assert bytecode.installed_with_bytecode("probe_pkg_bc") is True
    monkeypatch.setattr(sys, "pycache_prefix", str(tmp_path / "elsewhere"))  # a prefix does not hide it
    assert bytecode.installed_with_bytecode("probe_pkg_bc") is True
    assert sys.pycache_prefix == str(tmp_path / "elsewhere")
    assert bytecode.installed_with_bytecode("no_such_package_here") is True  # nothing to change for it


def test_python_writes_it_there_reads_it_back_and_passes_it_on(tmp_path):
    """In real processes: ``python -B`` (writes no bytecode) keeps a module's bytecode in the
    folder given, none beside the module; a process it starts does the same, and a second
    process reads it from there instead of compiling the source."""
    mods = tmp_path / "mods"
    mods.mkdir()
    (mods / "probe_mod_bc.py").write_text("VALUE = 41 + 1\n")
    bc = tmp_path / "bc"
    script = textwrap.dedent("""
        import os, subprocess, sys
        import tr_hydra.cli  # what every tool imports first
        import probe_mod_bc
        child = subprocess.run([sys.executable, "-c",
            "import sys, tr_hydra.cli, tr_hydra.bytecode as b; print(sys.pycache_prefix, sys.dont_write_bytecode, b.kept())"],
            capture_output=True, text=True, check=True).stdout.split()
        print(probe_mod_bc.VALUE, sys.pycache_prefix, *child)
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(mods), os.getcwd()]), TR_HYDRA_BYTECODE_CACHE=str(bc))
    env.pop("PYTHONPYCACHEPREFIX", None)
    env.pop(bytecode.KEPT_ENV, None)
    out = subprocess.run([sys.executable, "-B", "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    value, prefix, child_prefix, child_quiet, child_kept = out.stdout.split()
    path = str(bc.resolve())
    # a tool started from there knows the folder was tr_hydra's choice (its trainer logs it)
    assert (value, prefix, child_prefix, child_quiet, child_kept) == ("42", path, path, "False", path)
    written = list(bc.rglob("probe_mod_bc.*.pyc"))
    assert len(written) == 1, list(bc.rglob("*"))
    assert not (mods / "__pycache__").exists()  # nothing beside the sources
    # a second process reads it: make the source unreadable as source would make a compile fail,
    # but keep its size and mtime, which is all the bytecode's header checks
    st = os.stat(mods / "probe_mod_bc.py")
    (mods / "probe_mod_bc.py").write_text("VALUE = 41 + (\n")  # same length, not valid Python
    os.utime(mods / "probe_mod_bc.py", ns=(st.st_atime_ns, st.st_mtime_ns))
    again = subprocess.run([sys.executable, "-B", "-c", "import tr_hydra.cli, probe_mod_bc; print(probe_mod_bc.VALUE)"],
                           capture_output=True, text=True, env=env, timeout=120)
    assert again.returncode == 0 and again.stdout.strip() == "42", again.stderr


def test_the_tools_keep_it_before_importing_torch(tmp_path):
    """tr-plan, started in an environment that writes no bytecode, leaves PyTorch's own
    bytecode in the folder given: the choice is made before PyTorch is imported."""
    bc = tmp_path / "bc"
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1", TR_HYDRA_BYTECODE_CACHE=str(bc))
    env.pop("PYTHONPYCACHEPREFIX", None)
    env.pop(bytecode.KEPT_ENV, None)
    out = subprocess.run([sys.executable, "-m", "tr_hydra.cli.plan", "recipe=cifar_resnet18", "data=synthetic"],
                         capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert list(bc.rglob("torch/__init__.*.pyc")), "PyTorch was imported before the choice"
    assert list(bc.rglob("tr_hydra/compiler/*.pyc"))


def test_the_trainer_says_where_once(monkeypatch, tmp_path):
    from tests.helpers import small_config
    from tr_hydra.runtime.build import Runtime
    monkeypatch.setattr(bytecode, "_KEPT", {"path": str(tmp_path / "bc")})
    logs: list[str] = []
    for _ in range(2):  # a sweep's second job, in the same process
        Runtime(small_config(), log=logs.append, source=False)
    said = [ln for ln in logs if ln.startswith("Python bytecode:")]
    assert len(said) == 1 and str(tmp_path / "bc") in said[0], logs
    monkeypatch.setattr(bytecode, "_KEPT", {})
    logs.clear()
    Runtime(small_config(), log=logs.append, source=False)
    assert not [ln for ln in logs if "bytecode" in ln], logs
