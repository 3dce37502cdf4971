"""XLA flags for a subprocess with ``n`` fake CPU devices (no JAX import: set before JAX starts).

Shared by ``tests/parallel/_multi_device_checks.py`` and ``tests/experiments/test_ep_scaling.py``.
"""

from __future__ import annotations

import glob
import importlib.util
import mmap
import os
import re
import subprocess
import sys
from typing import Optional

YNN_FLAG = "xla_cpu_experimental_ynn_fusion_type"
# XLA:CPU compile-time settings of the CPU-only suite beside optimisation level 0 (tests/conftest.py
# says why each): the classic elemental emitter, one LLVM module part, the plain HLO scheduler.
FAST_COMPILE_FLAGS = (("xla_cpu_use_fusion_emitters", "false"), ("xla_cpu_parallel_codegen_split_count", "1"),
                      ("xla_cpu_enable_concurrency_optimized_scheduler", "false"))


def jaxlib_knows(flag: str) -> bool:
    """Whether the installed jaxlib has XLA flag ``flag`` (an unknown flag in XLA_FLAGS is fatal)."""
    spec = importlib.util.find_spec("jaxlib")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        for lib in sorted(glob.glob(os.path.join(folder, "*.so"))):
            with open(lib, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
                if m.find(flag.encode()) >= 0:
                    return True
    return False


# The XLA flags the suite sets where this jaxlib takes them, and the environment variable that carries
# the names its flag parser refused (probed once; subprocesses and xdist workers inherit it).
OPTIONAL_FLAGS = (("xla_backend_optimization_level", "0"), ("xla_llvm_disable_expensive_passes", "true"),
                  *FAST_COMPILE_FLAGS, (YNN_FLAG, ""))
REFUSED_ENV = "LINEAGE_TESTS_REFUSED_XLA_FLAGS"


def refused_flags() -> frozenset:
    """The names among ``OPTIONAL_FLAGS`` found in jaxlib's binaries that its XLA flag parser still refuses
    (a removed flag's name can stay in the binary, e.g. as a reserved field of XLA's options proto): a
    subprocess starts XLA:CPU with them, each name its "Unknown flag in XLA_FLAGS" error names is dropped
    and it starts again. Probed once; the answer is kept in ``$LINEAGE_TESTS_REFUSED_XLA_FLAGS``."""
    if REFUSED_ENV in os.environ:
        return frozenset(n for n in os.environ[REFUSED_ENV].split(",") if n)
    left = {f: v for f, v in OPTIONAL_FLAGS if jaxlib_knows(f)}
    refused = set()
    while left:
        env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=" ".join(f"--{f}={v}" for f, v in left.items()))
        proc = subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], env=env, capture_output=True,
                              text=True, timeout=300)
        line = next((ln for ln in proc.stderr.splitlines() if "Unknown flag" in ln and "XLA_FLAGS" in ln), "")
        names = set(re.findall(r"--([A-Za-z0-9_]+)", line.split("XLA_FLAGS", 1)[-1])) & set(left)
        if proc.returncode == 0 or not names:  # started, or failed for another reason: not the flags'
            break
        refused |= names
        left = {f: v for f, v in left.items() if f not in names}
    os.environ[REFUSED_ENV] = ",".join(sorted(refused))
    return frozenset(refused)


def xla_takes(flag: str) -> bool:
    """Whether this jaxlib's XLA takes flag ``flag`` (one of ``OPTIONAL_FLAGS``) in ``XLA_FLAGS``."""
    return jaxlib_knows(flag) and flag not in refused_flags()


def fake_device_xla_flags(devices: int, base: Optional[str] = None) -> str:
    """``base`` (default: ``$XLA_FLAGS``) + ``devices`` fake CPU devices, compiled fast.

    Compile fast, run slow: these programs run once, and LLVM optimisation and the MLIR fusion
    emitters (the classic emitter compiles the same fusions in half the time) dominate. XLA:CPU in
    jaxlib 0.10.2 deadlocks on some multi-device programs (the backward of the chunked delta rules
    under fsdp=8) when YNNPACK fusions are on; plain XLA:CPU kernels do not — so they are turned
    off where this jaxlib has the flag.
    """
    flags = [os.environ.get("XLA_FLAGS", "") if base is None else base,
             f"--xla_force_host_platform_device_count={devices}"]
    for flag, value in OPTIONAL_FLAGS:
        if xla_takes(flag):
            flags.append(f"--{flag}={value}")
    return " ".join(f for f in flags if f)
