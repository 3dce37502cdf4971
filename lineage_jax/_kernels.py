"""The Pallas kernels of the repository's ``kernels/`` folder, under whichever name they have.

Installed (``pip install .`` or ``pip install -e .``), the folder is the package
``lineage_kernels``: the name ``kernels`` belongs to another widely installed package. In a
source checkout whose root is on ``sys.path`` (``python -m pytest`` or ``python -m
experiments...`` from the root), the folder is also importable as ``kernels``; then that
name is used, so one process never loads the kernels twice under two names.
``lineage_jax`` reaches the kernels only through this module.
"""

import importlib
import importlib.util
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]


def _package_name() -> str:
    if (_ROOT / "setup.cfg").is_file():  # a source checkout
        spec = importlib.util.find_spec("kernels")
        if spec is not None and spec.origin and Path(spec.origin).resolve() == _ROOT / "kernels" / "__init__.py":
            return "kernels"
    return "lineage_kernels"


PACKAGE = _package_name()
delta = importlib.import_module(f"{PACKAGE}.delta")


def __getattr__(name):
    # Looked up on every use, so the function called is kernels.delta's current attribute.
    return getattr(delta, name)
