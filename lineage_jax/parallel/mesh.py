"""Device meshes: ``data × fsdp × expert × tensor``, on one host or many.

Axis order is fastest-last: ``tensor`` is innermost (the lowest-latency links:
NVLink inside an H200 node, neighbouring chips on a TPU torus), then
``expert``, ``fsdp`` and ``data`` outermost (the slowest links: between nodes /
slices). ``jax.make_mesh`` picks a topology-aware device order for that shape.

* :func:`parse_mesh_spec` turns the CLI string ``"data=2,expert=4"`` into sizes;
* :func:`make_mesh` builds the mesh (one ``-1`` size takes the remaining devices);
* :func:`maybe_initialize_distributed` starts ``jax.distributed`` when the
  environment says this process is one of several (no-op on one host).

Every mesh axis is ``AxisType.Auto`` (GSPMD propagation, ``jax.jit`` with
``NamedSharding``s); jax >= 0.10 makes ``Explicit`` meshes by default, which the
layers here are not written for.
"""

from __future__ import annotations

import logging
import math
import os
import re
from typing import Mapping, Optional, Sequence, Union

import jax
from jax.sharding import AxisType, Mesh

from lineage_jax.memory._validate import is_int

log = logging.getLogger(__name__)

MESH_AXES = ("data", "fsdp", "expert", "tensor")
MeshSpec = Union[str, Mapping[str, int], None]


def parse_mesh_spec(spec: Optional[str]) -> dict[str, int]:
    """``"data=2,fsdp=1,tensor=1,expert=4"`` -> ``{"data": 2, "fsdp": 1, "expert": 4, "tensor": 1}``.

    Axes left out are 1; one axis may be ``-1`` ("all remaining devices", resolved by
    :func:`make_mesh`). Whitespace is ignored; an empty string gives all ones.
    Raises ``ValueError`` naming the offending axis or entry.
    """
    if spec is None:
        spec = ""
    if not isinstance(spec, str):
        raise ValueError(f"parse_mesh_spec: `spec` must be a string like 'data=2,expert=4', got {spec!r}")
    sizes = {a: 1 for a in MESH_AXES}
    seen: set[str] = set()
    for entry in (e.strip() for e in spec.split(",")):
        if not entry:
            continue
        if "=" not in entry:
            raise ValueError(f"parse_mesh_spec: entry {entry!r} is not of the form axis=size "
                             f"(axes: {', '.join(MESH_AXES)})")
        name, value = (s.strip() for s in entry.split("=", 1))
        if name not in MESH_AXES:
            raise ValueError(f"parse_mesh_spec: unknown mesh axis {name!r}; valid axes: {', '.join(MESH_AXES)}")
        if name in seen:
            raise ValueError(f"parse_mesh_spec: mesh axis {name!r} is given twice")
        seen.add(name)
        if not re.fullmatch(r"-?[0-9]+", value):
            raise ValueError(f"parse_mesh_spec: size of mesh axis {name!r} must be an integer "
                             f"(or -1 for the rest), got {value!r}")
        size = int(value)
        if size == 0 or size < -1:
            raise ValueError(f"parse_mesh_spec: size of mesh axis {name!r} must be positive or -1, got {size}")
        sizes[name] = size
    check_axis_sizes(sizes, fn="parse_mesh_spec")
    return sizes


def check_axis_sizes(sizes: Mapping[str, int], fn: str = "make_mesh") -> None:
    if not isinstance(sizes, Mapping):
        raise ValueError(f"{fn}: mesh axis sizes must be a dict like {{'data': 2, 'expert': 4}} or a string like "
                         f"'data=2,expert=4', got {sizes!r}")
    unknown = sorted(set(sizes) - set(MESH_AXES))
    if unknown:
        raise ValueError(f"{fn}: unknown mesh axis {unknown[0]!r}; valid axes: {', '.join(MESH_AXES)}")
    for name, size in sizes.items():
        if not is_int(size) or size == 0 or size < -1:
            raise ValueError(f"{fn}: size of mesh axis {name!r} must be a positive int or -1, got {size!r}")
    rest = [n for n, s in sizes.items() if s == -1]
    if len(rest) > 1:
        raise ValueError(f"{fn}: at most one mesh axis may be -1, got {rest}")


