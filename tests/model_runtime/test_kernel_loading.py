"""A kernel library is loaded only from a file and folder no one but the server's user or root could have written:
anything else falls back to PyTorch's attention, with the reason in /health's `attention` and the log."""

from __future__ import annotations

import logging
import os

import pytest
import torch

from promptcache.model_runtime.attention import bf16_kernel, kernel_build, kernel_loading
from promptcache.model_runtime.attention.selection import describe

NOT_A_LIBRARY = b"\x7fELF but not really a shared object"


@pytest.fixture
def library(tmp_path):
    """A file where a library would be, in a folder of its own, both as the build leaves them (0755 / 0644)."""
    folder = tmp_path / "kernels"
    folder.mkdir(mode=0o755)
    path = folder / "promptcache_bf16_0123456789abcdef.so"
    path.write_bytes(NOT_A_LIBRARY)
    path.chmod(0o644)
    return path


def make_foreign(path, monkeypatch) -> None:
    """`path` belongs to another user (not root): chown as root, else this process pretends to be someone else."""
    if os.geteuid() == 0:
        os.chown(path, 12345, 12345)
    else:
        uid = os.geteuid()
        monkeypatch.setattr(os, "geteuid", lambda: uid + 1)


def test_a_library_the_server_user_owns_and_alone_can_write_is_loaded(library):
    assert kernel_loading.untrusted_reason(library) is None
    with pytest.raises(kernel_loading.KernelLoadError, match="failed to load"):  # checks passed; dlopen refused it
        kernel_loading.load_library(library)


@pytest.mark.parametrize(("change", "reason"), [
    (lambda lib, mp: lib.chmod(0o664), "the library is writable by group or others (mode 664)"),
    (lambda lib, mp: lib.chmod(0o646), "the library is writable by group or others"),
    (lambda lib, mp: lib.parent.chmod(0o775), "its folder is writable by group or others (mode 775)"),
    (lambda lib, mp: lib.parent.chmod(0o1777), "its folder is writable by group or others"),  # /tmp-like
    (make_foreign, "belongs to uid"),
])
def test_a_library_someone_else_could_write_is_refused(library, monkeypatch, change, reason):
    change(library, monkeypatch)
    assert reason in kernel_loading.untrusted_reason(library)
    with pytest.raises(kernel_loading.KernelLoadError, match="the kernel library was refused: "):
        kernel_loading.load_library(library)


def test_symbolic_links_are_refused(library, tmp_path):
    elsewhere = tmp_path / "elsewhere.so"
    elsewhere.write_bytes(NOT_A_LIBRARY)
    linked = library.parent / "promptcache_bf16_linked.so"
    linked.symlink_to(elsewhere)
    assert kernel_loading.untrusted_reason(linked) == "the library is a symbolic link"
    folder_link = tmp_path / "kernels-link"
    folder_link.symlink_to(library.parent)
    assert kernel_loading.untrusted_reason(folder_link / library.name) == "its folder is a symbolic link"


def test_the_server_falls_back_and_reports_why_a_library_was_refused(library, monkeypatch, caplog):
    """bf16_kernel's load (what prepare() runs on a CPU with AVX512-BF16) goes through the checks: PyTorch's
    attention, the reason (no path) where /health's `attention` shows it, the path in the warning."""
    library.chmod(0o666)
    monkeypatch.setattr(kernel_build, "library_path", lambda *args, **kwargs: library)
    monkeypatch.setattr(bf16_kernel, "_state", {})
    with caplog.at_level(logging.WARNING):
        assert bf16_kernel._load() is None
    reason = "the kernel library was refused: the library is writable by group or others (mode 666)"
    assert bf16_kernel.unavailable_reason() == reason
    assert describe("auto", torch.device("cpu"), torch.bfloat16).as_dict() == {"path": "torch_fused_cpu",
                                                                               "reason": reason}
    assert str(library) in caplog.text and reason in caplog.text and str(library) not in reason
