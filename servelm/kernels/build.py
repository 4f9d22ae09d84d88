"""Building servelm's CPU kernels into one shared library, caching it per machine, and loading it.

The C kernels and the C++ files that register them as PyTorch ops are
compiled with the system's compilers (``$CC``, default ``cc``; ``$CXX``,
default ``c++``, against the headers that ship with torch) into one library
in the user's cache directory (``$XDG_CACHE_HOME/servelm/kernels``, default
``~/.cache/servelm/kernels``). The build uses ``-march=native``, so the file
name carries a hash of the sources, the flags, the compilers' versions, the
torch version and this CPU's feature flags; a new build deletes the others
that have not been opened for a month.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import platform
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path

import torch

from servelm.platform.cache import cache_dir, prune

logger = logging.getLogger(__name__)

_HERE = Path(__file__).parent
_C_SOURCES = sorted(_HERE.glob("*.c"))
_CXX_SOURCES = sorted(_HERE.glob("*.cpp"))
_HEADERS = sorted(_HERE.glob("*.h"))
_C_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC"]
# The op wrappers only check arguments and call the kernels: -O2 is plenty; torch's headers want C++20.
_CXX_FLAGS = ["-O2", "-std=c++20", "-fPIC", f"-D_GLIBCXX_USE_CXX11_ABI={int(torch.compiled_with_cxx11_abi())}"]
# Linked without -ffast-math: on older GCC that would link crtfastmath.o, whose
# constructor switches the whole process to flush-to-zero.
_LINK_FLAGS = ["-shared", "-fopenmp", "-lm"]
_TORCH_LIBS = ["-lc10", "-ltorch_cpu", "-ltorch"]


class BuildError(RuntimeError):
    """A compiler is missing or failed; the message says which and why."""


def compilers() -> tuple[str, str]:
    """The C and C++ compilers to build with (``$CC``, ``$CXX``); BuildError naming one that is not found."""
    c, cxx = os.environ.get("CC") or "cc", os.environ.get("CXX") or "c++"
    for kind, name in (("C", c), ("C++", cxx)):
        if shutil.which(name) is None:
            raise BuildError(f"no {kind} compiler ({name}) found")
    return c, cxx


def cpu_flags() -> str:
    """This CPU's feature flags (``/proc/cpuinfo``), or what the platform says of it elsewhere."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def _torch_dirs() -> tuple[Path, Path]:
    root = Path(torch.__file__).parent
    return root / "include", root / "lib"


def build(c: str, cxx: str) -> Path:
    """Compile the kernels unless this machine's build is cached; returns the library's path."""
    versions = [subprocess.run([cc, "--version"], capture_output=True, text=True, check=True).stdout for cc in (c, cxx)]
    key = hashlib.sha256()
    for part in (
        *(source.read_bytes() for source in _C_SOURCES + _CXX_SOURCES + _HEADERS),
        " ".join(_C_FLAGS + _CXX_FLAGS + _LINK_FLAGS).encode(),
        *(version.encode() for version in versions),
        torch.__version__.encode(),
        cpu_flags().encode(),
    ):
        key.update(part)
    target = cache_dir("kernels") / f"servelm_kernels-{key.hexdigest()[:16]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    include, lib_dir = _torch_dirs()
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        objects = {source: Path(tmp) / f"{source.name}.o" for source in _C_SOURCES + _CXX_SOURCES}
        compiles = [[c, *_C_FLAGS, "-c", str(src), "-o", str(objects[src])] for src in _C_SOURCES]
        compiles += [
            [cxx, *_CXX_FLAGS, f"-I{include}", "-c", str(src), "-o", str(objects[src])] for src in _CXX_SOURCES
        ]
        _run_all(compiles)
        lib = Path(tmp) / "servelm_kernels.so"
        link = [cxx, *map(str, objects.values()), "-o", str(lib), *_LINK_FLAGS, f"-L{lib_dir}", *_TORCH_LIBS]
        _run_all([[*link, f"-Wl,-rpath,{lib_dir}"]])
        os.replace(lib, target)  # atomic: a concurrent process sees no half-written file
    logger.info("compiled servelm's CPU kernels into %s", target)
    prune(target, "servelm_kernels-*.so")
    return target


def _run_all(commands: list[list[str]]) -> None:
    """Run the commands side by side (each C++ compile spends seconds in torch's headers); BuildError naming
    the first that failed, with the end of its error output."""
    # Each in its own process group: a compiler driver's own children (cc1plus) go with it when killed.
    procs = [
        subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
        for cmd in commands
    ]
    try:
        for cmd, proc in zip(commands, procs):
            stderr = proc.communicate()[1]
            if proc.returncode != 0:
                raise BuildError(f"{' '.join(cmd)} failed: {stderr.strip()[-500:]}")
    finally:  # after a failure, the compiles still running are of no use
        for proc in procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):  # it may end between the poll and the kill
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.communicate()


def load(path: Path) -> None:
    """Register the library's ops (``torch.ops.servelm``) in this process, once: a library of the same
    name (the same sources, flags and machine) loaded before, from any cache directory, already did."""
    if any(Path(loaded).name == path.name for loaded in torch.ops.loaded_libraries):
        return
    if hasattr(torch.ops.servelm, "silu_mul"):
        raise BuildError(f"another build of servelm's kernels is loaded in this process already, not {path.name}")
    torch.ops.load_library(str(path))
