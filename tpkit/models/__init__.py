"""tpkit.models: HuggingFace models built from tpkit's tensor-parallel layers, generating on a paged KV cache.

``from_pretrained(name_or_path)`` picks the class from config.json and loads this rank's shard;
``model(input_ids)`` gives logits; ``model.generate(prompts, max_new_tokens)`` generates for a ragged batch.
"""

from tpkit.models.auto import MODEL_CLASSES, from_pretrained, model_class
from tpkit.models.bart import BartForConditionalGeneration
from tpkit.models.gemma import GemmaForCausalLM
from tpkit.models.generation import PagedDecoderOnlyLM, PagedLM
from tpkit.models.gpt_bigcode import GPTBigCodeForCausalLM
from tpkit.models.llama import LlamaForCausalLM
from tpkit.ops import RMSNorm  # where Llama's norm lives; importable from here too

__all__ = [
    "MODEL_CLASSES",
    "BartForConditionalGeneration",
    "GPTBigCodeForCausalLM",
    "GemmaForCausalLM",
    "LlamaForCausalLM",
    "PagedDecoderOnlyLM",
    "PagedLM",
    "RMSNorm",
    "from_pretrained",
    "model_class",
]
