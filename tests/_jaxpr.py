"""Jaxpr inspection shared by the kernel tests (imports nothing from lineage_jax)."""


def calls(jaxpr, names):
    """The equations of the primitives ``names`` in a jaxpr, nested jaxprs included (a matching
    equation's own inner jaxpr is not searched)."""
    for e in jaxpr.eqns:
        if e.primitive.name in names:
            yield e
            continue
        for p in e.params.values():
            for sub in (p if isinstance(p, (tuple, list)) else (p,)):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from calls(inner, names)


def live_pallas_calls(jaxpr) -> int:
    """Kernel launches left in a jaxpr after JAX's dead-code elimination, nested jaxprs included."""
    return live_calls(jaxpr, ("pallas_call",))


def live_calls(jaxpr, names) -> int:
    """Equations of the primitives ``names`` left in a jaxpr after JAX's dead-code elimination,
    nested jaxprs included."""
    from jax._src.interpreters import partial_eval as pe
    jaxpr, _ = pe.dce_jaxpr(jaxpr, [True] * len(jaxpr.outvars))
    return sum(1 for _ in calls(jaxpr, names))


def pallas_launches(jaxpr) -> list:
    """``(kernel name, compiler_params)`` of every ``pallas_call`` in a jaxpr, nested jaxprs included."""
    out = []
    for e in calls(jaxpr, ("pallas_call",)):
        info = getattr(e.params.get("jaxpr"), "debug_info", None)
        out.append((getattr(info, "func_name", None) or str(e.params.get("name")), e.params.get("compiler_params")))
    return out
