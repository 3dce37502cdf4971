"""The Python examples of README.md and docs/ run as printed, and do what their comments say.

Each ```python block is taken from the page itself (not a copy), so an example that drifts from
the API fails here. Blocks run in a fresh namespace inside a temporary working directory; the
only edits are the repository-relative fixture path made absolute and, for the multi-device
example, the ``tokens`` it leaves to the reader.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from tests._fake_devices import fake_device_xla_flags
from tests._numerics import tolerance

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = "tests/fixtures/hf/kimi_linear"


def python_blocks(page: str) -> list[str]:
    text = (ROOT / page).read_text()
    return re.findall(r"```python\n(.*?)```", text, re.S)


def run_block(code: str, tmp_path: Path, monkeypatch) -> dict:
    monkeypatch.chdir(tmp_path)
    code = code.replace(f'"{FIXTURE}"', repr(str(ROOT / FIXTURE)))
    namespace: dict = {"__name__": "docs_example"}
    exec(compile(code, "<docs example>", "exec"), namespace)  # noqa: S102
    return namespace


def test_every_page_has_the_examples_this_file_runs():
    assert len(python_blocks("README.md")) == 1
    assert len(python_blocks("docs/guide.md")) == 4
    assert len(python_blocks("docs/parallelism.md")) == 1


@pytest.mark.parametrize("page", ["README.md", "docs/guide.md"])
def test_first_use(page, tmp_path, monkeypatch):
    """The memory API's first example: chunked and token-by-token KDA agree, decode continues the state."""
    ns = run_block(python_blocks(page)[0], tmp_path, monkeypatch)
    B, T, H, K, V = ns["B"], ns["T"], ns["H"], ns["K"], ns["V"]
    assert ns["o"].shape == (B, T, H, V) and ns["S"].shape == (B, H, K, V)
    np.testing.assert_allclose(ns["o"], ns["o_ref"], rtol=1e-4, atol=1e-4)
    assert ns["o_t"].shape == (B, H, V)
    if "o_attn" in ns:
        assert ns["o_attn"].shape == (B, T, H, V)


def test_guide_own_mixer_example(tmp_path, monkeypatch, capsys):
    """A registered GLA row builds the 3:1 hybrid; its decode step after a prefill gives the forward's logits,
    and the printed state size is the accounting's (6 GLA layers of H·K·K float32, no normalizer)."""
    from tests._registry import SavedTables

    with SavedTables():  # the library's own tables for the tests after this one
        ns = run_block(python_blocks("docs/guide.md")[1], tmp_path, monkeypatch)
    cfg = ns["cfg"]
    np.testing.assert_allclose(ns["last"], ns["logits"][:, 23], rtol=1e-4, atol=1e-4)
    H, K = cfg.num_heads, cfg.resolved_head_dim
    assert capsys.readouterr().out == f"{6 * H * K * K * 4} bytes of state a sequence\n"


def test_guide_checkpoint_example(tmp_path, monkeypatch, capsys):
    """hf.load matches transformers' logits (~1e-6), the greedy token after the prompt is transformers' own,
    and hf.save writes a checkpoint that loads back to the same logits."""
    ns = run_block(python_blocks("docs/guide.md")[2], tmp_path, monkeypatch)
    # the printed relative difference; a Kimi Linear model: the compiled delta-rule kernels on a GPU
    assert float(capsys.readouterr().out) < tolerance(1e-5, kernels=True)
    ref = ns["ref"]
    np.testing.assert_array_equal(np.asarray(ns["tok"]), ref["greedy_forward"][:, 12])
    from lineage_jax import hf

    again = hf.load(str(tmp_path / "kimi_again"))
    np.testing.assert_allclose(again(jnp.asarray(ref["prompts"], jnp.int32)), ns["logits"], rtol=0, atol=1e-5)


def test_guide_probe_and_decode_example(tmp_path, monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(ROOT))  # the example imports experiments.decode_scaling
    ns = run_block(python_blocks("docs/guide.md")[3], tmp_path, monkeypatch)
    out = capsys.readouterr().out
    assert re.fullmatch(r"accuracy \d\.\d\d, \d+\.\d\d ms per decode step\n", out), out
    assert 0.0 <= ns["acc"] <= 1.0 and ns["ms"] > 0


@pytest.mark.slow  # about a minute on 2 cores: init, compile and one step on 8 fake devices
def test_parallelism_example_on_eight_devices(tmp_path):
    """The sharded-training example on 8 fake CPU devices (data=2, expert=4), in a fresh process."""
    code = python_blocks("docs/parallelism.md")[0]
    setup = "import numpy as np\ntokens = np.zeros((8, 32), np.int32)\n"  # B over data x fsdp x expert = 8
    check = "\nimport math\nassert math.isfinite(float(metrics['loss'])), metrics\nprint('ok', float(metrics['loss']))\n"
    env = dict(os.environ, XLA_FLAGS=fake_device_xla_flags(8), JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", setup + code + check], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.startswith("ok ")
