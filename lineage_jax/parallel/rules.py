"""One table of rules from logical axis names to mesh axes, for parameters and activations.

Every ``nnx.Param`` carries ``logical_axes`` metadata (``layers/common.py``); a
``PartitionSpec`` is derived from it, dimension by dimension, with three rules:

1. **Look-up.** Each logical name maps to ``None``, one mesh axis, or a tuple of
   mesh axes (:data:`DEFAULT_RULES`). An unknown name is an error (a typo, or a new
   layer whose names need a rule).
2. **Each mesh axis at most once per array, first dimension wins.** ``("batch", "seq",
   "embed")`` gives ``P(("data", "fsdp", "expert"), None, None)``: ``embed -> (fsdp,
   expert)`` gets nothing because ``batch`` already took both. So weights are
   FSDP-sharded on ``embed`` while activations are batch-sharded, from one table; and a
   routed-expert weight ``(experts, embed, expert_mlp)`` gives ``P("expert", "fsdp",
   "tensor")`` while a dense ``(embed, heads, head_dim)`` gives ``P(("fsdp", "expert"),
   "tensor")`` — for dense weights the expert axis is just more FSDP.
3. **Divisibility: drop, don't fail (default).** A mesh axis whose size does not
   divide the dimension is dropped for that dimension (the dimension is replicated
   over it), e.g. ``tiny`` models' 4 heads on ``tensor=8``. For a tuple of mesh axes,
   axes are kept left to right while the product still divides. ``strict=True``
   raises ``ValueError`` instead, naming the parameter, dimension and mesh axis;
   :func:`sharding_table` reports what was dropped. Mesh axes of size 1 are left out.

The exception is the expert axis of expert-parallel MoE: ``num_experts`` must be
divisible by the ``expert`` mesh axis (checked by ``parallel.expert``), since experts
cannot be replicated inside the all-to-all dispatch.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from typing import Mapping, Optional, Sequence, Union

import jax
import numpy as np
import optax
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from lineage_jax import accounting
from lineage_jax.parallel.mesh import MESH_AXES, check_axis_sizes, mesh_shape

MeshAxes = Union[None, str, tuple[str, ...]]
Rules = tuple[tuple[str, MeshAxes], ...]

DEFAULT_RULES: Rules = (
    # activations
    ("batch", ("data", "fsdp", "expert")),   # tokens are split over every axis but tensor
    ("seq", None),
    # parameters (and activations carrying the same names)
    ("embed", ("fsdp", "expert")),   # model width: FSDP (ZeRO-3) for weights; dense weights use the
                                     # expert axis as more FSDP (expert weights already took it)
    ("vocab", "tensor"),
    ("heads", "tensor"),        # tensor parallelism over heads: softmax, KDA/GDN/DeltaNet, MLA
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("mlp", "tensor"),          # dense FFN hidden
    ("experts", "expert"),      # expert parallelism
    ("expert_mlp", "tensor"),   # routed expert hidden
    ("latent", ("fsdp", "expert")),  # latent-MoE width (K3): the routed experts' matmul width
    ("q_lora", ("fsdp", "expert")),      # low-rank inputs of up-projections (MLA, KDA gates): FSDP,
    ("kv_lora", ("fsdp", "expert")),     # like embed, so [rank, heads, head_dim] is not replicated
    ("gate_rank", ("fsdp", "expert")),   # when tensor = 1
    ("rope", None),
    ("conv", None),
    ("norm", None),
    ("layers", None),           # the stacked axis of scanned layer groups
)


WIDTH_NAMES = ("embed", "latent", "q_lora", "kv_lora", "gate_rank")  # the weights' model-width names


def without_mesh_axis(axis: str, names: Sequence[str] = WIDTH_NAMES, rules: Optional[Rules] = None) -> Rules:
    """``rules`` with mesh ``axis`` removed from the logical ``names`` (the rest unchanged).

    The default removes it from the weights' model-width names: ``without_mesh_axis("expert")``
    keeps experts and tokens split over the expert axis but *replicates* the dense weights over
    it (classic data + expert parallelism), where :data:`DEFAULT_RULES` uses it as more FSDP.
    """
    table = rules_dict(rules)
    if isinstance(names, str):
        raise ValueError(f"without_mesh_axis: `names` must be a sequence of logical axis names, got the string "
                         f"{names!r} (write ({names!r},))")
    if axis not in MESH_AXES:
        raise ValueError(f"without_mesh_axis: `axis` must be one of {MESH_AXES}, got {axis!r}")
    unknown = sorted(set(names) - set(table))
    if unknown:
        raise ValueError(f"without_mesh_axis: `names` has logical axes without a rule: {unknown}")
    out = []
    for name, axes in table.items():
        if name in names:
            axes = tuple(a for a in axes if a != axis)
        out.append((name, None if not axes else axes[0] if len(axes) == 1 else axes))
    return tuple(out)


def rules_dict(rules: Optional[Rules] = None) -> dict[str, tuple[str, ...]]:
    """Validate ``rules`` and return ``{logical name: tuple of mesh axes}``."""
    rules = DEFAULT_RULES if rules is None else rules
    out: dict[str, tuple[str, ...]] = {}
    for entry in rules:
        if not (isinstance(entry, (tuple, list)) and len(entry) == 2 and isinstance(entry[0], str)):
            raise ValueError(f"rules: each rule must be (logical_name, mesh_axes), got {entry!r}")
        name, axes = entry
        if name in out:
            raise ValueError(f"rules: logical axis {name!r} has two rules")
        if not (axes is None or isinstance(axes, str)
                or (isinstance(axes, (tuple, list)) and all(isinstance(a, str) for a in axes))):
            raise ValueError(f"rules: logical axis {name!r} must map to None, a mesh axis or a tuple of mesh axes, "
                             f"got {axes!r}")
        axes = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
        if len(set(axes)) != len(axes):
            raise ValueError(f"rules: logical axis {name!r} names a mesh axis twice: {axes}")
        for a in axes:
            if a not in MESH_AXES:
                raise ValueError(f"rules: logical axis {name!r} maps to unknown mesh axis {a!r}; "
                                 f"valid: {', '.join(MESH_AXES)}")
        out[name] = axes
    return out


def _sizes(mesh: Union[Mesh, Mapping[str, int]]) -> dict[str, int]:
    if isinstance(mesh, Mesh):
        return mesh_shape(mesh)
    check_axis_sizes(mesh, fn="rules: `mesh`")
    if any(s == -1 for s in mesh.values()):
        raise ValueError(f"rules: `mesh` {dict(mesh)} has a -1 axis; resolve it first (resolve_axis_sizes)")
    return {a: int(mesh.get(a, 1)) for a in MESH_AXES}


def logical_to_spec(logical_axes: Sequence[Optional[str]], mesh: Union[Mesh, Mapping[str, int]],
                    rules: Optional[Rules] = None, *, shape: Optional[Sequence[int]] = None,
                    strict: bool = False, what: str = "array", dropped: Optional[list] = None) -> P:
    """The ``PartitionSpec`` for an array with ``logical_axes`` on ``mesh`` (see the module docstring).

    Args:
      logical_axes: one logical name (or ``None``) per dimension.
      mesh: a ``Mesh`` or a dict of mesh axis sizes.
      shape: the array's shape; when given, non-dividing mesh axes are dropped (or, with
        ``strict``, raise ``ValueError``).
      what: the array's name, for error messages.
      dropped: if a list, ``(what, dim, logical name, mesh axis)`` is appended for each drop.
    """
    table = rules_dict(rules)
    sizes = _sizes(mesh)
    if shape is not None and len(shape) != len(logical_axes):
        raise ValueError(f"logical_to_spec: {what}: logical axes {tuple(logical_axes)} do not match shape {tuple(shape)}")
    used: set[str] = set()
    spec = []
    for d, name in enumerate(logical_axes):
        if name is None:
            spec.append(None)
            continue
        if name not in table:
            raise ValueError(f"logical_to_spec: {what}: logical axis {name!r} has no rule; "
                             f"known: {sorted(table)}")
        kept: list[str] = []
        for axis in table[name]:
            size = sizes.get(axis, 1)
            if axis in used or size == 1:
                continue
            if shape is not None and shape[d] % (math.prod(sizes[a] for a in kept) * size):
                if strict:
                    raise ValueError(f"logical_to_spec: {what}: dimension {d} ({name!r}, size {shape[d]}) is not "
                                     f"divisible by mesh axis {axis!r} (size {size})"
                                     + (f" times {kept}" if kept else ""))
                if dropped is not None:
                    dropped.append((what, d, name, axis))
                continue
            kept.append(axis)
            used.add(axis)
        spec.append(None if not kept else kept[0] if len(kept) == 1 else tuple(kept))
    while spec and spec[-1] is None:
        spec.pop()
    return P(*spec)


# ----------------------------------------------------------------------------- parameters
def _path_str(path) -> str:
    parts = []
    for k in path:
        parts.append(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))))
    return "/".join(parts)


def _is_var(x) -> bool:
    return isinstance(x, nnx.Variable)


def _state_of(tree):
    if isinstance(tree, nnx.Module):
        return nnx.state(tree)
    return tree


def state_specs(tree, mesh: Union[Mesh, Mapping[str, int]], rules: Optional[Rules] = None, *,
                strict: bool = False, dropped: Optional[list] = None):
    """``PartitionSpec`` per variable of a module (or its ``nnx.State``), same tree structure.

    Variables without ``logical_axes`` metadata are replicated (``P()``).
    """
    def one(path, var):
        axes = var.get_metadata().get("logical_axes")
        if axes is None:
            return var.replace(P())
        return var.replace(logical_to_spec(axes, mesh, rules, shape=var.get_value().shape, strict=strict,
                                           what=_path_str(path), dropped=dropped))

    return jax.tree_util.tree_map_with_path(one, _state_of(tree), is_leaf=_is_var)


def state_shardings(tree, mesh: Mesh, rules: Optional[Rules] = None, *, strict: bool = False):
    """``NamedSharding`` per variable of a module / ``nnx.State`` (abstract or concrete).

    The result has the state's structure (each ``Variable`` holding a ``NamedSharding``),
    so it can be passed as ``in_shardings`` / ``out_shardings`` of ``jax.jit``.
    """
    specs = state_specs(tree, mesh, rules, strict=strict)
    return jax.tree.map(lambda v: v.replace(NamedSharding(mesh, v.get_value())), specs, is_leaf=_is_var)


def optimizer_shardings(tx: optax.GradientTransformation, params, param_shardings, mesh: Mesh):
    """Shardings of ``tx.init(params)``: every per-parameter buffer (Adam moments, Muon momentum) laid out
    like its parameter, everything else (counts, scalars, factored statistics) replicated. ``params`` may
    be abstract.

    A buffer is a parameter's when its path in the optimizer state ends with the parameter's path and
    its shape is the parameter's; so any state layout works (Muon's per-head dimension numbers,
    Adafactor's row and column factors, chains and masks)."""
    replicated = NamedSharding(mesh, P())
    abstract_opt = jax.eval_shape(tx.init, params)
    shapes = dict(jax.tree_util.tree_flatten_with_path(params)[0])
    by_path = {path: (tuple(getattr(shapes.get(path), "shape", ())), sharding)
               for path, sharding in jax.tree_util.tree_flatten_with_path(param_shardings)[0]}

    def one(path, leaf):
        shape = tuple(getattr(leaf, "shape", ()))
        for start in range(len(path)):
            found = by_path.get(tuple(path[start:]))
            if found is not None and found[0] == shape:
                return found[1]
        return replicated

    return jax.tree_util.tree_map_with_path(one, abstract_opt)


