"""What a careless or hostile caller can do wrong with the public API, one row each: layers, loaders,
attention, models.

Every row builds its objects afresh, makes one bad call and asserts the exception's type, that its message
names the argument (or config key, or file) with what was expected and what was received, and that nothing
it was handed changed: parameters, cache blocks, checkpoint files. The multi-rank twin is
``test_bad_input_ranks.py``; a bounded hypothesis fuzz closes the file.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from tpkit.attention import Attention, PagedKVCache, paged_attention, reshape_and_cache
from tpkit.loaders import CheckpointError, WeightsMismatchError, iter_weights, load_weights
from tpkit.models import (
    BartForConditionalGeneration,
    GPTBigCodeForCausalLM,
    LlamaForCausalLM,
    from_pretrained,
)
from tpkit.ops import apply_rotary
from tpkit.parallel_layers import (
    ColumnParallelLinear,
    ParallelLMHead,
    TPGroup,
    VocabParallelEmbedding,
    clip_grad_norm_,
    init_tensor_parallel,
    pad_vocab_size,
    seed_tensor_parallel,
    tensor_parallel_dropout,
    vocab_parallel_cross_entropy,
)

SINGLE = TPGroup(None, 0, 1)

LLAMA = dict(architectures=["LlamaForCausalLM"], vocab_size=64, hidden_size=16, intermediate_size=32,
             num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
             eos_token_id=2)
BIGCODE = dict(architectures=["GPTBigCodeForCausalLM"], vocab_size=64, n_embd=16, n_layer=2, n_head=2,
               n_positions=32, eos_token_id=0)
BART = dict(architectures=["BartForConditionalGeneration"], vocab_size=64, d_model=16, encoder_layers=1,
            decoder_layers=1, encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
            decoder_ffn_dim=32, max_position_embeddings=32, decoder_start_token_id=2, eos_token_id=2)


@dataclass
class Attempt:
    """A bad call and what it must leave as it was: tensors (compared by value), files (by bytes) and state
    read by a function (by what it returns)."""

    call: Callable[[], object]
    watched: list[torch.Tensor | Path | Callable[[], object]] = field(default_factory=list)


@dataclass
class Case:
    area: str
    id: str
    make: Callable[[Path], Attempt]
    error: type[BaseException]
    match: str  # a regex the message must contain: the argument or key, what was expected, what was received


def _state(watched: torch.Tensor | Path | Callable[[], object]) -> object:
    if isinstance(watched, Path):
        return watched.read_bytes()
    if isinstance(watched, torch.Tensor):
        return watched.detach().clone()
    return watched()


def _snapshot(watched: list) -> list[object]:
    return [_state(w) for w in watched]


def _same(now: object, then: object) -> bool:
    if isinstance(now, torch.Tensor):  # bit for bit: uninitialised memory may hold NaN
        return torch.equal(now.contiguous().view(-1).view(torch.uint8),
                           then.contiguous().view(-1).view(torch.uint8))
    return now == then


def _unchanged(watched: list, before: list[object]) -> bool:
    return all(_same(now, then) for now, then in zip(_snapshot(watched), before, strict=True))


def _llama(**overrides: object) -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM({**LLAMA, **overrides}, tp_group=SINGLE).eval()


def _params(model: nn.Module) -> list[torch.Tensor]:
    return list(model.parameters())


def _construct(cls: type, config: dict, **overrides: object) -> Attempt:
    return Attempt(lambda: cls({**config, **overrides}, tp_group=SINGLE))


# --- layers -----------------------------------------------------------------------------------------------

def _embedding(ids: torch.Tensor) -> Attempt:
    layer = VocabParallelEmbedding(200, 8, tp_group=SINGLE)
    return Attempt(lambda: layer(ids), _params(layer))


def _clip(max_norm: float) -> Attempt:
    layer = ColumnParallelLinear(4, 6, tp_group=SINGLE)
    layer(torch.randn(3, 4)).sum().backward()
    return Attempt(lambda: clip_grad_norm_(layer, max_norm), [layer.weight.grad])


LAYER_CASES = [
    Case("layers", "embedding-id-past-vocab", lambda _: _embedding(torch.tensor([5, 250])), ValueError,
         r"input_ids\[1\]: expected values in \[0, 200\), got 250"),
    Case("layers", "embedding-negative-id", lambda _: _embedding(torch.tensor([[3, -1]])), ValueError,
         r"input_ids\[0, 1\]: expected values in \[0, 200\), got -1"),
    Case("layers", "embedding-float-ids", lambda _: _embedding(torch.tensor([1.0])), TypeError,
         r"input_ids: expected dtype torch.int64 or torch.int32, got torch.float32"),
    Case("layers", "embedding-size-zero",
         lambda _: Attempt(lambda: VocabParallelEmbedding(0, 8, tp_group=SINGLE)),
         ValueError, r"num_embeddings must be a positive int, got 0"),
    Case("layers", "column-size-float",
         lambda _: Attempt(lambda: ColumnParallelLinear(4, 6.0, tp_group=SINGLE)),
         ValueError, r"output_size must be a positive int, got 6.0"),
    Case("layers", "tie-to-a-linear",
         lambda _: Attempt(lambda: ParallelLMHead(8, 4, tp_group=SINGLE).tie_weights(
             ColumnParallelLinear(4, 8, tp_group=SINGLE))),
         TypeError, r"tie_weights takes a VocabParallelEmbedding, got ColumnParallelLinear"),
    Case("layers", "weight-loader-shape", lambda _: (lambda layer: Attempt(
        lambda: layer.weight.weight_loader(layer.weight, torch.randn(6, 5)), _params(layer)))(
        ColumnParallelLinear(4, 6, tp_group=SINGLE)), ValueError,
         r"expected a checkpoint tensor of shape \(6, 4\), received \(6, 5\)"),
    Case("layers", "clip-nan-max-norm", lambda _: _clip(float("nan")), ValueError,
         r"max_norm must be a positive finite number, received nan"),
    Case("layers", "dropout-p-above-one",
         lambda _: Attempt(lambda: tensor_parallel_dropout(torch.ones(3), 1.5)), ValueError,
         r"p must be a probability in \[0, 1\), received 1.5"),
    Case("layers", "seed-negative", lambda _: Attempt(lambda: seed_tensor_parallel(-1)), ValueError,
         r"seed must be a non-negative int, received -1"),
    Case("layers", "column-input-width", lambda _: (lambda layer: Attempt(
        lambda: layer(torch.randn(2, 5)), _params(layer)))(ColumnParallelLinear(4, 6, tp_group=SINGLE)),
         ValueError, r"ColumnParallelLinear: input: expected a last dimension of 4 \(input_size\), got shape "
                     r"\[2, 5\]"),
    Case("layers", "lm-head-label-past-vocab", lambda _: (lambda head: Attempt(
        lambda: head.cross_entropy(torch.randn(3, 4), torch.tensor([1, -100, 8])), _params(head)))(
        ParallelLMHead(8, 4, tp_group=SINGLE)), ValueError,
         r"ParallelLMHead\(num_embeddings=8\): labels\[2\]: expected values in \[0, 8\), got 8"),
    Case("layers", "lm-head-hidden-width", lambda _: Attempt(
        lambda: ParallelLMHead(10, 8, tp_group=SINGLE)(torch.randn(2, 7))), ValueError,
         r"ParallelLMHead: hidden_states: expected a last dimension of 8 \(embedding_dim\), got shape "
         r"\[2, 7\]"),
    Case("layers", "cross-entropy-negative-label", lambda _: Attempt(lambda: vocab_parallel_cross_entropy(
        torch.randn(3, 8), torch.tensor([1, -5, 2]), 0, 8, tp_group=SINGLE)), ValueError,
         r"labels\[1\]: expected values in \[0, 8\), got -5"),
    Case("layers", "clip-max-norm-bool", lambda _: _clip(True), ValueError,
         r"max_norm must be a positive finite number, received True"),
    Case("layers", "pad-vocab-size-zero", lambda _: Attempt(lambda: pad_vocab_size(10, 0)), ValueError,
         r"padding_size must be a positive int, got 0"),
    Case("layers", "rotary-table-width", lambda _: Attempt(lambda: apply_rotary(
        torch.randn(1, 2, 3, 8), torch.randn(1, 2, 1, 3), torch.randn(1, 2, 1, 4))), ValueError,
         r"apply_rotary: cos: expected shape \[batch, seq, 1, 4\] \(half of x's head size 8\), got "
         r"\[1, 2, 1, 3\]"),
    Case("layers", "tp-size-zero", lambda _: Attempt(lambda: init_tensor_parallel(0)), ValueError,
         r"tp_size must be a positive int, got 0"),
]


# --- attention --------------------------------------------------------------------------------------------

def _paged(**bad: object) -> Attempt:
    """6 blocks of 8 slots, 2 sequences of up to 16 tokens; ``bad`` replaces arguments of paged_attention."""
    g = torch.Generator().manual_seed(0)
    args = dict(query=torch.randn(2, 4, 16, generator=g), key_cache=torch.randn(6, 8, 2, 16, generator=g),
                value_cache=torch.randn(6, 8, 2, 16, generator=g),
                block_tables=torch.tensor([[0, 1], [2, 3]], dtype=torch.int32),
                seq_lens=torch.tensor([9, 3], dtype=torch.int32))
    args.update(bad)
    watched = [args["key_cache"], args["value_cache"]]
    return Attempt(lambda: paged_attention(*[args.pop(k) for k in ("query", "key_cache", "value_cache",
                                                                      "block_tables", "seq_lens")], **args),
                   watched)


def _write(slot_mapping: list[int]) -> Attempt:
    g = torch.Generator().manual_seed(1)
    key_cache, value_cache = torch.randn(6, 8, 2, 16, generator=g), torch.randn(6, 8, 2, 16, generator=g)
    key = torch.randn(len(slot_mapping), 2, 16, generator=g)
    return Attempt(lambda: reshape_and_cache(key, key.clone(), key_cache, value_cache,
                                             torch.tensor(slot_mapping)), [key_cache, value_cache])


def _kv_cache(step: Callable[[PagedKVCache], object]) -> Attempt:
    cache = PagedKVCache(1, 4, 4, 1, 8, dtype=torch.float32, device="cpu")
    cache.prefill_metadata([0], [5])
    return Attempt(lambda: step(cache),
                   [lambda: (cache.num_free_blocks, cache.seq_len(0), cache._seq_blocks)])


def _lens(*lens: int) -> torch.Tensor:
    return torch.tensor(lens, dtype=torch.int32)


ATTENTION_CASES = [
    Case("attention", "scale-nan", lambda _: _paged(scale=float("nan")), ValueError,
         r"paged_attention: scale: expected a finite float, got nan"),
    Case("attention", "scale-inf", lambda _: _paged(scale=float("inf")), ValueError,
         r"scale: expected a finite float, got inf"),
    Case("attention", "block-id-minus-one", lambda _: _paged(
        block_tables=torch.tensor([[0, -1], [2, 3]], dtype=torch.int32)), ValueError,
         r"block_tables\[0, 1\]: expected a block index in \[0, 6\) .*got -1"),
    Case("attention", "block-id-past-cache", lambda _: _paged(
        block_tables=torch.tensor([[0, 1], [6, 3]], dtype=torch.int32)), ValueError,
         r"block_tables\[1, 0\]: expected a block index in \[0, 6\) .*got 6"),
    Case("attention", "seq-len-past-table", lambda _: _paged(seq_lens=_lens(9, 17)), ValueError,
         r"seq_lens\[1\]: expected a length in \[0, 16\] \(the capacity of block_tables\), got 17"),
    Case("attention", "seq-len-negative", lambda _: _paged(seq_lens=_lens(-1, 3)), ValueError,
         r"seq_lens\[0\]: expected a length in \[0, 16\] .*got -1"),
    Case("attention", "seq-len-huge", lambda _: _paged(seq_lens=_lens(9, 10**6)), ValueError,
         r"seq_lens\[1\]: expected a length in \[0, 16\] .*got 1000000"),
    Case("attention", "seq-lens-int64", lambda _: _paged(seq_lens=torch.tensor([9, 3])), TypeError,
         r"seq_lens: expected dtype torch.int32, got torch.int64"),
    Case("attention", "slot-twice", lambda _: _write([3, 9, 3]), ValueError,
         r"slot_mapping\[2\]: expected distinct slots .*got 3, the slot of slot_mapping\[0\] too"),
    Case("attention", "slot-past-cache", lambda _: _write([3, 48]), ValueError,
         r"slot_mapping\[1\]: expected a slot below num_blocks \* block_size = 48 .*got 48"),
    Case("attention", "attention-kv-heads", lambda _: Attempt(lambda: Attention(4, 16, 3)), ValueError,
         r"num_kv_heads: expected a divisor of num_heads = 4, got 3"),
    Case("attention", "attention-scale-nan", lambda _: Attempt(lambda: Attention(4, 16, scale=float("nan"))),
         ValueError, r"Attention: scale: expected a finite number \(or None\), got nan"),
    Case("attention", "cache-prompt-len-zero", lambda _: _kv_cache(lambda c: c.prefill_metadata([1], [0])),
         ValueError, r"prompt_lens: expected positive ints, got 0 for seq_id 1"),
    Case("attention", "cache-prefill-twice", lambda _: _kv_cache(lambda c: c.prefill_metadata([0], [2])),
         ValueError, r"seq_ids: expected new sequences, got 0, which is already cached"),
    Case("attention", "cache-decode-unknown", lambda _: _kv_cache(lambda c: c.decode_metadata([0, 7])),
         ValueError, r"seq_id: expected a cached sequence \(one of \[0\]\), got 7"),
    Case("attention", "cache-out-of-blocks", lambda _: _kv_cache(lambda c: c.prefill_metadata([1], [13])),
         RuntimeError, r"this prefill step needs 4 blocks, 2 of 4 are free"),
    Case("attention", "cache-seq-id-bool", lambda _: _kv_cache(lambda c: c.prefill_metadata([True], [2])),
         TypeError, r"PagedKVCache: seq_ids: expected ints, got True"),
    Case("attention", "cache-too-large", lambda _: Attempt(
        lambda: PagedKVCache(1, 2**40, 16, 8, 128, dtype=torch.float16, device="cpu")), ValueError,
         r"num_blocks: 1 layers' key and value caches of \[num_blocks=1099511627776, .*\] torch.float16 take "
         r"7.21e\+07 GB, more than the [\d.e+]+ GB available on cpu"),
    Case("attention", "attention-key-lens-zero", lambda _: Attempt(lambda: Attention(2, 8, causal=False)(
        torch.randn(2, 3, 16), torch.randn(2, 4, 16), torch.randn(2, 4, 16), key_lens=torch.tensor([4, 0]))),
         ValueError, r"Attention: key_lens\[1\]: expected a length in \[1, 4\] \(kv_len\), got 0"),
    Case("attention", "cache-num-blocks-zero", lambda _: Attempt(
        lambda: PagedKVCache(1, 0, 4, 1, 8, dtype=torch.float16, device="cpu")), ValueError,
         r"num_blocks: expected a positive int, got 0"),
]


# --- models -----------------------------------------------------------------------------------------------

def _forward(model: nn.Module, *inputs: torch.Tensor) -> Attempt:
    return Attempt(lambda: model(*inputs), _params(model))


def _generate(model: nn.Module, *args: object, **kwargs: object) -> Attempt:
    return Attempt(lambda: model.generate(*args, **kwargs), _params(model))


def _trained(model: nn.Module) -> nn.Module:
    return model.train()


def _with(model: nn.Module, **attributes: object) -> nn.Module:
    for name, value in attributes.items():
        setattr(model, name, value)
    return model


def _json_checkpoint(tmp: Path, config: object) -> Attempt:
    (tmp / "config.json").write_text(json.dumps(config))
    save_file({"x": torch.zeros(1)}, tmp / "model.safetensors")
    return Attempt(lambda: from_pretrained(tmp, tp_group=SINGLE), [tmp / "config.json"])


MODEL_CASES = [
    Case("models", "config-missing-key", lambda _: _construct(LlamaForCausalLM, LLAMA, hidden_size=None),
         ValueError, r"LlamaForCausalLM: config.json: hidden_size: missing \(required\)"),
    Case("models", "config-hidden-size-huge",
         lambda _: _construct(LlamaForCausalLM, LLAMA, hidden_size=10**9), ValueError,
         r"hidden_size=1000000000.* needs about [\d.e+]+ GB .*more than the [\d.e+]+ GB of memory "
         r"available on cpu"),
    Case("models", "config-positions-huge", lambda _: _construct(LlamaForCausalLM, LLAMA,
                                                                  max_position_embeddings=10**10),
         ValueError, r"max_position_embeddings: expected an int in \[1, 2147483647\], got 10000000000"),
    Case("models", "config-layers-huge",
         lambda _: _construct(LlamaForCausalLM, LLAMA, num_hidden_layers=10**6), ValueError,
         r"num_hidden_layers: expected an int in \[1, 4096\], got 1000000"),
    Case("models", "config-heads-string", lambda _: _construct(GPTBigCodeForCausalLM, BIGCODE, n_head="2"),
         ValueError, r"n_head: expected an int in \[1, 2147483647\], got '2'"),
    Case("models", "config-kv-heads-not-divisor", lambda _: _construct(LlamaForCausalLM, LLAMA,
                                                                        num_key_value_heads=3),
         ValueError, r"num_key_value_heads: expected a divisor of num_attention_heads=2, got 3"),
    Case("models", "config-dropout-above-one", lambda _: _construct(BartForConditionalGeneration, BART,
                                                                     dropout=1.5),
         ValueError, r"dropout: expected a probability in \[0, 1\), got 1.5"),
    Case("models", "config-eps-zero", lambda _: _construct(LlamaForCausalLM, LLAMA, rms_norm_eps=0),
         ValueError, r"rms_norm_eps: expected a finite number > 0, got 0"),
    Case("models", "config-activation", lambda _: _construct(GPTBigCodeForCausalLM, BIGCODE,
                                                              activation_function="tanh"),
         ValueError, r"activation_function: expected one of gelu, .*, got 'tanh'"),
    Case("models", "config-eos-string", lambda _: _construct(LlamaForCausalLM, LLAMA, eos_token_id="12"),
         ValueError,
         r"eos_token_id: expected a token id \(an int >= 0\) or a non-empty list of them, got '12'"),
    Case("models", "config-rope-factor-zero", lambda _: _construct(
        LlamaForCausalLM, LLAMA, rope_scaling={"type": "linear", "factor": 0.0}), ValueError,
         r"rope_parameters \(rope_scaling\): factor: expected a finite number > 0 for rope_type 'linear', "
         r"got 0.0"),
    Case("models", "config-rope-theta-nan", lambda _: _construct(LlamaForCausalLM, LLAMA,
                                                                  rope_theta=float("nan")),
         ValueError, r"rope_theta: expected a finite number > 0 for rope_type 'default', got nan"),
    Case("models", "config-rope-llama3-bands", lambda _: _construct(
        LlamaForCausalLM, LLAMA, rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                                "low_freq_factor": 4.0, "high_freq_factor": 4.0,
                                                "original_max_position_embeddings": 16}),
         ValueError, r"high_freq_factor: expected more than low_freq_factor = 4.0, got 4.0"),
    Case("models", "config-decoder-start-past-vocab", lambda _: _construct(
        BartForConditionalGeneration, BART, decoder_start_token_id=64), ValueError,
         r"decoder_start_token_id: expected token ids below vocab_size=64, got 64"),
    Case("models", "config-not-a-dict", lambda _: Attempt(lambda: LlamaForCausalLM([1, 2], tp_group=SINGLE)),
         TypeError, r"config: expected a mapping \(a config.json's dict\), got list"),
    Case("models", "forward-id-past-vocab", lambda _: _forward(_llama(), torch.tensor([[1, 64]])), ValueError,
         r"input_ids\[0, 1\]: expected values in \[0, 64\), got 64"),
    Case("models", "forward-past-positions",
         lambda _: _forward(_llama(), torch.zeros(1, 33, dtype=torch.long)), ValueError,
         r"input_ids: expected at most 32 tokens a sequence \(the model's max_position_embeddings\), got 33"),
    Case("models", "bigcode-past-n-positions", lambda _: _forward(
        GPTBigCodeForCausalLM(BIGCODE, tp_group=SINGLE), torch.zeros(1, 40, dtype=torch.long)), ValueError,
         r"input_ids: expected at most 32 tokens a sequence \(the model's n_positions\), got 40"),
    Case("models", "forward-1d-ids", lambda _: _forward(_llama(), torch.tensor([1, 2])), ValueError,
         r"input_ids: expected a \[batch, seq\] tensor of token ids, got \[2\]"),
    Case("models", "bart-decoder-id-past-vocab", lambda _: _forward(
        BartForConditionalGeneration(BART, tp_group=SINGLE), torch.tensor([[3, 4]]), torch.tensor([[2, 99]])),
         ValueError, r"input_ids\[0, 1\]: expected values in \[0, 64\), got 99"),
    Case("models", "generate-in-training-mode", lambda _: _generate(_trained(_llama()), [[1, 2]], 2),
         ValueError,
         r"generate: the model is in training mode \(model.train\(\)\).* call model.eval\(\) first"),
    Case("models", "generate-prompt-past-vocab", lambda _: _generate(_llama(), [[1, 70]], 2), ValueError,
         r"prompts\[0\] has token ids outside \[0, 64\): \[70\]"),
    Case("models", "generate-past-positions", lambda _: _generate(_llama(), [[1] * 30], 4), ValueError,
         r"prompt length 30 \+ max_new_tokens 4 - 1 exceeds the model's 32 positions "
         r"\(max_position_embeddings\)"),
    Case("models", "generate-forced-bos-past-vocab", lambda _: _generate(
        _with(BartForConditionalGeneration(BART, tp_group=SINGLE).eval(), forced_bos_token_id=64), [[3]], 2),
         ValueError, r"generate: forced_bos_token_id: expected None or a token id in \[0, 64\), got 64"),
    Case("models", "generate-on-meta", lambda _: Attempt(lambda: LlamaForCausalLM(
        LLAMA, device="meta", tp_group=SINGLE).eval().generate([[1]], 2)), ValueError,
         r"generate: the model is on the meta device, which holds no values: model.to_empty"),
    Case("models", "generate-eos-attribute-string", lambda _: _generate(_with(_llama(), eos_token_ids=("2",)),
                                                                         [[1]], 2), ValueError,
         r"eos_token_id: expected a token id \(an int >= 0\), a list of them or null, got \['2'\]"),
    Case("models", "bart-decoder-start-attribute", lambda _: _generate(_with(
        BartForConditionalGeneration(BART, tp_group=SINGLE).eval(), decoder_start_token_id=99), [[3]], 2),
         ValueError, r"generate: decoder_start_token_id: expected a token id in \[0, 64\), got 99"),
    Case("models", "bart-batch-mismatch", lambda _: _forward(BartForConditionalGeneration(
        BART, tp_group=SINGLE), torch.tensor([[3, 4]]), torch.tensor([[2], [2]])),
         ValueError, r"decoder_input_ids: expected the batch of input_ids, 1, got 2"),
    Case("models", "dtype-int8", lambda _: Attempt(lambda: LlamaForCausalLM(LLAMA, dtype=torch.int8,
                                                                             tp_group=SINGLE)),
         TypeError, r"LlamaForCausalLM: dtype: expected a floating-point torch.dtype, got torch.int8"),
    Case("models", "generate-temperature-nan",
         lambda _: _generate(_llama(), [[1]], 2, temperature=float("nan")), ValueError,
         r"temperature must be a finite number >= 0 \(0 = greedy\), got nan"),
    Case("models", "from-pretrained-config-list", lambda tmp: _json_checkpoint(tmp, [1, 2]), CheckpointError,
         r"config.json: expected a JSON object, got list"),
    Case("models", "from-pretrained-architecture",
         lambda tmp: _json_checkpoint(tmp, {"architectures": ["X"]}), ValueError,
         r"architectures \['X'\] has no supported architecture"),
]


# --- loaders ----------------------------------------------------------------------------------------------

def _write_safetensors(path: Path, header: str, data: bytes) -> Path:
    raw = header.encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return path


def _header_row(case_id: str, header: str, match: str) -> Case:
    """A file of 8 data bytes under ``header``, which iter_weights must refuse (and leave as it is)."""
    def make(tmp: Path) -> Attempt:
        file = _write_safetensors(tmp / "model.safetensors", header, bytes(8))
        return Attempt(lambda: iter_weights(tmp), [file])

    return Case("loaders", case_id, make, CheckpointError, match)


def _tiny_module(dtype: torch.dtype = torch.float32, device: str = "cpu") -> nn.Module:
    module = nn.Module()
    module.w = nn.Parameter(torch.randn(4, 3, device=device).to(dtype))
    module.b = nn.Parameter(torch.randn(4, device=device).to(dtype))
    return module


def _load(module: nn.Module, tensors: dict[str, torch.Tensor]) -> Attempt:
    watched = [] if any(p.is_meta for p in module.parameters()) else _params(module)
    return Attempt(lambda: load_weights(module, list(tensors.items()), progress=False), watched)


def _escaping_link(tmp: Path) -> Attempt:
    outside = tmp / "outside"
    outside.mkdir()
    secret = outside / "secret.safetensors"
    save_file({"w": torch.randn(4, 3)}, secret)
    checkpoint = tmp / "checkpoint"
    checkpoint.mkdir()
    (checkpoint / "model.safetensors").symlink_to(secret)
    return Attempt(lambda: iter_weights(checkpoint), [secret])


def _truncated_between(tmp: Path) -> Attempt:
    """The checkpoint's headers are read, then its file is cut short, then the copies are asked for."""
    module = _tiny_module()
    file = tmp / "model.safetensors"
    save_file({"w": torch.randn(4, 3), "b": torch.randn(4)}, file)
    weights = list(iter_weights(tmp))
    file.write_bytes(file.read_bytes()[:-8])
    return Attempt(lambda: load_weights(module, weights, progress=False), _params(module))


