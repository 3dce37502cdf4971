"""Shared plumbing for the experiment scripts.

Every script ``experiments/<name>.py`` follows one convention::

    python -m experiments.<name> [--quick] [--out results]

prints a table, writes ``<out>/<name>/<name>.json`` and ``<out>/<name>/<name>.png``
and exposes ``run(quick=False, out="results") -> dict`` returning the same
JSON-able record. The helpers here build the provenance header (date, git commit,
jax version, device), the argument parser, the progress bar, the output files
and the plain-text table. Two scripts have a ``main`` of their own: ``kernel_bench`` (GPU
kernels, no ``--quick``) and ``kv_read`` (whose ``run`` takes the cache's sizes and returns the
rows); both write their record and figure to ``<out>/<name>/`` as the others do.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import platform
import re
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Sequence

import matplotlib

matplotlib.use("Agg")  # headless: scripts run on TPU VMs, GPU boxes and CI

import matplotlib.pyplot as plt  # noqa: E402  (after the backend is chosen)
import numpy as np  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parent.parent


# ----------------------------------------------------------------------------
# Provenance.
# ----------------------------------------------------------------------------
def git_commit(repo: Path | str = REPO_ROOT) -> Optional[str]:
    """The checked-out commit, read from ``.git`` files (no ``git`` process); None if unknown."""
    git_dir = Path(repo) / ".git"
    try:
        if git_dir.is_file():  # worktree / submodule: "gitdir: <path>"
            target = git_dir.read_text().strip()
            if not target.startswith("gitdir:"):
                return None
            git_dir = (Path(repo) / target.split(":", 1)[1].strip()).resolve()
        head = (git_dir / "HEAD").read_text().strip()
        if not head.startswith("ref:"):
            return head or None  # detached HEAD
        ref = head.split(":", 1)[1].strip()
        for base in (git_dir, _common_dir(git_dir)):
            ref_file = base / ref
            if ref_file.is_file():
                return ref_file.read_text().strip() or None
            packed = base / "packed-refs"
            if packed.is_file():
                for line in packed.read_text().splitlines():
                    parts = line.strip().split(" ")
                    if len(parts) == 2 and parts[1] == ref:
                        return parts[0]
        return None  # a branch with no commits yet
    except OSError:
        return None


def git_dirty(repo: Path | str = REPO_ROOT) -> Optional[bool]:
    """Whether tracked files differ from :func:`git_commit` (``git status``); None if git can't tell.

    A record with ``git_dirty: true`` ran uncommitted code on top of its commit — e.g. a copy of a
    working tree with local changes, whose git metadata still names the commit they started from."""
    try:
        out = subprocess.run(["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return bool(out.stdout.strip()) if out.returncode == 0 else None


def _common_dir(git_dir: Path) -> Path:
    common = git_dir / "commondir"
    if common.is_file():
        return (git_dir / common.read_text().strip()).resolve()
    return git_dir


def device_info() -> dict:
    """The default JAX backend: platform, device kind and count."""
    import jax

    devices = jax.devices()
    return {
        "platform": devices[0].platform,
        "device_kind": devices[0].device_kind,
        "count": len(devices),
        "description": f"{len(devices)} x {devices[0].device_kind} ({devices[0].platform})",
    }


def load_records(name: str, sources: Sequence[str]) -> list[dict]:
    """The JSON records of earlier calls of experiment ``name`` (``--merge``): each source is a
    call's ``--out`` root or the ``<name>.json`` path itself."""
    records = []
    for src in sources:
        path = Path(src) if str(src).endswith(".json") else Path(src) / name / f"{name}.json"
        if not path.is_file():
            raise ValueError(f"merge: no {name} record at {str(path)!r}")
        records.append(json.loads(path.read_text()))
    return records


def timed_calls(fn: Callable, args: Sequence, reps: int, warmup: int = 0) -> list[float]:
    """Seconds of ``reps`` calls ``fn(*args)``, each ``jax.block_until_ready``-synchronized, after
    ``warmup`` untimed calls (compile first, outside, if the compile time matters)."""
    import time

    import jax

    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return times


COMMIT_ENV = "LINEAGE_COMMIT"  # names the commit of a copied source tree (recorded_commit)


def named_commit() -> Optional[str]:
    """The commit ``LINEAGE_COMMIT`` names (7 to 40 lowercase hex digits), or None where it is unset or
    empty; any other value is refused by name (a record must not carry a wrong commit)."""
    named = os.environ.get(COMMIT_ENV, "").strip()
    if not named:
        return None
    if not re.fullmatch(r"[0-9a-f]{7,40}", named):
        raise ValueError(f"{COMMIT_ENV} must name a commit as 7 to 40 lowercase hex digits, got {named!r}")
    return named


