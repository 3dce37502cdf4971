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

and keeps the largest kernels by total time; given the executable's optimized HLO, each fusion among
them also names the JAX operations and source lines it fused (:func:`hlo_sources`).
``experiments.train_bench --profile`` records it per row.
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


_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=")
_CALLS = re.compile(r"\bfusion\(.*?calls=%?([\w.\-]+)")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_OPCODE = re.compile(r"=\s*(?:\([^=]*?\)|\S+)\s+([a-z][\w\-]*)\(")
_PLUMBING = {"parameter", "constant", "broadcast", "bitcast", "iota", "get-tuple-element", "tuple"}
_SHAPE = re.compile(r"=\s*\(?\w+\[([\d,]*)\]")
_FRAME = re.compile(r"stack_frame_id=(\d+)")
_SOURCE = re.compile(r'source_file="([^"]*)"\s+source_line=(\d+)')
_TABLE_ROW = re.compile(r"^(\d+)\s+(.*)$")
_FIELD = re.compile(r"(\w+)=(\d+)")


def _kernel_key(name: str) -> str:
    """A fusion's name as its kernel is named in a trace: XLA:GPU writes ``loop_fusion.7`` as ``loop_fusion_7``."""
    return name.replace(".", "_").replace("-", "_")


def _short_path(path: str) -> str:
    """A source path from the repository's folders on (``lineage_jax/layers/moe.py``), else its last two parts."""
    parts = path.replace("\\", "/").split("/")
    for i, part in enumerate(parts):
        if part in ("lineage_jax", "kernels", "experiments", "tests"):
            return "/".join(parts[i:])
    return "/".join(parts[-2:])


def hlo_sources(hlo_text: str, per_kernel: int = 3) -> dict:
    """What each XLA fusion of a compiled module computes, from its optimized HLO text
    (``compiled.as_text()``): for every fusion instruction, by the name its kernel has in a trace
    (:func:`_kernel_key`), ``per_kernel`` JAX operation names of the instructions it fused
    (``op_name`` metadata, the last two parts of the path: ``"jit(_take)/gather"``) and source lines
    (``lineage_jax/layers/moe.py:334``): the fusion's root first, then by the elements their
    instructions produce (parameters, constants, broadcasts and bitcasts left out). The profile
    names XLA's kernels; this names the library code behind them."""
    tables = {"FileNames": {}, "FunctionNames": {}, "FileLocations": {}, "StackFrames": {}}
    computations, calls, section, current = {}, {}, None, None
    for line in hlo_text.splitlines():
        stripped = line.strip()
        if stripped in tables:
            section = stripped
            continue
        if section is not None:
            row = _TABLE_ROW.match(stripped)
            if row:
                tables[section][int(row.group(1))] = row.group(2)
                continue
            section = None
        head = _COMPUTATION.match(stripped)
        if head:
            current = computations.setdefault(head.group(1), [])
            continue
        if stripped == "}":
            current = None
            continue
        ins = _INSTRUCTION.match(line)
        if ins is None or current is None:
            continue
        current.append(line)
        call = _CALLS.search(line)
        if call:
            calls[ins.group(1)] = call.group(1)

    files = {i: v.strip('"') for i, v in tables["FileNames"].items()}
    locations = {i: dict((k, int(n)) for k, n in _FIELD.findall(v)) for i, v in tables["FileLocations"].items()}
    frames = {i: dict((k, int(n)) for k, n in _FIELD.findall(v)) for i, v in tables["StackFrames"].items()}

    def where(line: str):
        src = _SOURCE.search(line)
        if src:
            return f"{_short_path(src.group(1))}:{src.group(2)}"
        frame = _FRAME.search(line)
        loc = locations.get(frames.get(int(frame.group(1)), {}).get("file_location_id")) if frame else None
        if not loc or loc.get("file_name_id") not in files:
            return None
        return f"{_short_path(files[loc['file_name_id']])}:{loc.get('line')}"

    out = {}
    for fusion, computation in calls.items():
        ops, lines = collections.Counter(), collections.Counter()
        body = computations.get(computation, [])
        root = [line for line in body if line.lstrip().startswith("ROOT ")]
        for i, line in enumerate(root + [line for line in body if not line.lstrip().startswith("ROOT ")]):
            opcode = _OPCODE.search(line)
            name = _OP_NAME.search(line)
            if not name or not name.group(1) or (opcode and opcode.group(1) in _PLUMBING):
                continue
            dims = _SHAPE.search(line)
            size = 1
            for d in (dims.group(1).split(",") if dims and dims.group(1) else []):
                size *= int(d)
            weight = float("inf") if i == 0 else size   # the fusion's result first, then by elements computed
            ops["/".join(name.group(1).split("/")[-2:])] += weight
            at = where(line)
            if at:
                lines[at] += weight
        if ops:
            out[_kernel_key(fusion)] = {"ops": [o for o, _ in ops.most_common(per_kernel)],
                                        "at": [a for a, _ in lines.most_common(per_kernel)]}
    return out


