"""Building the C loops of :mod:`.native`: the system's C compiler, and the cache of what it built.

The sources (``kernels/*.c``) are compiled once per machine and compiler by the system's C compiler (``$CC``, else
``cc``, else ``gcc``) into ``$PLUG_ASGD_CACHE`` (default ``~/.cache/plug_asgd``), and loaded from there after: the
file's name holds a digest of the sources, the flags and the compiler's identity (its path and the first line of its
``--version``), so another compiler builds its own.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from importlib import resources
from pathlib import Path

# -O3 vectorises the blocks; no -march (a cache shared by other machines must run there too: the AVX2 clone or path is
# chosen on the CPU that runs it), no fast-math and no contraction: the float operations stay those numpy does
FLAGS = ("-O3", "-fPIC", "-shared", "-ffp-contract=off", "-fno-fast-math")
KERNELS = ("selection.c", "quantize.c", "fold.c", "lowrank.c")  # in plug_asgd/compressors/kernels


def cache_dir() -> Path:
    """Where the compiled loops are kept: ``$PLUG_ASGD_CACHE``, else ``$XDG_CACHE_HOME/plug_asgd``, else
    ``~/.cache/plug_asgd``."""
    explicit = os.environ.get("PLUG_ASGD_CACHE")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "plug_asgd"


def sources() -> dict[str, str]:
    """The C sources compiled, by file name."""
    folder = resources.files("plug_asgd.compressors") / "kernels"
    return {name: (folder / name).read_text() for name in KERNELS}


def find_compiler() -> str | None:
    """The C compiler's path: ``$CC`` where set (a name on the ``PATH`` or a path), else ``cc``, else ``gcc``; None
    where it is not found."""
    named = os.environ.get("CC")
    if named:
        return shutil.which(named)
    return shutil.which("cc") or shutil.which("gcc")


def compiler_identity(compiler: str) -> str:
    """What tells one compiler from another in the cache's key: its path, the file that path resolves to, and the
    first line of its ``--version`` (empty where it says nothing).

    Args:
        compiler: the compiler's path (:func:`find_compiler`).
    """
    try:
        done = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=60)
        first = (done.stdout.strip() or done.stderr.strip()).splitlines()[:1]
    except (OSError, subprocess.SubprocessError):
        first = []
    return "\n".join([compiler, os.path.realpath(compiler), *first])


def cached_path(folder: Path, texts: dict[str, str], identity: str) -> Path:
    """Where the loops built from ``texts`` by the compiler ``identity`` names are kept in ``folder``.

    Args:
        folder: the cache folder (:func:`cache_dir`).
        texts: the C sources, by file name.
        identity: the compiler's (:func:`compiler_identity`).
    """
    key = "\0".join([*texts.values(), *FLAGS, identity])
    return folder / f"native-{hashlib.sha256(key.encode()).hexdigest()[:16]}.so"


def build(target: Path, texts: dict[str, str], compiler: str) -> None:
    """Compile ``texts`` with ``compiler`` into ``target``, written whole or not at all (another process may build it
    too).

    Args:
        target: the library's path in the cache (:func:`cached_path`).
        texts: the C sources, by file name.
        compiler: the compiler's path (:func:`find_compiler`).

    Raises:
        OSError: the compiler failed (with the last lines it said), or the folder cannot be written.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        files = []
        for name, text in texts.items():
            (Path(tmp) / name).write_text(text)
            files.append(str(Path(tmp) / name))
        built = Path(tmp) / target.name
        try:
            subprocess.run([compiler, *FLAGS, "-o", str(built), *files, "-lm"], check=True, capture_output=True,
                           text=True, timeout=120)
        except subprocess.CalledProcessError as exc:  # what the compiler said, in the warning
            said = " ".join((exc.stderr or "").strip().splitlines()[-3:])
            raise OSError(f"{compiler} failed ({exc.returncode})" + (f": {said}" if said else "")) from exc
        os.replace(built, target)


class NoCompiler(OSError):
    """No C compiler was found (:func:`find_compiler`)."""