class _FailingSecond(nn.Module):
    """Three parameters whose loader fails (on real data) for the second: the first is written by then."""

    def __init__(self) -> None:
        super().__init__()
        for name in "abc":
            param = nn.Parameter(torch.zeros(2))
            param.weight_loader = self._load
            self.register_parameter(name, param)

    def _load(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        if not param.is_meta and param is self.b:
            raise OSError("disk gone")
        param.data.copy_(loaded_weight[...])


def _tied_after_to_empty() -> Attempt:
    with torch.device("meta"):
        model = LlamaForCausalLM({**LLAMA, "tie_word_embeddings": True}, tp_group=SINGLE)
    model.to_empty(device="cpu")
    tensors = {f"model.{name}": torch.randn(p.shape) for name, p in model.named_parameters()
               if not name.startswith("lm_head")}
    return Attempt(lambda: model.load_weights(list(tensors.items())), _params(model))


LOADER_CASES = [
    _header_row("header-key-twice", '{"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},'
                '"a":{"dtype":"U8","shape":[4],"data_offsets":[4,8]}}',
                r"model.safetensors: corrupt safetensors header: 'a' is given twice"),
    _header_row("header-true-dimension", '{"a":{"dtype":"U8","shape":[true,8],"data_offsets":[0,8]}}',
                r"tensor 'a': expected a shape of non-negative ints, received \[True, 8\]"),
    _header_row("header-gap", '{"a":{"dtype":"U8","shape":[4],"data_offsets":[4,8]}}',
                r"tensor 'a' starts at data byte 4, where the tensors before end at 0: it leaves a gap"),
    _header_row("header-bytes-after-tensors", '{"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}}',
                r"its tensors end at data byte 4, the file holds 8 bytes of data"),
    _header_row("header-metadata-int",
                '{"__metadata__":{"k":1},"a":{"dtype":"U8","shape":[8],"data_offsets":[0,8]}}',
                r"__metadata__: expected an object of strings, received \{'k': 1\}"),
    Case("loaders", "symlink-out-of-checkpoint", _escaping_link, CheckpointError,
         r"model.safetensors resolves to .*secret.safetensors, outside the checkpoint directory"),
    Case("loaders", "load-into-meta", lambda _: _load(_tiny_module(device="meta"),
                                                       {"w": torch.randn(4, 3), "b": torch.randn(4)}),
         WeightsMismatchError, r"w is on the meta device.*model.to_empty\(device=...\)"),
    Case("loaders", "int64-into-float",
         lambda _: _load(_tiny_module(), {"w": torch.ones(4, 3, dtype=torch.int64), "b": torch.randn(4)}),
         WeightsMismatchError, r"w: dtype torch.int64 holds integers or booleans, not weights: it cannot go "
                               r"into the parameter's torch.float32"),
    Case("loaders", "bool-into-float",
         lambda _: _load(_tiny_module(), {"w": torch.randn(4, 3), "b": torch.ones(4, dtype=torch.bool)}),
         WeightsMismatchError, r"b: dtype torch.bool holds integers or booleans"),
    Case("loaders", "truncated-after-header", _truncated_between, CheckpointError,
         r"model.safetensors: truncated after its header was read: tensor 'w' ends at byte \d+, the file now "
         r"holds \d+; nothing was loaded"),
    Case("loaders", "tied-head-after-to-empty", lambda _: _tied_after_to_empty(), WeightsMismatchError,
         r"lm_head.weight \(tied to an embedding, but no longer sharing its weight.*restore the tie"),
]

CASES = LAYER_CASES + ATTENTION_CASES + MODEL_CASES + LOADER_CASES


@pytest.mark.parametrize("case", CASES, ids=[f"{c.area}-{c.id}" for c in CASES])
def test_bad_input_is_refused_by_name_and_changes_nothing(case: Case, tmp_path: Path) -> None:
    attempt = case.make(tmp_path)
    before = _snapshot(attempt.watched)
    with pytest.raises(case.error, match=case.match):
        attempt.call()
    assert _unchanged(attempt.watched, before)


def test_every_area_has_cases() -> None:
    areas = {case.area for case in CASES}
    assert areas == {"layers", "attention", "models", "loaders"}
    assert len({case.id for case in CASES}) == len(CASES)
