"""Suite-wide numerics and markers.

Every test runs with float32 matmuls at full float32 precision
(``jax.default_matmul_precision("highest")``): the suite checks equalities of math (chunked ==
recurrent, decode == prefill == forward, sharded == single-device), whose float32 tolerances
hold on every backend only when a float32 product is a float32 product — a GPU's default is
TF32 (10-bit mantissa), a TPU's one bf16 pass. On a CPU this changes nothing. Tests of the
backend's *default* precision are marked ``default_precision`` and take their tolerance from
:func:`tests._numerics.tolerance`.

``gpu``-marked tests need an NVIDIA GPU (compiled Triton / Mosaic GPU kernels, cuDNN, XLA:GPU
regressions) and are skipped elsewhere, with the marker's reason.
"""

import importlib.util
import os


def _cpu_only() -> bool:
    """No accelerator plugin installed (jax[cuda*] and jax[tpu] install one of these)."""
    return not any(importlib.util.find_spec(m) is not None for m in ("jax_plugins", "libtpu"))


# On a CPU-only machine the suite's time is mostly XLA:CPU compiling small programs, once each.
# LLVM's optimisation passes are most of that and buy nothing for test-sized arrays: level 0
# compiles ~40% faster (same results up to float rounding; every tolerance holds). Set before
# jax starts its backend, and inherited by the subprocesses of the CLI tests.
if _cpu_only() and "--xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip()

# The other half of XLA:CPU's compile time here is its MLIR fusion emitters; the classic elemental
# emitter generates the same fusions' loops in about half the CPU time (tests/layers/test_mla.py with
# tests/memory/test_softmax.py, one process: 103 -> 52 s of CPU; results equal up to float rounding,
# and every tolerance holds). And XLA:CPU splits each program's LLVM module into parts compiled by a
# thread pool: for the suite's small programs the split costs more than it saves (one part:
# tests/layers/test_mixers.py 78 -> 69 s of CPU). Its concurrency-optimised HLO scheduler also costs
# compile time that test-sized programs never win back (off: test_mixers.py 68 -> 66 s, test_mla.py
# with test_softmax.py 48 -> 46.5 s of CPU). Only where this jaxlib takes the flags (an unknown flag
# is fatal).
if _cpu_only():
    from tests._fake_devices import FAST_COMPILE_FLAGS, xla_takes

    for _flag, _value in FAST_COMPILE_FLAGS:
        if f"--{_flag}" not in os.environ.get("XLA_FLAGS", "") and xla_takes(_flag):
            os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --{_flag}={_value}").strip()

# One compilation cache per test run, shared by the xdist workers and the CLI tests' subprocesses
# (they inherit the environment): a program compiled by one test is loaded, not compiled again, by
# the next test that builds the same program (the same model trained by several CLI and loop tests,
# a run resumed from its checkpoint, a config compiled on both workers). Programs that compile in
# under half a second are not stored. A fresh directory every run, removed at its end, so no run
# reads another's programs; a JAX_COMPILATION_CACHE_DIR set by the caller is used as given.
_OWN_CACHE_DIR = None
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    import tempfile

    _OWN_CACHE_DIR = os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="lineage-jax-tests-")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")

import jax  # noqa: E402
import pytest  # noqa: E402

if "JAX_COMPILATION_CACHE_DIR" in os.environ:  # (in case jax was imported before this file set it)
    jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])


SUITE_PRECISION = "highest"


def pytest_configure(config):
    # Process-wide, so fixtures of every scope see it too; runs in every xdist worker.
    jax.config.update("jax_default_matmul_precision", SUITE_PRECISION)


def pytest_unconfigure(config):
    if _OWN_CACHE_DIR is not None:  # the process that made the directory (the controller under xdist)
        import shutil

        shutil.rmtree(_OWN_CACHE_DIR, ignore_errors=True)


@pytest.fixture(autouse=True)
def _backend_default_precision(request):
    if request.node.get_closest_marker("default_precision") is None:
        yield
        return
    jax.config.update("jax_default_matmul_precision", None)
    try:
        yield
    finally:
        jax.config.update("jax_default_matmul_precision", SUITE_PRECISION)


# The modules holding the suite's longest tests (20-70 s each on 2 CPU cores: fake-device
# subprocesses, CLI runs, the tiny_k3 model), in the order they start. pytest-xdist hands tests
# to its workers in collection order; started last, a one-minute test keeps one worker busy while
# the other has nothing left to run.
LONG_FIRST = ("tests/parallel/test_multi_device.py", "tests/experiments/test_scorecard.py",
              "tests/layers/test_models.py", "tests/experiments/test_decode_attnres_lm.py",
              "tests/experiments/test_mqar_niah.py", "tests/train/test_loop.py", "tests/train/test_multi_process.py")


def _start_rank(item) -> int:
    path = item.nodeid.split("::", 1)[0]
    return LONG_FIRST.index(path) if path in LONG_FIRST else len(LONG_FIRST)


def pytest_collection_modifyitems(config, items):
    items.sort(key=_start_rank)  # stable: each module keeps its own order
    if jax.default_backend() == "gpu":
        return
    for item in items:
        marker = item.get_closest_marker("gpu")
        if marker is not None:
            why = marker.kwargs.get("reason") or (marker.args[0] if marker.args else "")
            item.add_marker(pytest.mark.skip(reason=f"needs an NVIDIA GPU (backend here: "
                                                    f"{jax.default_backend()}){': ' + why if why else ''}"))
