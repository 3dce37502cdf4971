"""Per-device memory and communication of a config on a mesh, from abstract shapes.

    python -m lineage_jax.parallel.plan --config kimi_k3 --mesh fsdp=16,expert=64 \\
        --batch 1024 --seq 8192 [--hardware tpu_v5p|h200] [--capacity-factor 1.25]

Everything is computed from ``lineage_jax.accounting.param_table`` (the Decoder built
under ``nnx.eval_shape``) and the sharding rules of ``lineage_jax.parallel.rules`` — the
same rules ``init_sharded`` and ``TrainStep`` use. Nothing is allocated.

Counted per device (parameters float32, as the layers keep them):

* **train state**: parameters + gradients + AdamW ``mu`` and ``nu`` = 16 bytes per
  parameter *shard element* (replicated dimensions count in full on every device);
* **MoE all-to-all** per MoE layer: ``n`` tokens per device (``batch·seq`` over the
  ``batch`` mesh axes) routed to ``k`` experts each, rows of the routed width
  (``moe_latent_dim`` for a latent MoE, else ``d_model``) in the activation dtype (the
  config's ``dtype`` unless ``act_bytes`` is given). The rows sent are those of the
  exchange ``ExpertParallel`` runs on the hardware: ``"ragged"`` on TPUs (and without
  ``hardware``) sends the ``n·k`` rows that exist; ``"dense"`` on GPUs sends the padded
  ``[ep·C, W]`` buffer, ``C`` the per-destination capacity (dropless ``C = n·min(k, E_loc)``;
  ``capacity_factor`` — or, without it, the config's ``moe_dispatch="capacity"`` and its
  ``capacity_factor`` — bounds it). Forward = dispatch + combine, a training step = that
  twice (the backward pass reverses both). On average ``(ep − 1)/ep`` of the rows leave
  the device (balanced routing);
* **FSDP traffic**: every parameter sharded over ``fsdp``/``expert`` as FSDP is
  all-gathered before use (in float32: ``TrainStep`` gathers the stored dtype) and its
  gradient reduce-scattered: received bytes per device ``local · (shards − 1) · 4`` each;
* **compute**: ``3 · flops_per_token · batch · seq / devices`` (forward + backward),
  from ``accounting.flops_per_token`` (routed experts at ``top_k``).

Activation memory is *not* counted (it depends on remat and the kernels).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Optional

import jax.numpy as jnp

from lineage_jax import accounting
from lineage_jax.models.config import ModelConfig
from lineage_jax.memory._validate import is_int
from lineage_jax.parallel.expert import check_capacity_factor, exchange_capacity
from lineage_jax.parallel.mesh import MESH_AXES, check_axis_sizes, parse_mesh_spec, resolve_axis_sizes
from lineage_jax.parallel.rules import DEFAULT_RULES, WIDTH_NAMES, Rules, mesh_axes_of, rules_dict, sharding_table

# Nominal datasheet figures (per chip / GPU), for lower-bound times only.
HARDWARE = {
    "tpu_v5p": dict(hbm_gb=95.0, bf16_tflops=459.0, fast_link_gbytes=600.0, slow_link_gbytes=None,
                    devices_per_node=None, gpu=False,
                    note="ICI 4800 Gb/s per chip, whole slice on ICI"),
    "h200": dict(hbm_gb=141.0, bf16_tflops=989.0, fast_link_gbytes=450.0, slow_link_gbytes=50.0,
                 devices_per_node=8, gpu=True,
                 note="NVLink 900 GB/s bidirectional in a node; 400 Gb/s InfiniBand per GPU between nodes"),
}
BYTES_PER_PARAM_TRAIN = 16  # f32 param + f32 grad + f32 Adam mu + f32 Adam nu
GB = 1e9


def _cfg(config) -> ModelConfig:
    return accounting._cfg(config, "plan")


def plan(config, mesh: dict, *, batch: int, seq: int, rules: Optional[Rules] = None,
         act_bytes: Optional[int] = None, capacity_factor: Optional[float] = None, hardware: Optional[str] = None,
         devices: Optional[int] = None) -> dict:
    """The numbers (see the module docstring) as a dict. ``mesh`` may hold one ``-1``
    when ``devices`` is given. ``act_bytes``: bytes of an exchanged activation element (default:
    the config's ``dtype``). ``capacity_factor``: the expert exchange's capacity (default: what
    ``ExpertParallel(capacity_factor=None)`` takes from the config — dropless, or its
    ``capacity_factor`` with ``moe_dispatch="capacity"``). Raises ``ValueError`` naming the bad argument."""
    cfg = _cfg(config)
    rules = DEFAULT_RULES if rules is None else rules
    if act_bytes is None:
        act_bytes = jnp.dtype(cfg.dtype).itemsize  # the config's activation dtype
    for name, val in (("batch", batch), ("seq", seq), ("act_bytes", act_bytes)):
        if not is_int(val) or val <= 0:
            raise ValueError(f"plan: `{name}` must be a positive int, got {val!r}")
    batch, seq, act_bytes = int(batch), int(seq), int(act_bytes)
    if cfg.positions == "learned" and seq > cfg.max_seq_len:
        raise ValueError(f"plan: `seq`={seq} is longer than {cfg.name}'s learned position table "
                         f"(max_seq_len {cfg.max_seq_len})")
    if hardware is not None and not (isinstance(hardware, str) and hardware in HARDWARE):
        raise ValueError(f"plan: `hardware` must be one of {sorted(HARDWARE)}, got {hardware!r}")
    check_capacity_factor("plan", capacity_factor)
    if capacity_factor is None and cfg.moe_dispatch == "capacity":
        capacity_factor = cfg.capacity_factor
    if isinstance(mesh, str):
        mesh = parse_mesh_spec(mesh)
    check_axis_sizes(mesh, fn="plan: `mesh`")
    if devices is not None and (not is_int(devices) or devices <= 0):
        raise ValueError(f"plan: `devices` must be a positive int, got {devices!r}")
    if devices is None:
        if any(v == -1 for v in mesh.values()):
            raise ValueError("plan: `mesh` has a -1 axis; give `devices` to resolve it")
        devices = math.prod(int(mesh.get(a, 1)) for a in MESH_AXES)
    devices = int(devices)
    fixed = math.prod(int(v) for v in mesh.values() if v != -1)
    if all(v != -1 for v in mesh.values()) and fixed != devices:
        raise ValueError(f"plan: `mesh` {mesh} has {fixed} devices, `devices` says {devices}")
    sizes = resolve_axis_sizes(dict(mesh), devices)

    rows = sharding_table(cfg, sizes, rules)
    total = sum(r["size"] for r in rows)
    local = sum(r["local_size"] for r in rows)
    by_component: dict[str, list] = {}
    for r in rows:
        c = by_component.setdefault(r["component"], [0, 0])
        c[0] += r["size"]
        c[1] += r["local_size"]
    replicated = sum(r["size"] for r in rows if not tuple(r["spec"]))
    dropped = sorted({(r["path"], d, name, axis) for r in rows for d, name, axis in r["dropped"]})

    # FSDP-style traffic: parameters sharded over an axis that is not a model-parallel one
    # for that parameter (fsdp, or expert on a non-expert dimension) are gathered before use.
    # Every model-width dimension counts (WIDTH_NAMES: embed, latent and the low ranks q_lora, kv_lora,
    # gate_rank), over the axes that shard it.
    width = tuple(n for n in WIDTH_NAMES if n in rules_dict(rules))
    fsdp_axes = {a for n in width for a in mesh_axes_of(n, rules)}
    gather_bytes = 0
    for r in rows:
        shards = 1
        for d, entry in enumerate(r["spec"]):
            axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
            if r["axes"][d] in width:
                shards *= math.prod(sizes[a] for a in axes if a in fsdp_axes)
        gather_bytes += r["local_size"] * (shards - 1) * 4

    # tokens per device
    batch_axes = [a for a in mesh_axes_of("batch", rules) if sizes.get(a, 1) > 1]
    token_shards = math.prod(sizes[a] for a in batch_axes)
    if batch % token_shards:
        raise ValueError(f"plan: `batch`={batch} is not divisible by the batch mesh axes "
                         f"{batch_axes} (product {token_shards})")
    tokens_per_device = batch * seq // token_shards

    out = dict(config=cfg.name, mesh={a: sizes[a] for a in MESH_AXES}, devices=devices, batch=batch, seq=seq,
               params_total=total, params_per_device=local, params_replicated_everywhere=replicated,
               train_state_bytes_per_device=local * BYTES_PER_PARAM_TRAIN,
               params_bytes_per_device=local * 4,
               by_component={k: dict(total=v[0], per_device=v[1]) for k, v in sorted(by_component.items())},
               dropped_axes=[dict(param=p, dim=d, logical=n, mesh_axis=a) for p, d, n, a in dropped],
               tokens_per_device=tokens_per_device,
               fsdp_gather_bytes_per_device_per_step=gather_bytes,
               fsdp_reduce_scatter_bytes_per_device_per_step=gather_bytes)

    flops_fwd = accounting.flops_per_token(cfg, seq)
    out["train_flops_per_device_per_step"] = 3.0 * flops_fwd * batch * seq / devices

    n_moe = sum(1 for i in range(cfg.num_layers) if cfg.is_moe(i))
    if n_moe:
        expert_axes = mesh_axes_of("experts", rules)
        if len(expert_axes) > 1:
            raise ValueError(f"plan: `rules` must map 'experts' to exactly one mesh axis (as ExpertParallel "
                             f"takes them), got {tuple(expert_axes)}")
        ep = sizes[expert_axes[0]] if expert_axes else 1
        if cfg.num_experts % ep:
            raise ValueError(f"plan: `num_experts`={cfg.num_experts} of {cfg.name} is not divisible by the expert "
                             f"mesh axis ({ep}); pick an expert axis that divides {cfg.num_experts}")
        width = cfg.moe_latent_dim or cfg.d_model
        k, e_loc = cfg.top_k, cfg.num_experts // ep
        cap = exchange_capacity(tokens_per_device, k, e_loc, ep, capacity_factor)
        # the exchange ExpertParallel's "auto" runs: ragged on TPUs, dense (padded buffers) on GPUs
        exchange = "dense" if HARDWARE.get(hardware or "", {}).get("gpu") else "ragged"
        rows_sent = ep * cap if exchange == "dense" else min(tokens_per_device * k, ep * cap)
        one_way = rows_sent * width * act_bytes
        off_device = (ep - 1) / ep
        moe = dict(moe_layers=n_moe, expert_parallel=ep, experts_per_device=e_loc, top_k=k, routed_width=width,
                   exchange=exchange, act_bytes=act_bytes,
                   rows_per_device=rows_sent, bytes_one_way_per_layer=one_way,
                   bytes_fwd_per_layer=2 * one_way, bytes_train_per_layer=4 * one_way,
                   bytes_train_all_layers=4 * one_way * n_moe, off_device_fraction=off_device,
                   receive_buffer_rows=ep * cap, capacity_factor=capacity_factor,
                   receive_buffer_bytes=ep * cap * width * act_bytes)
        hw = HARDWARE.get(hardware or "", {})
        if hw.get("devices_per_node") and ep > 1:
            tp = sizes.get("tensor", 1)
            same_node = max(1, min(ep, hw["devices_per_node"] // tp))
            moe["off_node_fraction"] = (ep - same_node) / ep
        out["moe"] = moe

    if hardware:
        hw = HARDWARE[hardware]
        out["hardware"] = dict(name=hardware, **hw)
        out["hbm_fraction_train_state"] = out["train_state_bytes_per_device"] / (hw["hbm_gb"] * GB)
        t = dict(compute_s=out["train_flops_per_device_per_step"] / (hw["bf16_tflops"] * 1e12))
        if n_moe:
            link = hw["fast_link_gbytes"]
            sent = out["moe"]["bytes_train_all_layers"] * out["moe"]["off_device_fraction"]
            if hw.get("slow_link_gbytes") and out["moe"].get("off_node_fraction", 0) > 0:
                slow = out["moe"]["bytes_train_all_layers"] * out["moe"]["off_node_fraction"]
                t["all_to_all_s"] = slow / (hw["slow_link_gbytes"] * GB) + (sent - slow) / (link * GB)
            else:
                t["all_to_all_s"] = sent / (link * GB)
        t["fsdp_s"] = 2 * gather_bytes / (hw["fast_link_gbytes"] * GB)
        out["lower_bound_seconds_per_step"] = t
    return out


def _fmt_bytes(b: float) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if b >= scale:
            return f"{b / scale:.2f} {unit}"
    return f"{b:.0f} B"


def _fmt_count(n: float) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return f"{n:.0f}"


def format_plan(p: dict) -> str:
    mesh = ",".join(f"{a}={s}" for a, s in p["mesh"].items())
    lines = [f"{p['config']} on mesh {mesh} ({p['devices']} devices), batch {p['batch']} x seq {p['seq']}",
             f"  parameters: {_fmt_count(p['params_total'])} total, {_fmt_count(p['params_per_device'])} per device "
             f"({_fmt_count(p['params_replicated_everywhere'])} replicated on every device)",
             f"  per device: params f32 {_fmt_bytes(p['params_bytes_per_device'])}, "
             f"params+grads+AdamW {_fmt_bytes(p['train_state_bytes_per_device'])}"]
    if "hbm_fraction_train_state" in p:
        lines[-1] += f" = {100 * p['hbm_fraction_train_state']:.0f}% of {p['hardware']['hbm_gb']:.0f} GB HBM"
    lines.append("  per component (total -> per device):")
    for name, c in p["by_component"].items():
        lines.append(f"    {name:<16} {_fmt_count(c['total']):>9} -> {_fmt_count(c['per_device']):>9}")
    if p["dropped_axes"]:
        seen = sorted({f"{d['logical']}->{d['mesh_axis']}" for d in p["dropped_axes"]})
        lines.append(f"  not divisible, replicated instead: {', '.join(seen)} "
                     f"({len(p['dropped_axes'])} parameter dims)")
    lines.append(f"  tokens per device per step: {p['tokens_per_device']}")
    if "moe" in p:
        m = p["moe"]
        lines.append(f"  MoE: {m['moe_layers']} layers, {m['experts_per_device']} experts/device (ep={m['expert_parallel']}), "
                     f"top-{m['top_k']}, routed width {m['routed_width']}")
        lines.append(f"    all-to-all per MoE layer per device ({m['exchange']}, {m['rows_per_device']} rows of "
                     f"{m['act_bytes']} B elements): {_fmt_bytes(m['bytes_one_way_per_layer'])} each way; "
                     f"forward {_fmt_bytes(m['bytes_fwd_per_layer'])}, train step {_fmt_bytes(m['bytes_train_per_layer'])}")
        lines.append(f"    all MoE layers, train step: {_fmt_bytes(m['bytes_train_all_layers'])} per device, "
                     f"{100 * m['off_device_fraction']:.0f}% off-device"
                     + (f", {100 * m['off_node_fraction']:.0f}% off-node" if "off_node_fraction" in m else ""))
        cap = "dropless" if m["capacity_factor"] is None else f"capacity factor {m['capacity_factor']}"
        lines.append(f"    receive buffer ({cap}): {m['receive_buffer_rows']} rows = {_fmt_bytes(m['receive_buffer_bytes'])}")
    lines.append(f"  FSDP all-gather per step per device: {_fmt_bytes(p['fsdp_gather_bytes_per_device_per_step'])} "
                 f"(+ the same again as gradient reduce-scatter)")
    lines.append(f"  compute per step per device: {p['train_flops_per_device_per_step'] / 1e15:.1f} PFLOP")
    if "lower_bound_seconds_per_step" in p:
        t = p["lower_bound_seconds_per_step"]
        lines.append("  lower bounds at datasheet rates (s/step): " + ", ".join(f"{k[:-2]} {v:.2f}" for k, v in t.items()))
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m lineage_jax.parallel.plan", description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="kimi_k3")
    ap.add_argument("--mesh", required=True, help="e.g. fsdp=16,expert=64 (axes: data, fsdp, expert, tensor)")
    ap.add_argument("--devices", type=int, default=None, help="device count, to resolve a -1 mesh axis")
    ap.add_argument("--batch", type=int, required=True, help="global batch (sequences per step)")
    ap.add_argument("--seq", type=int, required=True, help="tokens per sequence")
    ap.add_argument("--act-bytes", type=int, default=None,
                    help="bytes of an activation element the all-to-all moves (default: the config's dtype)")
    ap.add_argument("--capacity-factor", type=float, default=None,
                    help="EP capacity factor (default: the config's: dropless, or its capacity_factor with "
                         "moe_dispatch=capacity)")
    ap.add_argument("--hardware", choices=sorted(HARDWARE), default=None)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    try:
        p = plan(args.config, parse_mesh_spec(args.mesh), batch=args.batch, seq=args.seq, act_bytes=args.act_bytes,
                 capacity_factor=args.capacity_factor, hardware=args.hardware, devices=args.devices)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(p, indent=1, default=str) if args.json else format_plan(p))
    return 0


if __name__ == "__main__":
    sys.exit(main())
