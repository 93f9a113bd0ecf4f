"""Ahead-of-time build of the bf16 CPU kernels (csrc/*.cpp) by `promptcache build-kernels` into
`promptcache_bf16_<key>.so` (key: torch's build, Python and the sources) in `$PROMPTCACHE_KERNEL_DIR`, else
`$XDG_CACHE_HOME/promptcache/kernels` (`~/.cache/promptcache/kernels`); other libraries (the batch-invariant
kernels, model_runtime/deterministic/) the same way, each named by its `KernelLibrary`."""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import sys
import sysconfig
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

NAME = "promptcache_bf16"
SOURCES = tuple(Path(__file__).parent / "csrc" / name
                for name in ("flash_bf16.cpp", "decode_bf16.cpp", "fused_bf16.cpp", "int4_bf16.cpp", "int8_bf16.cpp"))
HEADERS = tuple(Path(__file__).parent / "csrc" / name for name in ("pack_bf16.h", "attend_bf16.h", "decode_plan.h",
                                                                   "weights_bf16.h"))
CFLAGS = ("-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16", "-mfma", "-fopenmp")
LDFLAGS = ("-fopenmp",)
ARCHITECTURES = frozenset({"x86_64", "amd64"})  # the flags above are x86-64 instructions
KERNEL_DIR_ENV = "PROMPTCACHE_KERNEL_DIR"


@dataclass(frozen=True, slots=True)
class KernelLibrary:
    """What one library is compiled from: its name (the file is `<name>_<build key>.so`), sources, flags."""

    name: str
    sources: tuple[Path, ...]
    headers: tuple[Path, ...]
    cflags: tuple[str, ...]
    ldflags: tuple[str, ...]


def bf16_library() -> KernelLibrary:
    """The bf16 kernels' library (read at each call: tests swap the sources)."""
    return KernelLibrary(NAME, SOURCES, HEADERS, CFLAGS, LDFLAGS)


class KernelBuildError(RuntimeError):
    """The kernels cannot be built here (no compiler or ninja, another architecture, a failed compile)."""


def kernel_dir() -> Path:
    """Where libraries are built to and loaded from."""
    if configured := os.environ.get(KERNEL_DIR_ENV):
        return Path(configured)
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache) / "promptcache" / "kernels"


def build_key(library: KernelLibrary | None = None) -> str:
    """Hash of what the library's binary compatibility depends on: torch's build and ABI, Python's, the machine,
    the sources and flags (default library: the bf16 kernels')."""
    library = library or bf16_library()
    digest = hashlib.sha256()
    for part in (torch.__version__, torch.version.git_version, str(torch._C._GLIBCXX_USE_CXX11_ABI),
                 sysconfig.get_config_var("EXT_SUFFIX") or sys.implementation.cache_tag, platform.machine(),
                 *library.cflags, "|", *library.ldflags):
        digest.update(part.encode() + b"\0")
    for source in (*library.sources, *library.headers):
        digest.update(source.read_bytes())
    return digest.hexdigest()[:16]


def library_path(directory: Path | None = None, library: KernelLibrary | None = None) -> Path:
    """Where this torch's library is, or would be, in `directory` (default `kernel_dir()`), named by the
    extension's module name, which carries the build key (so does its PyInit_ symbol)."""
    library = library or bf16_library()
    return (directory or kernel_dir()) / f"{library.name}_{build_key(library)}.so"


def compiler_missing() -> str | None:
    """Why the kernels cannot be compiled here, or None when the toolchain is present."""
    if platform.machine().lower() not in ARCHITECTURES:
        return f"the kernels are x86-64 code; this machine is {platform.machine()}"
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        return f"no C++ compiler ({compiler}) on PATH"
    from torch.utils.cpp_extension import is_ninja_available

    return None if is_ninja_available() else "ninja is not installed (pip install ninja)"


def build(directory: Path | None = None, *, force: bool = False, verbose: bool = False,
          library: KernelLibrary | None = None) -> Path:
    """Compile `library` (default: the bf16 kernels) into `directory` (default `kernel_dir()`) unless there
    already; returns the library's path. Raises KernelBuildError when it cannot be built."""
    library = library or bf16_library()
    target = library_path(directory, library)
    if target.exists() and not force:
        return target
    if (missing := compiler_missing()) is not None:
        raise KernelBuildError(missing)
    target.parent.mkdir(mode=0o755, parents=True, exist_ok=True)  # loading refuses a folder others can write
    from torch.utils.cpp_extension import load

    # Built in a scratch directory and moved in whole: a process loading the library never sees half a file.
    with tempfile.TemporaryDirectory(prefix=".build-", dir=target.parent) as scratch:
        try:
            # is_python_module=False: compiled and linked, not imported (bf16_kernel.py imports it).
            load(name=target.stem, sources=[str(s) for s in library.sources], extra_cflags=list(library.cflags),
                 extra_ldflags=list(library.ldflags), build_directory=scratch, verbose=verbose,
                 is_python_module=False)
        except (OSError, RuntimeError, ImportError) as error:
            raise KernelBuildError(f"compiling the kernels failed: {error}") from error
        built = Path(scratch) / target.name
        if not built.exists():  # torch skips a module it compiled earlier in this process
            raise KernelBuildError("the kernels were compiled earlier in this process; rebuild in a new one")
        built.chmod(0o755)  # whatever the umask: loading refuses a library group or others can write
        os.replace(built, target)
    return target