def summarize(trace: dict, calls: int, top: int = 15, hlo: str | None = None) -> dict:
    """The per-call summary of a Perfetto trace (``traceEvents`` of complete events). With ``hlo`` (the
    profiled executable's ``compiled.as_text()``) each of the largest kernels that is an XLA fusion also
    says what it fused (``source``: :func:`hlo_sources`)."""
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
    sources = hlo_sources(hlo) if hlo else {}

    def entry(n, us):
        e = {"name": n[:160], "kind": kind_of(n), "ms_per_call": ms(us), "share": us / total_us if total_us else 0.0,
             "launches_per_call": counts[n] / max(calls, 1)}
        src = sources.get(_kernel_key(n))
        return {**e, "source": src} if src else e

    return {
        "source": where, "calls": calls, "busy_ms_per_call": ms(total_us),
        "kinds": {k: {"ms_per_call": ms(v), "share": v / total_us if total_us else 0.0}
                  for k, v in kinds.most_common()},
        "top": [entry(n, us) for n, us in per_name.most_common(top)],
    }


def profile(fn: Callable[[], object], calls: int = 3, top: int = 15, hlo: str | None = None) -> dict:
    """Run ``fn()`` ``calls`` times under the profiler; the :func:`summarize` of the trace (``hlo``: the
    executable's optimized HLO text, to name what each fusion computes)."""
    with tempfile.TemporaryDirectory() as tmp:
        with jax.profiler.trace(tmp, create_perfetto_trace=True):
            for _ in range(calls):
                jax.block_until_ready(fn())
        paths = glob.glob(os.path.join(tmp, "**", "perfetto_trace.json.gz"), recursive=True)
        if not paths:
            raise RuntimeError("the profiler wrote no Perfetto trace")
        with gzip.open(paths[0], "rt") as f:
            trace = json.load(f)
    return summarize(trace, calls, top, hlo)


def table(summary: dict, title: str = "") -> str:
    """A short text table: busy time per call, per kind, and the largest kernels."""
    lines = [f"{title}busy {summary['busy_ms_per_call']:.2f} ms per call ({summary['source']})"]
    lines += [f"  {k:<11} {v['ms_per_call']:8.2f} ms  {100 * v['share']:5.1f}%" for k, v in summary["kinds"].items()]
    for t in summary["top"][:8]:
        lines.append(f"    {t['ms_per_call']:8.3f} ms {100 * t['share']:5.1f}% x{t['launches_per_call']:g}  [{t['kind']}] "
                     f"{t['name'][:90]}")
        if t.get("source"):
            lines.append(f"        {', '.join(t['source']['ops'])}" + (f"  ({', '.join(t['source']['at'])})"
                                                                       if t["source"]["at"] else ""))
    return "\n".join(lines)


if __name__ == "__main__":
    from experiments import common

    common.library_module("op_profile", ["python -m experiments.train_bench --profile N",
                                         "python -m experiments.kernel_bench --parts profile"])