def resolve_axis_sizes(sizes: MeshSpec, num_devices: int) -> dict[str, int]:
    """Fill in missing axes (1) and the ``-1`` axis for ``num_devices`` devices.

    Raises ``ValueError`` (naming the mesh) when the sizes do not multiply to
    ``num_devices`` — in particular for a mesh larger than the device count.
    """
    if sizes is None or isinstance(sizes, str):
        sizes = parse_mesh_spec(sizes)
    check_axis_sizes(sizes)
    if not is_int(num_devices) or num_devices <= 0:
        raise ValueError(f"make_mesh: the device count must be a positive int, got {num_devices!r}")
    full = {a: int(sizes.get(a, 1)) for a in MESH_AXES}
    known = math.prod(s for s in full.values() if s != -1)
    rest = [a for a, s in full.items() if s == -1]
    desc = ",".join(f"{a}={s}" for a, s in full.items())
    if rest:
        if num_devices % known:
            raise ValueError(f"make_mesh: `mesh` {desc}: the fixed axes multiply to {known}, which does not "
                             f"divide the {num_devices} available devices")
        full[rest[0]] = num_devices // known
    total = math.prod(full.values())
    if total != num_devices:
        more = "larger than" if total > num_devices else "smaller than"
        raise ValueError(f"make_mesh: `mesh` {desc} needs {total} devices, {more} the {num_devices} available "
                         f"(use -1 on one axis to take the rest)")
    return full


def make_mesh(sizes: MeshSpec = None, *, devices: Optional[Sequence[jax.Device]] = None,
              dcn: Optional[Mapping[str, int]] = None) -> Mesh:
    """A ``Mesh`` with axes ``("data", "fsdp", "expert", "tensor")`` (all ``AxisType.Auto``).

    Args:
      sizes: a dict of axis sizes or a :func:`parse_mesh_spec` string; missing axes are 1,
        one axis may be ``-1``. ``None`` means ``data=-1`` (pure data parallelism).
      devices: the devices to use (default ``jax.devices()``: every device of every process).
      dcn: multi-slice / multi-node only: how many *slices* (TPU) or *processes* (GPU) each
        axis spans, e.g. ``{"data": 4}`` for 4 slices. ``sizes`` then gives the per-slice
        (ICI / NVLink) shape and the axis sizes of the mesh are the products. The devices
        are ordered with ``mesh_utils.create_hybrid_device_mesh`` so that only the ``dcn``
        axes cross slow links: the slices when the devices span more than one, else the
        processes.

    Raises ``ValueError`` when the mesh does not match the device count.
    """
    devices = list(jax.devices() if devices is None else devices)
    if len(set(devices)) != len(devices):
        raise ValueError(f"make_mesh: `devices` lists a device more than once ({len(devices)} entries, "
                         f"{len(set(devices))} distinct)")
    if sizes is None:
        sizes = {"data": -1}
    if dcn:
        check_axis_sizes(dcn, fn="make_mesh(dcn)")
        dcn_full = {a: int(dcn.get(a, 1)) for a in MESH_AXES}
        if any(s < 1 for s in dcn_full.values()):
            raise ValueError(f"make_mesh: `dcn` sizes must be positive, got {dict(dcn)}")
        granules = math.prod(dcn_full.values())
        if len(devices) % granules:
            raise ValueError(f"make_mesh: `dcn` spans {granules} slices/processes, which does not divide "
                             f"the {len(devices)} devices")
        ici = resolve_axis_sizes(sizes, len(devices) // granules)
        from jax.experimental import mesh_utils

        # the slow links' units: TPU slices where the devices span several; else processes (GPU nodes; jax
        # gives CPU and GPU devices a slice_index too, the same for every process)
        process_is_granule = len({getattr(d, "slice_index", 0) for d in devices}) <= 1
        try:
            arr = mesh_utils.create_hybrid_device_mesh(
                [ici[a] for a in MESH_AXES], [dcn_full[a] for a in MESH_AXES], devices,
                process_is_granule=process_is_granule)
        except ValueError as e:
            raise ValueError(f"make_mesh: `dcn` {dict(dcn)} does not match the slices/processes: {e}") from None
        return Mesh(arr, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))
    full = resolve_axis_sizes(sizes, len(devices))
    return jax.make_mesh(tuple(full[a] for a in MESH_AXES), MESH_AXES,
                         axis_types=(AxisType.Auto,) * len(MESH_AXES), devices=devices)


