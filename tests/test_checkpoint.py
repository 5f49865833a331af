"""Conversion both ways, sharded loading, and the errors a bad checkpoint directory gets."""

import json
import os
import shutil

import jax
import numpy as np
import pytest
from model_helpers import build_row, left_pad, random_patches, ref_logits, rel_err

import codedance_jax
from codedance_jax.checkpoint import hf, safetensors_io
from codedance_jax.checkpoint.convert import convert
from codedance_jax.processing.reference_files import write_qwen25vl_processor_files


@pytest.fixture(scope="module")
def hf_dir(tiny_pair, tmp_path_factory):
    """The reference model saved by transformers itself, plus real tokenizer/preprocessor files."""
    ref, _, _ = tiny_pair
    d = str(tmp_path_factory.mktemp("hf"))
    ref.save_pretrained(d)
    write_qwen25vl_processor_files(d)
    return d


def test_hf_to_orbax_to_hf_is_bit_identical(hf_dir, tmp_path):
    orbax_dir, back = str(tmp_path / "orbax"), str(tmp_path / "back")
    assert convert(hf_dir, orbax_dir, log=lambda s: None) == "hf->orbax"
    assert convert(orbax_dir, back, log=lambda s: None) == "orbax->hf"
    a, b = safetensors_io.SafetensorsDir(hf_dir), safetensors_io.SafetensorsDir(back)
    assert sorted(a.keys()) == sorted(b.keys())
    for k in a.keys():
        x, y = a.get(k), b.get(k)
        assert x.dtype == y.dtype and x.shape == y.shape
        assert x.tobytes() == y.tobytes(), k
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json", "preprocessor_config.json"):
        assert os.path.exists(os.path.join(back, f)), f


def test_exported_checkpoint_loads_in_transformers_with_equal_logits(tiny_pair, hf_dir, tmp_path):
    """orbax -> HF export (bf16 shards, several files) is read by transformers."""
    import torch
    from transformers import Qwen2_5_VLForConditionalGeneration

    _, ours, cfg = tiny_pair
    out = str(tmp_path / "exported")
    files = hf.export_hf(ours, out, max_shard_bytes=8 << 20)
    assert len(files) > 1 and os.path.exists(os.path.join(out, safetensors_io.INDEX))
    back = Qwen2_5_VLForConditionalGeneration.from_pretrained(out, dtype=torch.float32).eval()
    rng = np.random.default_rng(40)
    grids = [(1, 6, 8)]
    ids, mask = left_pad([build_row(rng, cfg, grids, [5, 7])])
    pv = random_patches(rng, cfg, grids)
    assert rel_err(ours(ids, mask, pv, np.array(grids)), ref_logits(back, ids, mask, pv, grids)) <= 1e-4


def test_from_pretrained_both_formats_and_bf16(tiny_pair, hf_dir, tmp_path):
    ref, _, cfg = tiny_pair
    orbax_dir = str(tmp_path / "orbax")
    convert(hf_dir, orbax_dir, log=lambda s: None)
    rng = np.random.default_rng(41)
    grids = [(1, 4, 4)]
    ids, mask = left_pad([build_row(rng, cfg, grids, [6, 3])])
    pv = random_patches(rng, cfg, grids)
    want = ref_logits(ref, ids, mask, pv, grids)
    for path in (hf_dir, orbax_dir):
        model, proc = codedance_jax.from_pretrained(path)
        assert proc.padding_side == "left" and proc.image_token_id == cfg.image_token_id
        assert rel_err(model(ids, mask, pv, np.array(grids)), want) <= 1e-4
    model, _ = codedance_jax.from_pretrained(hf_dir, dtype="bfloat16")
    assert model.embed[...].dtype == jax.numpy.bfloat16
    assert rel_err(np.asarray(model(ids, mask, pv, np.array(grids)), np.float32), want) <= 5e-2


