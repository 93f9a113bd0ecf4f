"""Loading a prebuilt kernel library (kernel_build.py builds them): every library goes through `load_library`, which
dlopens only a file that no one but this server's user or root could have put or changed there."""

from __future__ import annotations

import importlib.util
import os
import stat
from pathlib import Path
from types import ModuleType


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
