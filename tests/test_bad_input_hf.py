"""lineage_jax.hf on bad input: broken files and configs are refused with the file, field or
tensor named, before any data is read, and ``save`` never overwrites anything."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from lineage_jax import hf

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "hf")
_MODEL: dict = {}


def _gpt2():
    if "m" not in _MODEL:
        _MODEL["m"] = hf.load(os.path.join(FIXTURES, "gpt2"))
    return _MODEL["m"]


def _copy(tmp_path, family="gpt2") -> str:
    d = str(tmp_path / family)
    shutil.copytree(os.path.join(FIXTURES, family), d)
    return d


def _config(family="gpt2") -> dict:
    with open(os.path.join(FIXTURES, family, "config.json")) as f:
        return json.load(f)


# ----------------------------------------------------------------------------- config.json
@pytest.mark.parametrize("field, value, needle", [
    ("n_embd", "64x", "`n_embd` must be an integer, got '64x'"),
    ("n_layer", 2.7, "`n_layer` must be an integer, got 2.7"),        # was silently 2 layers
    ("n_head", [4], "`n_head` must be an integer"),
    ("n_embd", True, "`n_embd` must be an integer, got True"),
    ("layer_norm_epsilon", "x", "`layer_norm_epsilon` must be a finite number"),
    ("n_layer", None, "`n_layer` is missing"),
    ("architectures", "GPT2LMHeadModel", "`architectures` must be a list"),
    ("n_layer", 0, "`n_layer` must be >= 1, got 0"),
    ("n_head", -1, "`n_head` must be >= 1"),
    ("n_positions", -1, "`n_positions` must be >= 1"),
    ("tie_word_embeddings", "false", "`tie_word_embeddings` must be true or false, got 'false'"),
])
def test_config_field_of_the_wrong_type_is_named(field, value, needle):
    cfg = _config()
    cfg[field] = value
    if field == "architectures":
        cfg["model_type"] = None
    with pytest.raises(hf.HFError, match="config.json: " + needle.replace("[", r"\[")):
        hf.config_from_hf(cfg)


def test_config_that_the_decoder_cannot_build_says_it_comes_from_config_json():
    cfg = _config()
    cfg["n_head"] = 3
    with pytest.raises(hf.HFError, match=r"config.json describes a model the Decoder cannot build: "
                                         r"ModelConfig.num_heads"):
        hf.config_from_hf(cfg)
    with pytest.raises(ValueError, match=r"^ModelConfig.dtype"):  # the caller's argument, not the file's
        hf.config_from_hf(_config(), dtype="float8")


def test_config_field_missing_is_named():
    cfg = _config()
    del cfg["n_embd"]
    with pytest.raises(hf.HFError, match="config.json: `n_embd` is missing"):
        hf.config_from_hf(cfg)


@pytest.mark.parametrize("family, field, value, needle", [
    ("deepseek_v3", "num_experts_per_tok", None, "`num_experts_per_tok` is missing"),
    ("deepseek_v3", "kv_lora_rank", "16", "`kv_lora_rank` must be an integer"),
    ("deepseek_v3", "rope_parameters", "yarn", "`rope_parameters` must be an object"),
    ("kimi_linear", "linear_attn_config", [1], "`linear_attn_config` must be an object"),
    ("kimi_linear", "mlp_layer_types", "dense", "`mlp_layer_types` must be a list"),
])
def test_nested_config_fields_are_named(family, field, value, needle):
    cfg = _config(family)
    cfg[field] = value
    with pytest.raises(hf.HFError, match=needle):
        hf.config_from_hf(cfg)


def test_kimi_layer_numbers_out_of_range_are_named():
    cfg = _config("kimi_linear")
    cfg.pop("layer_types", None)
    n = cfg["num_hidden_layers"]
    cfg["linear_attn_config"] = dict(cfg.get("linear_attn_config") or {}, full_attn_layers=[n + 1],
                                     kda_layers=list(range(1, n)))
    with pytest.raises(hf.HFError, match=r"`linear_attn_config.full_attn_layers` must list layer numbers"):
        hf.config_from_hf(cfg)


def test_config_json_that_is_not_an_object(tmp_path):
    d = _copy(tmp_path)
    with open(os.path.join(d, "config.json"), "w") as f:
        f.write("[1, 2]")
    with pytest.raises(hf.HFError, match="config.json: must hold a JSON object"):
        hf.load(d)


# ----------------------------------------------------------------------------- safetensors files
def test_truncated_safetensors_is_refused_before_reading(tmp_path):
    d = _copy(tmp_path)
    f = os.path.join(d, "model.safetensors")
    os.truncate(f, os.path.getsize(f) // 2)
    with pytest.raises(hf.HFError, match=r"model\.safetensors: tensor '.*' lies at bytes .*truncated or corrupt"):
        hf.load(d)


def test_header_longer_than_the_file_is_refused(tmp_path):
    d = _copy(tmp_path)
    f = os.path.join(d, "model.safetensors")
    with open(f, "wb") as out:
        out.write((10 ** 15).to_bytes(8, "little") + b"{}")
    with pytest.raises(hf.HFError, match=r"model\.safetensors: not a safetensors file \(header of"):
        hf.load(d)


def _rewrite_header(f: str, edit) -> None:
    with open(f, "rb") as src:
        raw = src.read()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    header = edit(header)
    hb = json.dumps(header).encode()
    with open(f, "wb") as out:
        out.write(len(hb).to_bytes(8, "little") + hb + raw[8 + n:])


def test_malformed_header_entry_is_named(tmp_path):
    d = _copy(tmp_path)

    def edit(h):
        name = sorted(k for k in h if k != "__metadata__")[0]
        h[name]["shape"] = "big"
        return h
    _rewrite_header(os.path.join(d, "model.safetensors"), edit)
    with pytest.raises(hf.HFError, match=r"model\.safetensors: tensor '.*' has a malformed header entry"):
        hf.load(d)


def test_header_that_is_not_an_object(tmp_path):
    d = _copy(tmp_path)
    _rewrite_header(os.path.join(d, "model.safetensors"), lambda h: [1, 2])
    with pytest.raises(hf.HFError, match="the header is not a JSON object"):
        hf.load(d)


def test_tensor_bytes_that_do_not_match_its_shape(tmp_path):
    d = _copy(tmp_path)

    def edit(h):
        name = sorted(k for k in h if k != "__metadata__")[0]
        begin, end = h[name]["data_offsets"]
        h[name]["data_offsets"] = [begin, end - 4]
        return h
    _rewrite_header(os.path.join(d, "model.safetensors"), edit)
    with pytest.raises(hf.HFError, match=r"needs \d+ bytes, the header gives it \d+"):
        hf.load(d)


def test_a_tensor_with_nan_values_is_named(tmp_path):
    import numpy as np
    from safetensors.numpy import load_file, save_file
    d = _copy(tmp_path)
    path = os.path.join(d, "model.safetensors")
    tensors = load_file(path)
    name = sorted(tensors)[-1]
    tensors[name] = tensors[name].copy()
    tensors[name].flat[3] = np.nan
    save_file(tensors, path)
    with pytest.raises(hf.HFError, match=rf"model.safetensors: tensor '{name}' holds 1 NaN or infinite values"):
        hf.load(d)


def _sharded(tmp_path) -> str:
    d = str(tmp_path / "sharded")
    hf.save(_gpt2(), d, max_shard_bytes=40_000)
    return d


def test_index_that_is_not_json(tmp_path):
    d = _sharded(tmp_path)
    with open(os.path.join(d, hf.INDEX_FILE), "w") as f:
        f.write("{bad")
    with pytest.raises(hf.HFError, match=r"model\.safetensors\.index\.json: not valid JSON"):
        hf.load(d)


@pytest.mark.parametrize("content", ["[]", '{"weight_map": []}'])
def test_index_without_a_weight_map(tmp_path, content):
    d = _sharded(tmp_path)
    with open(os.path.join(d, hf.INDEX_FILE), "w") as f:
        f.write(content)
    with pytest.raises(hf.HFError, match="no `weight_map`"):
        hf.load(d)


@pytest.mark.parametrize("target", [3, "../model.safetensors", "sub/x.safetensors"])
def test_index_naming_something_other_than_a_file_in_the_directory(tmp_path, target):
    d = _sharded(tmp_path)
    index = os.path.join(d, hf.INDEX_FILE)
    with open(index) as f:
        content = json.load(f)
    name = sorted(content["weight_map"])[0]
    content["weight_map"][name] = target
    with open(index, "w") as f:
        json.dump(content, f)
    with pytest.raises(hf.HFError, match=f"maps tensor '{name}' to .* not a file name"):
        hf.load(d)


def test_truncated_shard_is_named(tmp_path):
    d = _sharded(tmp_path)
    shard = sorted(f for f in os.listdir(d) if f.startswith("model-"))[-1]
    f = os.path.join(d, shard)
    os.truncate(f, os.path.getsize(f) - 4)
    with pytest.raises(hf.HFError, match=f"{shard}: tensor '.*' lies at bytes"):
        hf.load(d)


# ----------------------------------------------------------------------------- save
def test_save_refuses_a_directory_holding_a_checkpoint_and_keeps_its_files(tmp_path):
    d = tmp_path / "out"
    d.mkdir()
    (d / "config.json").write_text('{"mine": 1}')
    (d / "notes.txt").write_text("keep")
    with pytest.raises(hf.HFError, match=r"save: `path` .* already holds a checkpoint \(config.json\)"):
        hf.save(_gpt2(), str(d))
    assert (d / "config.json").read_text() == '{"mine": 1}'
    assert sorted(os.listdir(d)) == ["config.json", "notes.txt"]


def test_save_over_a_sharded_checkpoint_is_refused(tmp_path):
    """A single-file save over shards would leave the old index, which load then prefers."""
    d = _sharded(tmp_path)
    before = sorted(os.listdir(d))
    with pytest.raises(hf.HFError, match="already holds a checkpoint"):
        hf.save(_gpt2(), d)
    assert sorted(os.listdir(d)) == before


def test_save_into_a_directory_of_other_files_is_fine(tmp_path):
    d = tmp_path / "out"
    d.mkdir()
    (d / "tokenizer.json").write_text("{}")
    assert hf.save(_gpt2(), str(d)) == ["model.safetensors"]
    assert (d / "tokenizer.json").read_text() == "{}"


def test_save_onto_a_file_is_refused(tmp_path):
    f = tmp_path / "afile"
    f.write_text("precious")
    with pytest.raises(hf.HFError, match="save: `path` .* exists and is not a directory"):
        hf.save(_gpt2(), str(f))
    assert f.read_text() == "precious"


@pytest.mark.parametrize("value", [0, -5, 1.5, "100", True])
def test_save_rejects_a_bad_max_shard_bytes(tmp_path, value):
    with pytest.raises(hf.HFError, match="save: `max_shard_bytes` must be a positive int"):
        hf.save(_gpt2(), str(tmp_path / "out"), max_shard_bytes=value)
    assert not (tmp_path / "out").exists()


def test_save_rejects_what_is_not_a_decoder(tmp_path):
    with pytest.raises(hf.HFError, match="save: `model` must be a lineage_jax Decoder, got str"):
        hf.save("model", str(tmp_path / "out"))