def batch_sharding(x, mesh: Mesh, rules: Optional[Rules] = None) -> NamedSharding:
    """``[B, ...]`` arrays: ``B`` over the ``batch`` mesh axes, the rest replicated."""
    return NamedSharding(mesh, logical_to_spec(("batch",) + (None,) * (x.ndim - 1), mesh, rules, shape=x.shape))


def shard_batch(batch, mesh: Mesh, rules: Optional[Rules] = None):
    """Place a pytree of ``[B, ...]`` host arrays on ``mesh``, split over the batch axes.

    One process: ``batch`` is the global batch. Several processes: each passes its own
    slice (``B / process_count`` rows) and gets the global array back. A global ``B`` that does not
    divide over the batch axes is a ``ValueError`` (it would be copied whole to every device).
    """
    axes = [a for a in mesh_axes_of("batch", rules) if a in mesh.shape]
    split = math.prod(mesh.shape[a] for a in axes)

    def one(x):
        x = np.asarray(x) if not isinstance(x, jax.Array) else x
        rows = x.shape[0] * jax.process_count() if x.ndim else 0
        if x.ndim == 0 or rows % split:
            raise ValueError(f"shard_batch: an array of shape {tuple(x.shape)} (global batch {rows}) does not split "
                             f"over the batch mesh axes {tuple(axes)} ({split} devices); use a batch that divides")
        if jax.process_count() == 1:
            return jax.device_put(x, batch_sharding(x, mesh, rules))
        global_shape = (x.shape[0] * jax.process_count(),) + tuple(x.shape[1:])
        sharding = batch_sharding(jax.ShapeDtypeStruct(global_shape, x.dtype), mesh, rules)
        return jax.make_array_from_process_local_data(sharding, np.asarray(x), global_shape)

    return jax.tree.map(one, batch)


