"""``python3 -m testbed ...`` with a python that lacks the project's packages.

The usual case is the system interpreter from the repository root (``sudo python3 -m testbed run
topologies/default.yaml``, also in the Vagrant VM's synced folder): its ``import pyroute2`` (or
``yaml``) fails. Then the same command line is run again, with ``os.execv`` (same argv, cwd and
environment, so the exit status is the command's own), by the project's environment:
``$NEZHA_VENV`` if set (the Vagrant VM keeps it outside the synced folder), else ``.venv`` next
to this package. Where that environment does not exist yet, ``./install.sh`` creates it first (as
root; ``./tb`` does the same). Where none of that can work, one line says exactly what to run.

Standard library only, and only ever imported after such an ImportError: the normal path (the
project's own python) never loads it.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import NoReturn, Optional

GUARD = "NEZHA_TESTBED_REEXEC"      # set on the re-executed process: never a second time
ROOT = Path(__file__).resolve().parent.parent
OWN = ("testbed", "nezha")          # an ImportError of our own modules is a bug, not set-up


def venv_dir(root: Path = ROOT) -> Path:
    """The project's environment: $NEZHA_VENV (relative: to the repository), else .venv."""
    v = os.environ.get("NEZHA_VENV", "").strip()
    return root / v if v else root / ".venv"      # an absolute v wins over root in "/"


def _module_command() -> Optional[tuple[str, list[str]]]:
    """The module and the interpreter's arguments when it runs ``-m testbed`` (or
    ``-m testbed.X``), else None (``import testbed`` in a program, ``-m pytest``: the
    ImportError is theirs to see)."""
    orig = list(getattr(sys, "orig_argv", None) or [])
    i = 1
    while i < len(orig):
        arg = orig[i]
        if arg.startswith("-m"):             # -m testbed, -mtestbed
            module = arg[2:] or (orig[i + 1] if i + 1 < len(orig) else "")
            return (module, orig[1:]) if module.split(".")[0] == "testbed" else None
        if not arg.startswith("-") or arg.startswith("-c") or arg == "-":
            return None                      # a script, -c or stdin: not us
        i += 2 if arg in ("-W", "-X") else 1
    if orig:
        return None
    return "testbed", ["-m", "testbed", *sys.argv[1:]]   # no orig_argv (before 3.10)


def _fail(line: str) -> NoReturn:
    print(f"testbed: {line}", file=sys.stderr)
    sys.exit(1)


def reexec(err: ImportError) -> None:
    """Handle ``err`` raised while importing the testbed under ``-m``: exec the project's
    python, or exit 1 with one line saying what to run. Returns (the caller re-raises) when
    ``err`` is not a missing third-party package or this is not ``python -m testbed``."""
    missing = getattr(err, "name", None) or ""
    if not isinstance(err, ModuleNotFoundError) or not missing \
            or missing.split(".")[0] in OWN:
        return
    command = _module_command()
    if command is None:
        return
    module, rest = command
    venv = venv_dir()
    python = venv / "bin" / "python"
    install = ROOT / "install.sh"
    chosen = os.environ.get("NEZHA_VENV", "").strip()
    setup = f"sudo {f'NEZHA_VENV={chosen} ' if chosen else ''}{install}"
    here = sys.executable or "python3"
    if os.environ.get(GUARD):
        _fail(f"{python} was run for this command and still lacks the package '{missing}': "
              f"repair it with: {setup} --force")
    try:
        same = Path(sys.prefix).resolve() == venv.resolve()
    except OSError:
        same = False
    if same:
        _fail(f"the project's environment {venv} lacks the package '{missing}': repair it "
              f"with: {setup} --force")
    if not install.is_file():
        _fail(f"{here} lacks the package '{missing}' and no install.sh is next to this copy "
              f"of the testbed ({ROOT}): install it with: {here} -m pip install -e "
              f"<the repository>   (or run the repository's ./tb)")
    if not python.exists():
        if os.geteuid() != 0:
            tb = f"   (or use: sudo {ROOT / 'tb'} {' '.join(sys.argv[1:])})" \
                if module == "testbed" else ""
            _fail(f"{here} lacks the package '{missing}' and {venv} does not exist yet: run "
                  f"once: {setup}{tb}")
        print(f"testbed: {here} lacks the package '{missing}': first use, setting up {venv} "
              f"with {install}", file=sys.stderr)
        sys.stderr.flush()
        code = subprocess.call([str(install)])
        if code != 0:
            _fail(f"{install} failed (exit {code}); run it again to see why: {setup}")
    if not os.access(python, os.X_OK):
        _fail(f"{python} is missing after {install}: run: {setup} --force")
    os.environ[GUARD] = "1"
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(str(python), [str(python), *rest])
