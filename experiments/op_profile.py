"""Where a jitted step's time goes: a profile of a few calls, summarised per kernel and per kind.

``profile(fn, calls)`` runs ``fn()`` (one step, synchronised by the caller) ``calls`` times under
``jax.profiler.trace`` and reads the Perfetto trace the profiler writes. On a GPU it sums the
kernels on the device's streams (the time the GPU is busy, per step); elsewhere the XLA
operations on the host's threads. The summary groups kernels into kinds by name:

=====================  =============================================================
``matmul``             cuBLAS / cuBLASLt / CUTLASS GEMMs (weight products, XLA dots)
``attention``          cuDNN fused attention
``pallas``             Triton / Pallas kernels (the delta-rule kernels, the grouped matmul, Pallas attention)
``fusion``             XLA's own fused kernels: elementwise, reductions, transposes, copies
``memory``             memcpy / memset
``collective``         NCCL
``other``              everything else
=====================  =============================================================

and keeps the largest kernels by total time. ``experiments.train_bench --profile`` records it
per row.
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import re
import tempfile
from typing import Callable

import jax

KINDS = (
    ("collective", re.compile(r"nccl|all[-_]?reduce|all[-_]?gather|reduce[-_]?scatter|all[-_]?to[-_]?all")),
    ("attention", re.compile(r"cudnn|fmha|flash_?att")),
    ("matmul", re.compile(r"gemm|cublas|nvjet|xmma|cutlass|sm\d\d_.*(mma|gmma)|\bdot\b")),
    # Pallas kernels on GPU carry their Python function's name: the delta-rule kernels' (kernels/delta/kernels.py)
    # , the grouped matmul's (lineage_jax/layers/grouped_pallas.py) and the short convolution's (conv_pallas.py)
    ("pallas", re.compile(r"triton|pallas|mosaic|^(intra_fwd\w*|intra_bwd\w*|state_fwd\w*|state_bwd\w*|output|gmm_\w+|causal_conv_\w+)$")),
    ("memory", re.compile(r"memcpy|memset")),
    ("fusion", re.compile(r"fusion|transpose|copy|reduce|concatenate|slice|scatter|gather|convert|broadcast|pad")),
)
_HOST_WRAPPERS = re.compile(r"^\$|^end: |::|PjitFunction|Execute|Allocate|ThreadpoolListener|TransferTo|profiler|"
                            r"ParseArguments|Handle inputs")


def kind_of(name: str) -> str:
    low = name.lower()
    for kind, pattern in KINDS:
        if pattern.search(low):
            return kind
    return "other"


def summarize(trace: dict, calls: int, top: int = 15) -> dict:
    """The per-call summary of a Perfetto trace (``traceEvents`` of complete events)."""
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    procs, threads = {}, {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            procs[e["pid"]] = e.get("args", {}).get("name", "")
        elif e.get("ph") == "M" and e.get("name") == "thread_name":
            threads[(e["pid"], e.get("tid"))] = e.get("args", {}).get("name", "")
    device = {pid for pid, name in procs.items() if "/device:" in name and "CPU" not in name}
    if device:
        streams = {k for k, name in threads.items() if k[0] in device and name.lower().startswith("stream")}
        keep = (lambda e: (e["pid"], e.get("tid")) in streams) if streams else (lambda e: e["pid"] in device)
        where = "device streams"
    else:
        keep = lambda e: not _HOST_WRAPPERS.search(e.get("name", ""))
        where = "host XLA operations"
    per_name = collections.Counter()
    counts = collections.Counter()
    for e in events:
        if e.get("ph") == "X" and keep(e):
            per_name[e["name"]] += float(e.get("dur", 0.0))
            counts[e["name"]] += 1
    total_us = sum(per_name.values())
    kinds = collections.Counter()
    for name, us in per_name.items():
        kinds[kind_of(name)] += us
    ms = lambda us: us / 1e3 / max(calls, 1)
    return {
        "source": where, "calls": calls, "busy_ms_per_call": ms(total_us),
        "kinds": {k: {"ms_per_call": ms(v), "share": v / total_us if total_us else 0.0}
                  for k, v in kinds.most_common()},
        "top": [{"name": n[:160], "kind": kind_of(n), "ms_per_call": ms(us), "share": us / total_us if total_us else 0.0,
                 "launches_per_call": counts[n] / max(calls, 1)} for n, us in per_name.most_common(top)],
    }


def profile(fn: Callable[[], object], calls: int = 3, top: int = 15) -> dict:
    """Run ``fn()`` ``calls`` times under the profiler; the :func:`summarize` of the trace."""
    with tempfile.TemporaryDirectory() as tmp:
        with jax.profiler.trace(tmp, create_perfetto_trace=True):
            for _ in range(calls):
                jax.block_until_ready(fn())
        paths = glob.glob(os.path.join(tmp, "**", "perfetto_trace.json.gz"), recursive=True)
        if not paths:
            raise RuntimeError("the profiler wrote no Perfetto trace")
        with gzip.open(paths[0], "rt") as f:
            trace = json.load(f)
    return summarize(trace, calls, top)


def table(summary: dict, title: str = "") -> str:
    """A short text table: busy time per call, per kind, and the largest kernels."""
    lines = [f"{title}busy {summary['busy_ms_per_call']:.2f} ms per call ({summary['source']})"]
    lines += [f"  {k:<11} {v['ms_per_call']:8.2f} ms  {100 * v['share']:5.1f}%" for k, v in summary["kinds"].items()]
    lines += [f"    {t['ms_per_call']:8.3f} ms {100 * t['share']:5.1f}% x{t['launches_per_call']:g}  [{t['kind']}] {t['name'][:90]}"
              for t in summary["top"][:8]]
    return "\n".join(lines)


if __name__ == "__main__":
    from experiments import common

    common.library_module("op_profile", ["python -m experiments.train_bench --profile N",
                                         "python -m experiments.kernel_bench --parts profile"])