def sharding_table(config_or_rows, mesh: Union[Mesh, Mapping[str, int]], rules: Optional[Rules] = None,
                   *, strict: bool = False) -> list[dict]:
    """Per parameter: ``path, shape, axes, spec, local_shape, size, local_size, dropped``.

    ``config_or_rows`` is a ``ModelConfig``, a config name, or rows of
    ``lineage_jax.accounting.param_table``. ``local_shape`` is the shard one device holds.
    """
    rows = config_or_rows if isinstance(config_or_rows, list) else accounting.param_table(config_or_rows)
    sizes = _sizes(mesh)
    out = []
    for row in rows:
        dropped: list = []
        spec = logical_to_spec(row["axes"], sizes, rules, shape=row["shape"], strict=strict,
                               what=row["path"], dropped=dropped)
        local = local_shape(row["shape"], spec, sizes)
        out.append(dict(row, spec=spec, local_shape=local, local_size=math.prod(local),
                        dropped=[(d, name, axis) for _, d, name, axis in dropped]))
    return out


def local_shape(shape: Sequence[int], spec: P, mesh: Union[Mesh, Mapping[str, int]]) -> tuple[int, ...]:
    """The per-device shard shape of an array of ``shape`` laid out by ``spec``."""
    sizes = _sizes(mesh)
    out = list(shape)
    for d, entry in enumerate(spec):
        axes = () if entry is None else (entry,) if isinstance(entry, str) else entry
        out[d] = shape[d] // math.prod(sizes[a] for a in axes)
    return tuple(out)


