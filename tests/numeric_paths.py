"""The numeric paths a server can take on this machine: fp32 (through our AVX2 kernels where they are built), fp32
through PyTorch's ops alone (there: what a machine without them runs), bf16 through PyTorch's attention (what a
machine without our kernels runs), and bf16 through our kernels (AVX512-BF16 CPUs where they are built). Each rounds
differently, so an answer decided by a near-tie may differ between them. `PROMPTCACHE_TEST_NUMERIC_PATH=<name>`
makes the servers the tests start (in process, `promptcache serve`, the docs' server) take that path; scripts/test.sh
reruns the docs test and the server end-to-end tests under every path the main run did not take.
`python3 -m tests.numeric_paths --others` prints those paths' names."""

from __future__ import annotations

import os
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

SELECT_ENV = "PROMPTCACHE_TEST_NUMERIC_PATH"
MAIN_RUN = "fp32"  # the path of the main run's servers (tests/conftest.py)


@dataclass(frozen=True, slots=True)
class NumericPath:
    name: str
    env: dict[str, str] = field(default_factory=dict)  # the PROMPTCACHE_* settings that select it
    dtype: str = "float32"


def no_kernels_dir() -> str:
    """An empty kernel folder of this user's: the server finds no kernel there and runs PyTorch's attention."""
    folder = Path(tempfile.gettempdir()) / f"promptcache-no-kernels-{os.getuid()}"
    folder.mkdir(mode=0o755, exist_ok=True)
    return str(folder)


def available() -> list[NumericPath]:
    """Every path this machine can take; fp32 without kernels and bf16 through ours only where ours are built for this
    CPU."""
    from promptcache.model_runtime import avx2
    from promptcache.model_runtime.attention import bf16_kernel, kernel_build

    paths = [NumericPath(MAIN_RUN, {"PROMPTCACHE_DTYPE": "float32"}),
             NumericPath("bf16-torch", {"PROMPTCACHE_DTYPE": "bfloat16", "PROMPTCACHE_KERNEL_DIR": no_kernels_dir()},
                         "bfloat16")]
    # A rerun under a no-kernels path hides the libraries from this process too: its path was listed by the run that
    # chose it.
    hidden = os.environ.get(kernel_build.KERNEL_DIR_ENV) == no_kernels_dir()
    if avx2.KERNELS.supported() and (hidden or kernel_build.library_path(library=avx2.LIBRARY).exists()):
        paths.append(NumericPath("fp32-torch", {"PROMPTCACHE_DTYPE": "float32",
                                                "PROMPTCACHE_KERNEL_DIR": no_kernels_dir()}))
    if bf16_kernel.supported() and kernel_build.library_path().exists():
        paths.append(NumericPath("bf16-kernel", {"PROMPTCACHE_DTYPE": "bfloat16"}, "bfloat16"))
    return paths


def selected() -> NumericPath | None:
    """The path `PROMPTCACHE_TEST_NUMERIC_PATH` names (None when unset); ValueError for one this machine lacks."""
    if not (name := os.environ.get(SELECT_ENV)):
        return None
    by_name = {path.name: path for path in available()}
    if name not in by_name:
        raise ValueError(f"{SELECT_ENV}={name!r}: this machine's numeric paths are {sorted(by_name)}")
    return by_name[name]


if __name__ == "__main__":
    if sys.argv[1:] != ["--others"]:
        sys.exit("usage: python3 -m tests.numeric_paths --others")
    print(" ".join(path.name for path in available() if path.name != MAIN_RUN))
