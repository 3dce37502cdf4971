"""Compile every GPU kernel of :mod:`kernels.delta` to cubin on a machine without a GPU.

Triton compile failures and compile-time blowups show up here, before any GPU run. This
lowers each Pallas kernel to Triton IR (``jax.export`` for ``cuda``, capturing the module
that Pallas hands to XLA) and compiles it with the ``triton`` package for sm_90, printing
the compile time per kernel. Needs ``pip install triton==3.6.0`` (the version of the GPU measurements);
not imported by the package.

    python -m kernels.delta.triton_compile_check --gate kda --docs 1 --dtype bf16 --T 8192
    python -m kernels.delta.triton_compile_check --gate all --dtype bf16,f32 --chunk_size 32,64

Each kernel's line gives its registers and spills (``ptxas -v``); ``--sass`` adds its SASS
instruction count (``nvdisasm``); ``--layouts`` the warp layouts Triton chose for its matmuls
(``mma=v2[4,1]``: ``mma.sync`` with 4 warps over the rows — over a 16- or 32-row product, warps repeat
each other's rows). ``--forward_only`` lowers the undifferentiated call (its forward
kernels without residuals: the state pass takes the output and stores nothing else) instead of
fwd+bwd; ``--qk_arrays``, ``--state_pairs``, ``--transposed_state``, ``--intra``, ``--chunks_per_program``,
``--fixup_chunks``, ``--state_dot`` and
``--num_warps_fwd`` pass those launch knobs.
``--gate``: ``kda`` (exact per-channel), ``kda_bounded`` (``gate_lower_bound=-5``), ``gdn`` (scalar
gate), ``none`` (DeltaNet) or ``all``; ``--dtype`` and ``--chunk_size`` take
comma-separated lists (every combination is lowered and compiled).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

from .tiles import INTRAS, STATE_DOTS

GATES = ("none", "gdn", "kda", "kda_bounded")


def dump_ttir(outdir, gate, docs, dtype, B, T, H, K, V, chunk_size=None, anchored_bwd=None, inverse=None, bv=None,
              anchored_fwd=None, qk_arrays=None, state_pairs=None, forward_only=False, intra=None,
              chunks_per_program=None, fixup_chunks=None, transposed_state=None, state_dot=None):
    import jax
    import jax.numpy as jnp
    from jax._src.pallas.triton import lowering as L
    from jax._src.pallas.triton import pallas_call_registration as R

    from . import api

    count = [0]
    orig = L.lower_jaxpr_to_triton_module

    def hook(jaxpr, grid_mapping, *a, **k):
        res = orig(jaxpr, grid_mapping, *a, **k)
        name = jaxpr.debug_info.func_name if jaxpr.debug_info else "kernel"
        count[0] += 1
        with open(os.path.join(outdir, f"{count[0]:02d}_{name}.ttir"), "w") as f:
            f.write(res.module.operation.get_asm(enable_debug_info=False))
        return res

    R.lowering.lower_jaxpr_to_triton_module = hook
    try:
        dt = jnp.bfloat16 if dtype == "bf16" else jnp.float32
        sd = jax.ShapeDtypeStruct
        args = [sd((B, T, H, K), dt), sd((B, T, H, K), dt), sd((B, T, H, V), dt), sd((B, T, H, K), jnp.float32),
                sd((B, T, H), dt), sd((B, H, K, V), jnp.float32), sd((B, T), jnp.int32)]

        def f(q, k, v, g, b, S, seg):
            kw = dict(initial_state=S, segment_ids=seg if docs else None, target="gpu", interpret=False,
                      chunk_size=chunk_size, **({} if inverse is None else {"inverse": inverse}),
                      **({} if bv is None else {"bv": bv}),
                      **({} if state_pairs is None else {"state_pairs": state_pairs}),
                      **({} if transposed_state is None else {"transposed_state": transposed_state}),
                      **({} if qk_arrays is None or gate.startswith("kda") else {"qk_arrays": qk_arrays}),
                      **({} if intra is None else {"intra": intra}),
                      **({} if state_dot is None else {"state_dot": state_dot}),
                      **({} if chunks_per_program is None else {"chunks_per_program": chunks_per_program}))
            kda_kw = {**({} if anchored_fwd is None else {"anchored_fwd": anchored_fwd}),
                      **({} if fixup_chunks is None else {"fixup_chunks": fixup_chunks})}

            def loss(q, k, v, g, b, S):
                if gate == "kda":
                    o, s = api.chunk_kda(q, k, v, g, b, **kw, **kda_kw)
                elif gate == "kda_bounded":
                    o, s = api.chunk_kda(q, k, v, g, b, gate_lower_bound=-5.0, anchored_bwd=anchored_bwd, **kw)
                elif gate == "gdn":
                    o, s = api.chunk_gated_delta_rule(q, k, v, g[..., 0], b, **kw)
                else:
                    o, s = api.chunk_delta_rule(q, k, v, b, **kw)
                return jnp.sum(o.astype(jnp.float32)) + jnp.sum(s)
            if forward_only:  # the undifferentiated call: no residuals, the output fused, no h or Ũ
                return loss(q, k, v, g, b, S)
            return jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4, 5))(q, k, v, g, b, S)

        jax.export.export(jax.jit(f), platforms=["cuda"], disabled_checks=[
            jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(*args)
    finally:
        R.lowering.lower_jaxpr_to_triton_module = orig
    return count[0]


def ptxas_usage(kernel) -> str:
    """Registers per thread and spill bytes of a compiled kernel, from ``ptxas -v`` on its PTX
    (Triton's bundled ptxas; no GPU needed). Spills are local-memory traffic in the hot loop."""
    import re
    import subprocess

    from triton.backends.nvidia import compiler as nv

    ptxas = os.path.join(os.path.dirname(nv.__file__), "bin", "ptxas")
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(kernel.asm["ptx"])
    try:
        out = subprocess.run([ptxas, "-v", "--gpu-name", "sm_90a", f.name, "-o", os.devnull],
                             capture_output=True, text=True, timeout=600).stderr
    except Exception as e:  # noqa: BLE001
        return f"ptxas: {e}"
    finally:
        os.unlink(f.name)
    regs = re.search(r"Used (\d+) registers", out)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", out)
    return (f"regs={regs.group(1) if regs else '?'} "
            f"spill_st={spill.group(1) if spill else '?'}B spill_ld={spill.group(2) if spill else '?'}B")


def sass_count(kernel) -> str:
    """Machine instructions in a compiled kernel's SASS (Triton's bundled ``nvdisasm`` on its cubin;
    no GPU needed): the code one thread runs, loops counted once."""
    import re
    import subprocess

    from triton.backends.nvidia import compiler as nv

    nvdisasm = os.path.join(os.path.dirname(nv.__file__), "bin", "nvdisasm")
    with tempfile.NamedTemporaryFile("wb", suffix=".cubin", delete=False) as f:
        f.write(kernel.asm["cubin"])
    try:
        out = subprocess.run([nvdisasm, "-c", f.name], capture_output=True, text=True, timeout=600).stdout
    except Exception as e:  # noqa: BLE001
        return f"nvdisasm: {e}"
    finally:
        os.unlink(f.name)
    # one instruction per "/*addr*/ [@predicate] OPCODE" line
    n = len(re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?[A-Z][A-Z0-9_]*", out))
    return f"sass={n}"


def mma_layouts(kernel) -> str:
    """The distinct ``nvidia_mma`` encodings of a compiled kernel's TTGIR, as ``mma=v2[4,1],v3[4,1]``
    (version, ``warpsPerCTA``): which warp grid each matmul runs on."""
    import re
    found = re.findall(r"nvidia_mma<\{versionMajor = (\d+)[^}]*?warpsPerCTA = \[([0-9, ]+)\]", kernel.asm["ttgir"])
    return "mma=" + (",".join(sorted({f"v{v}[{w.replace(' ', '')}]" for v, w in found})) or "none")


def compile_all(outdir, num_warps=4, label="", num_warps_scores=None, num_warps_state=None, num_warps_fwd=None,
                num_warps_solve=None, sass=False, layouts=False):
    import triton
    from triton.backends.compiler import GPUTarget

    from . import api

    ok = True
    times = {}
    for name in sorted(os.listdir(outdir)):
        if not name.endswith(".ttir"):
            continue
        t = time.time()
        try:
            # the launch's own pipelining: the state passes' chunk loops run STATE_STAGES stages, the
            # intra-chunk kernels looping over chunks (api._grouped) PROGRAM_STAGES
            stages = api.STATE_STAGES if "_state_" in name else api.PROGRAM_STAGES if "_grouped" in name else 1
            # ... and its warps: the backward's scores kernel may run wider (api.default_warps_scores), the
            # forward's intra-chunk kernel and the backward's solve kernel narrower (api.default_warps_fwd,
            # api.default_warps_solve)
            warps = num_warps_scores if num_warps_scores and "intra_bwd_scores" in name else num_warps
            if num_warps_fwd and "intra_fwd" in name:
                warps = num_warps_fwd
            if num_warps_solve and "intra_bwd_solve" in name:
                warps = num_warps_solve
            if num_warps_state and "_state_" in name:
                warps = num_warps_state
            k = triton.compile(os.path.join(outdir, name), target=GPUTarget("cuda", 90, 32),
                               options={"num_warps": warps, "num_stages": stages})
            dt = time.time() - t
            times[name] = dt
            print(f"{label}{name:28s} OK   {dt:6.1f} s  shared={k.metadata.shared}  {ptxas_usage(k)}"
                  + (f" {sass_count(k)}" if sass else "") + (f" {mma_layouts(k)}" if layouts else ""), flush=True)
        except Exception as e:  # noqa: BLE001
            ok = False
            print(f"{label}{name:28s} FAIL {time.time() - t:6.1f} s  {str(e)[:800]}", flush=True)
    return ok, times


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gate", default="kda", help="kda | kda_bounded | gdn | none | all (comma-separated)")
    ap.add_argument("--docs", type=int, default=0)
    ap.add_argument("--dtype", default="bf16", help="bf16 | f32 (comma-separated)")
    ap.add_argument("--T", type=int, default=8192)
    ap.add_argument("--chunk_size", default=None, help="default (per target) or a comma-separated list")
    ap.add_argument("--num_warps", type=int, default=4)
    ap.add_argument("--anchored_bwd", default=None, help="kda_bounded: none | scores (default: the API's)")
    ap.add_argument("--anchored_fwd", default=None, help="kda: fused | fixup (default: the API's)")
    ap.add_argument("--inverse", default=None, help="loop | blocks (default: the API's)")
    ap.add_argument("--bv", type=int, default=None, help="the state passes' value block (default: the API's)")
    ap.add_argument("--num_warps_state", type=int, default=None,
                    help="the state passes' warps (default: --num_warps; 8 for f32 inputs, as the API)")
    ap.add_argument("--num_warps_fwd", type=int, default=None, choices=(1, 2, 4, 8, 16),
                    help="the forward intra-chunk kernel's warps (default: the API's, api.default_warps_fwd)")
    ap.add_argument("--qk_arrays", type=int, choices=(0, 1), default=None,
                    help="none, gdn: the qk_arrays launch knob (default: the API's)")
    ap.add_argument("--state_pairs", type=int, choices=(0, 1), default=None,
                    help="the state_pairs launch knob (default: the API's)")
    ap.add_argument("--transposed_state", type=int, choices=(0, 1), default=None,
                    help="the transposed_state launch knob (default: the API's)")
    ap.add_argument("--intra", choices=INTRAS, default=None,
                    help="the intra-chunk kernels' form (default: the API's; kda: tiles or whole)")
    ap.add_argument("--state_dot", choices=STATE_DOTS, default=None,
                    help="gdn: the state_dot launch knob (default: the API's)")
    ap.add_argument("--chunks_per_program", type=int, default=None,
                    help="the backward intra-chunk kernels' chunks per program (default: the API's)")
    ap.add_argument("--fixup_chunks", type=int, default=None,
                    help="kda: chunks per program of the forward's second pass (default: the API's)")
    ap.add_argument("--forward_only", action="store_true",
                    help="lower the undifferentiated call (its forward kernels alone) instead of fwd+bwd")
    ap.add_argument("--sass", action="store_true", help="also count each kernel's SASS instructions (nvdisasm)")
    ap.add_argument("--layouts", action="store_true",
                    help="also print the warp layouts (warpsPerCTA) of each kernel's matmuls, from its TTGIR")
    ap.add_argument("--keep_cache", action="store_true",
                    help="use Triton's cache (default: a fresh one, so that every compile is timed)")
    args = ap.parse_args(argv)
    cache = None
    if not args.keep_cache:
        cache = tempfile.TemporaryDirectory()
        os.environ["TRITON_CACHE_DIR"] = cache.name  # read when triton compiles
    from . import api

    gates = GATES if args.gate == "all" else tuple(args.gate.split(","))
    for g in gates:
        if g not in GATES:
            ap.error(f"--gate: unknown {g!r}")
    chunks = [None] if args.chunk_size is None else [int(c) for c in args.chunk_size.split(",")]
    ok, summary = True, []
    for gate in gates:
        for dtype in args.dtype.split(","):
            for chunk in chunks:
                label = f"[{gate} {dtype} C={chunk or 'default'}{' docs' if args.docs else ''}] "
                with tempfile.TemporaryDirectory() as d:
                    n = dump_ttir(d, gate, bool(args.docs), dtype, 2, args.T, 16, 128, 128, chunk, args.anchored_bwd,
                                   args.inverse, args.bv, args.anchored_fwd,
                                   None if args.qk_arrays is None else bool(args.qk_arrays),
                                   None if args.state_pairs is None else bool(args.state_pairs), args.forward_only,
                                   args.intra, args.chunks_per_program, args.fixup_chunks,
                                   None if args.transposed_state is None else bool(args.transposed_state),
                                   args.state_dot)
                    print(f"{label}{n} kernels lowered", flush=True)
                    kind = "channel" if gate.startswith("kda") else "none"
                    good, times = compile_all(d, args.num_warps, label,
                                              api.default_warps_scores(kind, args.num_warps, dtype != "f32"),
                                              # f32: the state passes' own default (api.default_warps_state)
                                              args.num_warps_state or (api.default_warps_state(
                                                  args.bv or 32, False) if dtype == "f32" else None),
                                              args.num_warps_fwd or api.default_warps_fwd(
                                                  kind, args.num_warps, dtype != "f32",
                                                  chunk or api.default_chunk("gpu")),
                                              api.default_warps_solve(args.num_warps, dtype != "f32"), args.sass,
                                              args.layouts)
                    ok = ok and good
                    summary.append((label, times))
    print("\ncompile seconds per kernel:")
    for label, times in summary:
        print(f"  {label}" + "  ".join(f"{k.split('.')[0]}={v:.1f}" for k, v in times.items()))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