# ----------------------------------------------------------------------------- activations
_CURRENT: contextvars.ContextVar = contextvars.ContextVar("lineage_jax_logical_sharding", default=None)


@contextlib.contextmanager
def logical_sharding(mesh: Mesh, rules: Optional[Rules] = None):
    """Within the context (typically: while a jitted function traces),
    :func:`with_logical_constraint` constrains activations on ``mesh`` with ``rules``."""
    rules_dict(rules)
    token = _CURRENT.set((mesh, DEFAULT_RULES if rules is None else rules))
    try:
        yield
    finally:
        _CURRENT.reset(token)


def current_logical_sharding() -> Optional[tuple[Mesh, Rules]]:
    """``(mesh, rules)`` of the innermost :func:`logical_sharding` context, or ``None``."""
    return _CURRENT.get()


def with_logical_constraint(x: jax.Array, logical_axes: Sequence[Optional[str]], *,
                            mesh: Optional[Mesh] = None, rules: Optional[Rules] = None) -> jax.Array:
    """``jax.lax.with_sharding_constraint`` from logical names, e.g. ``("batch", "seq", "embed")``.

    Uses ``mesh``/``rules`` if given, else those of the enclosing :func:`logical_sharding`;
    with neither it returns ``x`` unchanged (single-device code runs as is). Mesh axes that
    do not divide a dimension are dropped.
    """
    if mesh is None:
        current = _CURRENT.get()
        if current is None:
            return x
        mesh, ctx_rules = current
        rules = ctx_rules if rules is None else rules
    if len(logical_axes) != x.ndim:
        raise ValueError(f"with_logical_constraint: `logical_axes` {tuple(logical_axes)} do not match "
                         f"the array's rank {x.ndim} (shape {tuple(x.shape)})")
    spec = logical_to_spec(logical_axes, mesh, rules, shape=x.shape, what="activation")
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


