"""tpkit.serving: continuous batching over the paged KV cache.

``Engine(model).generate(prompts, SamplingParams(max_new_tokens=...))`` runs many requests of different
lengths together: each step one model call over a mixed batch of decodes and prompt chunks, under a token
budget, requests admitted as KV blocks allow and preempted (computed again later) when they run out. For
streaming, ``add_request`` then ``step`` until ``has_unfinished_requests()`` is False.
"""

from tpkit.serving.engine import CPU_KV_CACHE_BYTES, Engine
from tpkit.serving.request import RequestOutput
from tpkit.serving.sampling import SamplingParams

__all__ = ["CPU_KV_CACHE_BYTES", "Engine", "RequestOutput", "SamplingParams"]