def recorded_commit() -> Optional[str]:
    """The commit a record names: :func:`named_commit` where set (by whoever made a copy of the source
    tree: without git metadata, or with metadata naming an older commit than the code), else
    :func:`git_commit`; None if neither."""
    return named_commit() or git_commit() or None


def recorded_dirty() -> Optional[bool]:
    """:func:`git_dirty` where the recorded commit is git's own; None (unknown) where ``LINEAGE_COMMIT``
    names another commit (git's status then compares against the wrong one)."""
    named, head = named_commit(), git_commit()
    if named and not (head and head.startswith(named)):
        return None
    return git_dirty()


def provenance(name: str, quick: bool) -> dict:
    """The header every result JSON starts with."""
    import jax

    return {
        "experiment": name,
        "quick": bool(quick),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "git_commit": recorded_commit(),
        "git_dirty": recorded_dirty(),
        "jax_version": jax.__version__,
        "python_version": platform.python_version(),
        "device": device_info(),
        **({"imports": list(IMPORTED)} if IMPORTED else {}),
    }


# ----------------------------------------------------------------------------
# Output files.
# ----------------------------------------------------------------------------
def results_dir(out: str | os.PathLike, name: str) -> Path:
    """``<out>/<name>/``, created if needed."""
    path = Path(out) / name
    if path.exists() and not path.is_dir():
        raise ValueError(f"output path {str(path)!r} exists and is not a directory")
    path.mkdir(parents=True, exist_ok=True)
    return path


def to_jsonable(obj: Any) -> Any:
    """Numpy / JAX scalars and arrays -> plain Python; non-finite floats -> None."""
    if isinstance(obj, dict):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_jsonable(v) for v in obj]
    if isinstance(obj, (bool, np.bool_)):
        return bool(obj)
    if isinstance(obj, (int, np.integer)):
        return int(obj)
    if isinstance(obj, (float, np.floating)):
        value = float(obj)
        return value if math.isfinite(value) else None
    if isinstance(obj, Path):
        return str(obj)
    if hasattr(obj, "__array__"):
        return to_jsonable(np.asarray(obj).tolist())
    return obj


def finish(record: dict, name: str, out: str | os.PathLike, fig) -> dict:
    """Save ``fig`` as the PNG and ``record`` as the JSON; return the JSON-able record.

    The returned record gains ``files = {"json": ..., "png": ...}``, the paths as given by ``out``; the JSON
    on disk names them relative to ``out`` (``<name>/<name>.json``), so a record carries no machine's folder.
    """
    folder = results_dir(out, name)
    png, js = folder / f"{name}.png", folder / f"{name}.json"
    fig.savefig(png, dpi=120, bbox_inches="tight")
    plt.close(fig)
    record = to_jsonable(dict(record, files={"json": str(js), "png": str(png)}))
    saved = dict(record, files={"json": f"{name}/{js.name}", "png": f"{name}/{png.name}"})
    js.write_text(json.dumps(saved, indent=2) + "\n")
    return record


def save_partial(record: dict, name: str, out: str | os.PathLike) -> str:
    """Write ``record`` (what a long run has finished so far) as ``<name>.partial.json`` next to
    where :func:`finish` will put the final JSON, so a run cut short keeps its measurements."""
    js = results_dir(out, name) / f"{name}.partial.json"
    js.write_text(json.dumps(to_jsonable(dict(record, complete=False)), indent=2) + "\n")
    return str(js)