def mesh_shape(mesh: Mesh) -> dict[str, int]:
    """``{axis: size}`` of a mesh (a plain dict, in mesh order)."""
    return dict(zip(mesh.axis_names, mesh.devices.shape))


# ----------------------------------------------------------------------------- multi-host
def _int_env(env: Mapping[str, str], name: str) -> Optional[int]:
    raw = env.get(name)
    if raw is None or raw == "":
        return None
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"maybe_initialize_distributed: environment variable {name}={raw!r} is not an integer") from None


def detect_cluster(env: Optional[Mapping[str, str]] = None) -> Optional[dict]:
    """Keyword arguments for ``jax.distributed.initialize`` if ``env`` describes a
    multi-process job, else ``None``.

    Recognised, in order:

    * explicit: ``JAX_COORDINATOR_ADDRESS`` + ``JAX_NUM_PROCESSES`` (> 1) + ``JAX_PROCESS_ID``
      (e.g. set by ``launch/`` scripts for multi-node GPU without a scheduler);
    * multi-slice TPU (``MEGASCALE_NUM_SLICES`` > 1) or a multi-host TPU VM slice
      (``TPU_WORKER_HOSTNAMES`` / ``TPU_PROCESS_ADDRESSES`` listing more than one host);
    * SLURM (``SLURM_JOB_ID`` and ``SLURM_NTASKS`` > 1);
    * Open MPI / ``mpirun`` (``OMPI_COMM_WORLD_SIZE`` > 1).

    For all but the explicit case JAX's own cluster detection fills in the
    coordinator, so the result is ``{}``.
    """
    env = os.environ if env is None else env
    n = _int_env(env, "JAX_NUM_PROCESSES")
    if n is not None and n > 1:
        addr = env.get("JAX_COORDINATOR_ADDRESS")
        pid = _int_env(env, "JAX_PROCESS_ID")
        if not addr:
            raise ValueError("maybe_initialize_distributed: JAX_NUM_PROCESSES > 1 but JAX_COORDINATOR_ADDRESS is unset")
        if pid is None or not 0 <= pid < n:
            raise ValueError(f"maybe_initialize_distributed: JAX_PROCESS_ID must be in [0, {n}), "
                             f"got {env.get('JAX_PROCESS_ID')!r}")
        return dict(coordinator_address=addr, num_processes=n, process_id=pid)
    slices = _int_env(env, "MEGASCALE_NUM_SLICES")
    if slices is not None and slices > 1:
        return {}
    hosts = env.get("TPU_PROCESS_ADDRESSES") or env.get("TPU_WORKER_HOSTNAMES") or ""
    if len([h for h in hosts.split(",") if h.strip()]) > 1:
        return {}
    ntasks = _int_env(env, "SLURM_NTASKS")
    if env.get("SLURM_JOB_ID") and ntasks is not None and ntasks > 1:
        return {}
    world = _int_env(env, "OMPI_COMM_WORLD_SIZE")
    if world is not None and world > 1:
        return {}
    return None


def maybe_initialize_distributed(env: Optional[Mapping[str, str]] = None) -> bool:
    """Call ``jax.distributed.initialize`` when this is one process of several.

    Must run before anything touches a JAX backend (``jax.devices()``, any array).
    Returns ``True`` if it initialised the distributed runtime, ``False`` on one host,
    or when it is already initialised.
    """
    if jax.distributed.is_initialized():
        return False
    kwargs = detect_cluster(env)
    if kwargs is None:
        return False
    log.info("jax.distributed.initialize(%s)", kwargs)
    jax.distributed.initialize(**kwargs)
    return True