def per_device(fn, args: Sequence, in_axes: Sequence, out_axes, *, what: str = "per_device"):
    """``fn(*args)``, on each device's own shard when a :func:`logical_sharding` context holds a mesh of
    more than one device: ``jax.shard_map`` over that mesh, every array laid out by its logical names
    (``in_axes``: one tuple per argument, ``None`` for an argument that is ``None``; ``out_axes``: a
    pytree of tuples matching ``fn``'s output). Outside such a context it is ``fn(*args)``.

    For computations XLA cannot partition itself: a Pallas kernel is an opaque custom call — on TPUs
    Mosaic refuses to compile one under a multi-device layout ("Mosaic kernels cannot be
    automatically partitioned"), and XLA's GPU partitioner, with no rule for it, falls back to
    replicating it, every device computing the whole batch. A dimension named ``None`` stays whole on every device (a recurrence's sequence);
    mesh axes that do not divide a dimension are dropped, as everywhere here, so the same names give
    the same layout to every array of the same sizes. Inside a ``shard_map`` it is ``fn(*args)``."""
    current = _CURRENT.get()
    if current is None or current[0].size == 1 or jax.sharding.get_abstract_mesh().manual_axes:
        return fn(*args)  # one device, or already inside a shard_map (each device's own values)
    mesh, rules = current
    if len(in_axes) != len(args):
        raise ValueError(f"{what}: {len(in_axes)} `in_axes` for {len(args)} arguments")
    present = [i for i, a in enumerate(args) if a is not None]
    in_specs = tuple(logical_to_spec(in_axes[i], mesh, rules, shape=jax.numpy.shape(args[i]),
                                     what=f"{what} argument {i}") for i in present)
    out_shapes = jax.eval_shape(fn, *args)
    out_specs = jax.tree.map(lambda axes, o: logical_to_spec(axes, mesh, rules, shape=o.shape, what=f"{what} output"),
                             out_axes, out_shapes, is_leaf=lambda x: isinstance(x, tuple) and all(
                                 a is None or isinstance(a, str) for a in x))

    def local(*xs):
        full = list(args)
        for i, x in zip(present, xs):
            full[i] = x
        return fn(*full)

    # check_vma off: the kernels' outputs carry no varying-axes types (interpret mode would refuse them)
    return jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)(
        *(args[i] for i in present))


def logical_sharding_of(logical_axes: Sequence[Optional[str]], mesh: Mesh, rules: Optional[Rules] = None,
                        shape: Optional[Sequence[int]] = None) -> NamedSharding:
    """A ``NamedSharding`` from logical names (non-dividing axes dropped when ``shape`` is given)."""
    return NamedSharding(mesh, logical_to_spec(logical_axes, mesh, rules, shape=shape))


def check_mesh(fn: str, mesh, rules: Optional[Rules] = None) -> None:
    """Refuse (``ValueError`` naming ``fn``) a ``mesh`` the rules cannot lay arrays out on: not a ``Mesh``, an
    axis no rule names (every array would be replicated over it, silently), or an axis that is not
    ``AxisType.Auto`` (sharding constraints need Auto axes; ``jax.make_mesh`` makes Explicit ones by
    default). :func:`lineage_jax.parallel.make_mesh` builds a mesh that passes."""
    if not isinstance(mesh, Mesh):
        raise ValueError(f"{fn}: `mesh` must be a jax.sharding.Mesh (lineage_jax.parallel.make_mesh builds one "
                         f"from axis sizes, e.g. make_mesh({{'data': 2, 'expert': 4}})), got {type(mesh).__name__}")
    named = {a for axes in rules_dict(rules).values() for a in axes}
    foreign = [a for a in mesh.axis_names if a not in named and mesh.shape[a] > 1]
    if foreign:
        raise ValueError(f"{fn}: `mesh` axis {foreign[0]!r} is named by no sharding rule (the rules use "
                         f"{', '.join(sorted(named))}): every array would be replicated over it")
    types = getattr(mesh, "axis_types", None) or ()
    if any(t != AxisType.Auto for t in types):
        raise ValueError(f"{fn}: `mesh` axes must all be AxisType.Auto, got {tuple(str(t) for t in types)} (pass "
                         "axis_types=(AxisType.Auto,) * n to jax.make_mesh, or use lineage_jax.parallel.make_mesh)")


def mesh_axes_of(name: str, rules: Optional[Rules] = None) -> tuple[str, ...]:
    """The mesh axes the rule for logical ``name`` maps to."""
    table = rules_dict(rules)
    if name not in table:
        raise ValueError(f"mesh_axes_of: logical axis {name!r} has no rule; known: {sorted(table)}")
    return table[name]