# ----------------------------------------------------------------------------
# CLI, progress, tables.
# ----------------------------------------------------------------------------
def _int_at_least(low: int, what: str):
    """An argparse type: an integer >= ``low``."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"expected {what}, got {value}")
        return value

    return parse


positive_int = _int_at_least(1, "a positive integer")
non_negative_int = _int_at_least(0, "an integer >= 0")


def floats(text: str) -> list[float]:
    """``"1e-3,3e-3"`` -> ``[0.001, 0.003]`` (an argparse type)."""
    return [float(v) for v in text.split(",")]


def power_of_two(text: str) -> int:
    """argparse type: a power of two >= 2."""
    value = positive_int(text)
    if value < 2 or value & (value - 1):
        raise argparse.ArgumentTypeError(f"expected a power of two >= 2, got {value}")
    return value


def _out_dir(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("--out must be a non-empty directory path")
    path = Path(text)
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"--out {text!r} exists and is not a directory")
    return text


QUICK_HELP = ("small sizes / fewer points, for a CPU (a run of seconds to a few minutes); options given "
              "explicitly keep their values")


def make_parser(name: str, description: str, quick_help: str = QUICK_HELP) -> argparse.ArgumentParser:
    """The common CLI: ``--quick``, ``--out`` and ``--import``; scripts add their own options."""
    parser = argparse.ArgumentParser(prog=f"python -m experiments.{name}", description=description)
    parser.add_argument("--quick", action="store_true", help=quick_help)
    add_out(parser, name)
    parser.add_argument("--import", dest="imports", action="append", default=[], metavar="MODULE",
                        help="import this Python module first (repeatable; recorded): one of your own that adds a "
                             "mixer (lineage_jax.models.register_rule) and a row "
                             "(experiments.architectures.register_architecture) that --only / --archs then name")
    return parser


IMPORTED: list[str] = []  # the modules --import brought in, in order (each record's provenance names them)


def import_modules(modules: Sequence[str]) -> None:
    """Import ``modules`` (``--import``; the training CLI's loader); a ``ValueError`` naming the one that fails."""
    from lineage_jax.train.config import ModuleImportError
    from lineage_jax.train.config import import_modules as load

    try:
        load(modules)
    except ModuleImportError as e:
        raise ValueError(f"--import {e.module}: {type(e.cause).__name__}: {e.cause}") from None
    IMPORTED.extend(m for m in dict.fromkeys(modules) if m not in IMPORTED)


def add_out(parser: argparse.ArgumentParser, name: str) -> None:
    """``--out``, the results root (default ``results``): files go to ``<out>/<name>/``."""
    parser.add_argument("--out", default="results", type=_out_dir,
                        help=f"results root; files go to <out>/{name}/ (default: results)")


def refuse_with_merge(merge, **given: bool) -> None:
    """``--merge`` joins earlier records and measures nothing: a ``ValueError`` naming the options
    (``given``: flag -> whether the caller set it) that it would ignore."""
    named = [flag for flag, is_set in given.items() if is_set]
    if merge and named:
        raise ValueError(f"--merge joins earlier records and runs nothing, so it takes none of "
                         f"{', '.join(given)}; got {', '.join(named)}")


def progress(iterable: Optional[Iterable] = None, *, desc: str, total: Optional[int] = None, unit: str = "it"):
    """A tqdm bar on stderr with the rate shown (stdout stays clean for tables/JSON)."""
    from tqdm.auto import tqdm

    return tqdm(iterable, desc=desc, total=total, unit=unit, file=sys.stderr, dynamic_ncols=True,
                bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}, {rate_fmt}{postfix}]")


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], title: Optional[str] = None) -> str:
    """A plain monospace table (first column left-aligned, the rest right-aligned)."""
    cells = [[str(h) for h in headers]] + [[_cell(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def line(row):
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))

    parts = [title] if title else []
    parts += [line(cells[0]), "  ".join("-" * w for w in widths)] + [line(r) for r in cells[1:]]
    return "\n".join(parts)


def _cell(value: Any) -> str:
    if isinstance(value, (float, np.floating)):
        return f"{value:.4g}"
    if isinstance(value, (list, tuple, np.ndarray)):
        return "[" + ", ".join(_cell(v) for v in np.asarray(value).ravel().tolist()) + "]"
    return str(value)


def fmt_bytes(n: float) -> str:
    """Decimal units (1 MB = 1e6 B), as GPU spec sheets use."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f} B"


def fmt_tokens(n: int) -> str:
    """1024 -> '1K', 131072 -> '128K', 1048576 -> '1M' (binary prefixes for token counts)."""
    for unit, scale in (("M", 1 << 20), ("K", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale}{unit}"
    return str(n)


def library_module(name: str, used_by: Sequence[str]) -> None:
    """``python -m experiments.<name>`` of a module that is no script: one line on stderr naming the
    scripts that use it, exit status 2."""
    print(f"experiments.{name} is a library module, not a script; it is used by {', '.join(used_by)}",
          file=sys.stderr)
    raise SystemExit(2)


def main_for(name: str, parser: argparse.ArgumentParser, run: Callable[..., dict],
             table: Callable[[dict], str], argv: Optional[Sequence[str]] = None, **extra: Any) -> dict:
    """Parse ``argv``, call ``run``, print the table and where the files went.

    A ``ValueError`` from ``run`` (the experiments' argument checks name the argument) ends the
    command as an argparse error — usage, the message, exit status 2 — not a traceback."""
    args = parser.parse_args(argv)
    kwargs = {k: v for k, v in vars(args).items() if k not in ("quick", "out", "json", "imports")}
    kwargs.update(extra)
    try:
        import_modules(getattr(args, "imports", []))
        record = run(quick=args.quick, out=args.out, **kwargs)
    except ValueError as e:
        parser.error(str(e))
    if getattr(args, "json", False):
        print(json.dumps(record))
    else:
        print(table(record))
        print(f"\nwrote {record['files']['json']} and {record['files']['png']}")
    return record
