"""Jaxpr inspection shared by the kernel tests (imports nothing from lineage_jax)."""


def live_pallas_calls(jaxpr) -> int:
    """Kernel launches left in a jaxpr after JAX's dead-code elimination, nested jaxprs included."""
    return live_calls(jaxpr, ("pallas_call",))


def live_calls(jaxpr, names) -> int:
    """Equations of the primitives ``names`` left in a jaxpr after JAX's dead-code elimination,
    nested jaxprs included."""
    from jax._src.interpreters import partial_eval as pe
    jaxpr, _ = pe.dce_jaxpr(jaxpr, [True] * len(jaxpr.outvars))

    def count(j):
        n = 0
        for e in j.eqns:
            if e.primitive.name in names:
                n += 1
                continue
            for p in e.params.values():
                for sub in (p if isinstance(p, (tuple, list)) else (p,)):
                    inner = getattr(sub, "jaxpr", sub)
                    if hasattr(inner, "eqns"):
                        n += count(inner)
        return n
    return count(jaxpr)


def pallas_launches(jaxpr) -> list:
    """``(kernel name, compiler_params)`` of every ``pallas_call`` in a jaxpr, nested jaxprs included."""
    out = []

    def walk(j):
        for e in j.eqns:
            if e.primitive.name == "pallas_call":
                info = getattr(e.params.get("jaxpr"), "debug_info", None)
                out.append((getattr(info, "func_name", None) or str(e.params.get("name")),
                            e.params.get("compiler_params")))
                continue
            for p in e.params.values():
                for sub in (p if isinstance(p, (tuple, list)) else (p,)):
                    inner = getattr(sub, "jaxpr", sub)
                    if hasattr(inner, "eqns"):
                        walk(inner)
    walk(jaxpr)
    return out
