"""A Llama on a float8 KV cache: the checkpoint's k_scale/v_scale tensors (per layer and per KV head, sharded
with the KV heads at tp 2), the scales in the cache, and logits close to those on a float32 cache."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from checkpoints import make_llama_checkpoint, random_token_ids
from multirank import device
from safetensors.torch import load_file, save_file

from tpkit.attention import calibrated_kv_scales

PROMPT_LEN = 12


@pytest.fixture(scope="module")
def fp8_kv_checkpoint(tmp_path_factory):
    """A Llama (2 KV heads) whose checkpoint has calibrated KV scales: layer 0's per tensor as
    ``self_attn.k_scale``, layer 1's per KV head as the older ``k_proj.k_scale`` / ``v_proj.v_scale``."""
    from tpkit.models import from_pretrained

    path = tmp_path_factory.mktemp("llama_fp8_kv")
    make_llama_checkpoint(path, num_key_value_heads=2)
    (prompt,) = random_token_ids(256, (PROMPT_LEN,), seed=3)
    model = from_pretrained(str(path), device="cpu")
    cache = model.new_kv_cache(4)
    reference = model.forward_on_cache(cache, [0], [prompt.tolist()])[0]
    scales = [calibrated_kv_scales(cache.key_caches[i], cache.value_caches[i], per_head=i == 1)
              for i in range(2)]
    weights = load_file(path / "model.safetensors")
    weights["model.layers.0.self_attn.k_scale"] = scales[0][0]
    weights["model.layers.0.self_attn.v_scale"] = scales[0][1]
    weights["model.layers.1.self_attn.k_proj.k_scale"] = scales[1][0]
    weights["model.layers.1.self_attn.v_proj.v_scale"] = scales[1][1]
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return str(path), prompt.tolist(), reference, scales


def _fp8_rounded(x, scale, num_kv_heads):
    """x [batch, seq, num_kv_heads * head_size] through float8 E4M3 and back with a scale [] or
    [num_kv_heads]: what a float8 cache holds, computed apart from tpkit's ops."""
    heads = x.float().unflatten(-1, (num_kv_heads, -1))
    scale = scale.view(-1, 1).to(x.device)
    stored = (heads / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
    return (stored.float() * scale).flatten(-2).to(x.dtype)


def _fp8_logits(path, prompt, tp_size):
    """This rank's cache scales, its logits on a float8 cache, and its logits on a float32 cache whose
    attention modules get K/V rounded through float8 by hooks (the reference)."""
    from tpkit.models import from_pretrained
    from tpkit.parallel_layers import init_tensor_parallel

    tp = init_tensor_parallel(tp_size)
    model = from_pretrained(path, device=device(), kv_cache_dtype="fp8")
    cache = model.new_kv_cache(4)
    assert cache.dtype == torch.float8_e4m3fn and model.cache_dtype == torch.float8_e4m3fn
    scales = {(i, name): scale.cpu() for i in range(2)
              for name, scale in zip("kv", cache.scales(i), strict=True)}
    with torch.no_grad():
        logits = model.forward_on_cache(cache, [0], [prompt])[0].cpu()
        model.kv_cache_dtype = None
        hooks = [layer.self_attn.attn.register_forward_pre_hook(
            lambda module, args, i=i: (args[0], *(_fp8_rounded(x, scales[i, name], module.num_kv_heads)
                                                 for x, name in zip(args[1:], "kv", strict=True))))
            for i, layer in enumerate(model.layers)]
        reference = model.forward_on_cache(model.new_kv_cache(4), [0], [prompt])[0].cpu()
        for hook in hooks:
            hook.remove()
    return tp.rank, scales, logits, reference


@pytest.mark.parametrize("tp_size", [1, 2])
def test_checkpoint_scales_shard_with_the_kv_heads_and_logits_match(ranks, fp8_kv_checkpoint, tp_size):
    path, prompt, unquantized, scales = fp8_kv_checkpoint
    for rank, loaded, logits, reference in ranks.run(tp_size, _fp8_logits, path, prompt, tp_size):
        heads = slice(None) if tp_size == 1 else slice(rank, rank + 1)
        torch.testing.assert_close(loaded[0, "k"], scales[0][0], rtol=0, atol=0)
        torch.testing.assert_close(loaded[0, "v"], scales[0][1], rtol=0, atol=0)
        torch.testing.assert_close(loaded[1, "k"], scales[1][0][heads], rtol=0, atol=0)
        torch.testing.assert_close(loaded[1, "v"], scales[1][1][heads], rtol=0, atol=0)
        torch.testing.assert_close(logits, reference, rtol=1e-4, atol=1e-4)
        assert (logits - unquantized).abs().max() > 1e-3  # the cache really is float8


def test_kv_cache_scheme_selects_fp8_and_bad_dtypes_are_refused(fp8_kv_checkpoint, tmp_path):
    from tpkit.models import from_pretrained

    path, prompt, reference, _ = fp8_kv_checkpoint
    with pytest.raises(ValueError, match=r"kv_cache_dtype: expected None, \['fp8', .*got 'int8'"):
        from_pretrained(path, device="cpu", kv_cache_dtype="int8")
    config = json.loads(Path(path, "config.json").read_text())
    config["quantization_config"] = {"quant_method": "compressed-tensors", "config_groups": {},
                                     "kv_cache_scheme": {"type": "float", "num_bits": 8, "strategy": "tensor",
                                                         "dynamic": False, "symmetric": True}}
    for name in ("model.safetensors", "generation_config.json"):
        shutil.copy(Path(path, name), tmp_path / name)
    (tmp_path / "config.json").write_text(json.dumps(config))
    model = from_pretrained(str(tmp_path), device="cpu")
    assert model.cache_dtype == torch.float8_e4m3fn
    tokens = model.generate([prompt], 4, ignore_eos=True)
    assert tokens[0][0] == int(reference[-1].argmax())
