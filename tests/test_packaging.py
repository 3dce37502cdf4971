"""Packaging: setup.cfg installs every package folder, and the kernels under a name of our own."""

import ast
import configparser
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
INSTALLED_AS = {"lineage_jax": "lineage_jax", "experiments": "experiments", "kernels": "lineage_kernels"}


def _setup_cfg():
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    return cfg


def _lines(value: str) -> list[str]:
    return [line.strip() for line in value.strip().splitlines() if line.strip()]


def test_every_package_folder_is_installed_under_its_name():
    opts = _setup_cfg()["options"]
    folders = set()
    for top, name in INSTALLED_AS.items():
        for init in (ROOT / top).rglob("__init__.py"):
            parts = init.parent.relative_to(ROOT / top).parts
            folders.add(".".join((name, *parts)))
    assert set(_lines(opts["packages"])) == folders
    assert dict(line.replace(" ", "").split("=") for line in _lines(opts["package_dir"])) == {
        "lineage_kernels": "kernels"}


def test_the_kernels_import_themselves_relatively_and_lineage_jax_through_one_module():
    for path in (ROOT / "kernels").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
            assert not any(n == "kernels" or n.startswith("kernels.") for n in names), f"{path}: {names}"
    for path in (ROOT / "lineage_jax").rglob("*.py"):
        if path.name == "_kernels.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any(n.split(".")[0] in ("kernels", "lineage_kernels") for n in names), f"{path}: {names}"


def test_source_checkout_uses_the_folder_name_once():
    from lineage_jax import _kernels

    assert _kernels.PACKAGE == "kernels"             # the repository root is on sys.path here
    assert _kernels.delta is sys.modules["kernels.delta"]
    assert "lineage_kernels.delta" not in sys.modules


def test_gpu_extra_matches_the_documented_cuda():
    gpu = " ".join(_lines(_setup_cfg()["options.extras_require"]["gpu"]))
    documented = set(re.findall(r"CUDA (\d+)", (ROOT / "README.md").read_text()))
    assert documented and {m for m in re.findall(r"jax\[cuda(\d+)\]", gpu)} == documented