def test_sharded_load_places_shards_without_gathering(hf_dir, tmp_path):
    """On a 2x2x2 mesh every parameter arrives with its logical sharding, for both formats."""
    from codedance_jax import sharding as shd

    mesh = shd.make_mesh(2, 2, 2)
    orbax_dir = str(tmp_path / "orbax")
    convert(hf_dir, orbax_dir, log=lambda s: None)
    for path in (hf_dir, orbax_dir):
        model, _ = codedance_jax.from_pretrained(path, mesh=mesh, processor=False)
        k = model.layers[0].mlp.gate.kernel[...]  # logical (embed, mlp) -> (fsdp, tensor)
        assert k.sharding.spec == jax.sharding.PartitionSpec("fsdp", "tensor")
        assert k.addressable_shards[0].data.shape == (k.shape[0] // 2, k.shape[1] // 2)
        emb = model.embed[...]  # (vocab, embed) -> (tensor, fsdp)
        assert emb.sharding.spec == jax.sharding.PartitionSpec("tensor", "fsdp")


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_missing_file_wrong_shape_unknown_arch_are_clear_errors(hf_dir, tmp_path):
    d = _copy(hf_dir, str(tmp_path / "no_weights"))
    os.remove(os.path.join(d, "model.safetensors"))
    with pytest.raises(FileNotFoundError, match="safetensors"):
        codedance_jax.from_pretrained(d)

    d = _copy(hf_dir, str(tmp_path / "no_config"))
    os.remove(os.path.join(d, "config.json"))
    with pytest.raises(FileNotFoundError, match="config.json"):
        codedance_jax.from_pretrained(d)

    d = _copy(hf_dir, str(tmp_path / "wrong_shape"))
    with open(os.path.join(d, "config.json")) as f:
        cfg = json.load(f)
    cfg["text_config"]["intermediate_size"] = 96  # weights say 128
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f)
    with pytest.raises(ValueError, match=r"mlp\.(gate|up|down)_proj\.weight has shape .* config.json implies"):
        codedance_jax.from_pretrained(d)

    d = _copy(hf_dir, str(tmp_path / "llava"))
    with open(os.path.join(d, "config.json")) as f:
        cfg = json.load(f)
    cfg["model_type"], cfg["architectures"] = "llava", ["LlavaForConditionalGeneration"]
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f)
    with pytest.raises(ValueError, match="unsupported architecture"):
        codedance_jax.from_pretrained(d)


def test_missing_tensor_is_named(hf_dir, tmp_path):
    d = str(tmp_path / "missing_tensor")
    os.makedirs(d)
    src = safetensors_io.SafetensorsDir(hf_dir)
    keep = [k for k in src.keys() if k != "model.layers.1.self_attn.k_proj.bias"]
    safetensors_io.write(d, ((k, src.get(k)) for k in keep), shapes={k: (src.get(k).shape, src.get(k).dtype) for k in keep})
    shutil.copy(os.path.join(hf_dir, "config.json"), d)
    with pytest.raises(KeyError, match=r"model\.layers\.1\.self_attn\.k_proj\.bias"):
        codedance_jax.from_pretrained(d, processor=False)


def test_full_presets_have_transformers_parameter_counts():
    """jax.eval_shape sizes (no memory): 7B 8,292,166,656 (vision 676,550,144); 3B tied 3,754,622,976."""
    from codedance_jax.model import ModelConfig, num_params

    assert num_params(ModelConfig.qwen25vl_7b()) == {"total": 8_292_166_656, "vision": 676_550_144}
    assert num_params(ModelConfig.qwen25vl_3b()) == {"total": 3_754_622_976, "vision": 668_684_288}


def test_config_round_trip_and_released_flat_layout():
    from transformers import Qwen2_5_VLConfig

    from codedance_jax.model import ModelConfig

    for cfg in (ModelConfig.tiny(), ModelConfig.qwen25vl_3b(), ModelConfig.qwen25vl_7b()):
        flat = cfg.to_hf_config()
        assert ModelConfig.from_hf_config(flat) == cfg
        nested = Qwen2_5_VLConfig(**flat).to_dict()  # transformers v5's nested layout
        assert ModelConfig.from_hf_config(nested) == cfg
