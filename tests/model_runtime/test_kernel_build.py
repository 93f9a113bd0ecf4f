"""The bf16 kernels are built ahead of time and only loaded by the server: a machine without a compiler
runs the prebuilt library, and nothing in the server's path compiles."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from promptcache.cli import main as cli_main
from promptcache.model_runtime import avx2
from promptcache.model_runtime.attention import bf16_kernel, kernel_build, shared_prefix
from promptcache.model_runtime.attention.selection import AttentionPath, describe

needs_avx512_bf16 = pytest.mark.skipif(not bf16_kernel.supported(), reason="this CPU lacks AVX512-BF16")

# A Python process with no compiler or ninja reachable (PATH holds only the interpreter's folder) that
# loads the kernels the way the server does and prints what the server would report.
WITHOUT_COMPILER = """
import shutil, sys
from torch.utils import cpp_extension
assert shutil.which("c++") is None and shutil.which("g++") is None, "a compiler is reachable"
def refuse(*args, **kwargs):
    raise SystemExit("the server path tried to compile")
cpp_extension.load = cpp_extension.load_inline = refuse
from promptcache.model_runtime.attention import bf16_kernel
loaded = bf16_kernel.prepare()
print(loaded, bf16_kernel.unavailable_reason())
"""


def run_without_compiler(kernel_dir) -> subprocess.CompletedProcess:
    env = {**os.environ, "PATH": os.path.dirname(sys.executable), kernel_build.KERNEL_DIR_ENV: str(kernel_dir)}
    return subprocess.run([sys.executable, "-c", WITHOUT_COMPILER], env=env, capture_output=True, text=True,
                          timeout=120)


@needs_avx512_bf16
def test_a_machine_without_a_compiler_loads_the_prebuilt_kernels(bf16_kernels):
    ran = run_without_compiler(kernel_build.kernel_dir())
    assert ran.returncode == 0, ran.stderr[-2000:]
    assert ran.stdout.split()[0] == "True", ran.stdout + ran.stderr[-2000:]


@needs_avx512_bf16
def test_without_a_library_the_server_falls_back_and_says_how_to_build_it(tmp_path):
    ran = run_without_compiler(tmp_path)  # an empty kernel folder: nothing built for this torch
    assert ran.returncode == 0, ran.stderr[-2000:]
    assert ran.stdout.startswith("False ")
    assert "promptcache build-kernels" in ran.stdout and "no C++ compiler" in ran.stdout
    assert list(tmp_path.iterdir()) == []  # nothing was built


def test_the_library_name_changes_with_the_sources(tmp_path, monkeypatch):
    before = kernel_build.library_path(tmp_path)
    changed = tmp_path / "flash_bf16.cpp"
    changed.write_bytes(kernel_build.SOURCES[0].read_bytes() + b"\n// changed\n")
    monkeypatch.setattr(kernel_build, "SOURCES", (changed, *kernel_build.SOURCES[1:]))
    after = kernel_build.library_path(tmp_path)
    assert after != before and after.parent == before.parent == tmp_path
    assert after.name.startswith(kernel_build.NAME + "_") and after.suffix == ".so"


def test_kernel_dir_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv(kernel_build.KERNEL_DIR_ENV, str(tmp_path / "k"))
    assert kernel_build.kernel_dir() == tmp_path / "k"
    monkeypatch.delenv(kernel_build.KERNEL_DIR_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert kernel_build.kernel_dir() == tmp_path / "cache" / "promptcache" / "kernels"


def test_build_kernels_without_a_compiler_fails_and_names_why(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PATH", os.path.dirname(sys.executable))
    monkeypatch.setenv("CXX", "c++")
    assert cli_main(["build-kernels", "--dir", str(tmp_path)]) == 1
    assert "no C++ compiler" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


@needs_avx512_bf16
def test_build_kernels_reuses_this_torchs_library(bf16_kernels, capsys):
    """Already built for this torch and sources: the command prints its path (one line per library it builds, the
    bf16 one first) without compiling it again."""
    library = kernel_build.library_path()
    built_at = library.stat().st_mtime_ns
    assert cli_main(["build-kernels"]) == 0
    assert capsys.readouterr().out.splitlines()[0] == str(library)
    assert library.stat().st_mtime_ns == built_at


@needs_avx512_bf16
def test_the_report_names_the_kernel_once_loaded(bf16_kernels):
    report = describe("auto", torch.device("cpu"), torch.bfloat16)
    assert report.path is AttentionPath.BF16_KERNEL
    fp32 = AttentionPath.AVX2_KERNEL if avx2.KERNELS.prepare() is not None else AttentionPath.TORCH_FUSED_CPU
    assert describe("auto", torch.device("cpu"), torch.float32).path is fp32
    assert describe("matmul", torch.device("cpu"), torch.bfloat16).path is AttentionPath.MATMUL


def test_the_report_names_the_avx2_kernel_in_fp32(avx2_kernels, monkeypatch):
    assert describe("auto", torch.device("cpu"), torch.float32).path is AttentionPath.AVX2_KERNEL
    assert describe("fused_cpu", torch.device("cpu"), torch.float32).path is AttentionPath.TORCH_FUSED_CPU
    monkeypatch.setattr(avx2.KERNELS, "prepare", lambda: None)  # not built here
    assert describe("auto", torch.device("cpu"), torch.float32).path is AttentionPath.TORCH_FUSED_CPU


def test_the_report_gives_the_fallbacks_reason(monkeypatch):
    monkeypatch.setattr(bf16_kernel, "_state", {"kernel": None, "ops": None, "reason": "the CPU lacks avx512_bf16"})
    report = describe("auto", torch.device("cpu"), torch.bfloat16)
    assert report.as_dict() == {"path": "torch_fused_cpu", "reason": "the CPU lacks avx512_bf16"}
    monkeypatch.setattr(shared_prefix, "triton_installed", lambda: False)
    assert describe("auto", torch.device("cuda"), torch.bfloat16).path is AttentionPath.TORCH_GPU


def test_the_report_names_the_triton_kernel_where_it_serves(monkeypatch):
    monkeypatch.setattr(shared_prefix, "triton_installed", lambda: True)
    assert describe("auto", torch.device("cuda"), torch.bfloat16).path is AttentionPath.TRITON_SHARED
    assert describe("auto", torch.device("cuda"), torch.float32).path is AttentionPath.TORCH_GPU  # fp32: torch's ops
    assert describe("flash", torch.device("cuda"), torch.float16).path is AttentionPath.TORCH_GPU  # the kernel off
