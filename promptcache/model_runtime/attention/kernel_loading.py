"""Loading a prebuilt kernel library (kernel_build.py builds them): every library goes through `load_library`, which
dlopens only a file that no one but this server's user or root could have put or changed there."""

from __future__ import annotations

import importlib.util
import logging
import os
import stat
from pathlib import Path
from types import ModuleType
from typing import Any

from promptcache.model_runtime.cpu_features import cpu_flags

log = logging.getLogger(__name__)


class KernelLoadError(RuntimeError):
    """A kernel library was not loaded; the message says why, without paths (/health shows it)."""


def untrusted_reason(path: Path) -> str | None:
    """Why the library at `path` must not be loaded, or None. Loading runs its code as this server, so its folder
    and the file itself must be neither symbolic links nor writable by group or others, and belong to this
    process's user or root: anyone else who can write either could swap in their own code."""
    for what, target, is_kind, kind in (("its folder", path.parent, stat.S_ISDIR, "folder"),
                                        ("the library", path, stat.S_ISREG, "regular file")):
        info = os.lstat(target)  # lstat: a symbolic link is judged as itself, not followed
        if stat.S_ISLNK(info.st_mode):
            return f"{what} is a symbolic link"
        if not is_kind(info.st_mode):
            return f"{what} is not a {kind}"
        if info.st_uid not in (os.geteuid(), 0):
            return f"{what} belongs to uid {info.st_uid}, neither this server's user (uid {os.geteuid()}) nor root"
        if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            return f"{what} is writable by group or others (mode {stat.S_IMODE(info.st_mode):o})"
    return None


def load_library(path: Path) -> ModuleType:
    """Import the extension module at `path` (named by its file, `<name>.so`) once `untrusted_reason` finds nothing.
    Raises KernelLoadError: the file or its folder is refused, absent, damaged, or its libraries are missing."""
    try:
        if (reason := untrusted_reason(path)) is not None:
            raise KernelLoadError(f"the kernel library was refused: {reason}")
        spec = importlib.util.spec_from_file_location(path.stem, path)
        assert spec is not None and spec.loader is not None  # a .so path always has the extension loader
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except (OSError, ImportError) as error:  # gone meanwhile, a damaged file, a missing libgomp
        raise KernelLoadError(f"the kernel library failed to load ({type(error).__name__})") from error
    return module


class PrebuiltLibrary:
    """A kernel library that `promptcache build-kernels` compiles and the server only loads: `prepare()` loads it once
    for this CPU (never compiles) and keeps why it could not (`unavailable_reason()`, no paths: /health shows it)."""

    def __init__(self, library: Any, required_flags: frozenset[str], label: str) -> None:
        self.library = library  # a kernel_build.KernelLibrary
        self.required_flags = required_flags
        self.label = label  # names the library in log lines and reasons
        self._module: ModuleType | None = None
        self._reason: str | None = None
        self._prepared = False

    def supported(self) -> bool:
        """Whether this CPU has the instructions the library is compiled for."""
        return cpu_flags() >= self.required_flags

    def prepare(self) -> ModuleType | None:
        """The library's module, loaded on the first call; None where unavailable (`unavailable_reason()` says why)."""
        if not self._prepared:
            self._prepared = True
            if missing := sorted(self.required_flags - cpu_flags()):
                self._reason = f"the CPU lacks {', '.join(missing)}"
            else:
                self._module = self._load()
        return self._module

    def unavailable_reason(self) -> str | None:
        """Why `prepare()` found no library (None if it did or has not run)."""
        return None if self._module is not None else self._reason

    def reset(self) -> None:
        """Forget an earlier `prepare()` (a test built the library after it ran)."""
        self._module, self._reason, self._prepared = None, None, False

    def _load(self) -> ModuleType | None:
        from promptcache.model_runtime.attention import kernel_build

        path = kernel_build.library_path(library=self.library)
        if not path.exists():
            why = kernel_build.compiler_missing()
            self._reason = (f"no {self.label} kernel library built for this torch; `promptcache build-kernels` builds "
                            "it" + (f" (here it cannot: {why})" if why else ""))
            return None
        try:
            module = load_library(path)
        except KernelLoadError as error:  # refused (owner, mode, symlink), damaged, no libgomp
            self._reason = str(error)
            log.warning("%s kernels at %s not loaded: %s%s", self.label, path, error,
                        f" ({error.__cause__})" if error.__cause__ else "")
            return None
        log.info("%s kernels loaded from %s", self.label, path)
        return module
