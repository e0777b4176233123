"""Cross-attention q/k/v projection that computes only what cross-attention uses.

Cross-attention takes q from the decoder and k, v from the encoder. A :class:`QKVParallelLinear` applied to
both computes q, k and v for each and throws two thirds away. :class:`QKVCrossParallelLinear` holds the
very same parameters (names, shapes, weight loaders: a drop-in for checkpoints and
``stacked_params_mapping``) and multiplies the decoder states by the q rows of the weight only and the
encoder states by the k, v rows only: row slices of the one weight, views, nothing copied (a quantization
method takes the same row ranges).
"""

from __future__ import annotations

import torch

from .qkv import QKVParallelLinear

_Biases = tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]
_QKV = tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]


class QKVCrossParallelLinear(QKVParallelLinear):
    """:class:`QKVParallelLinear` for cross-attention: ``forward(decoder_hidden_states,
    encoder_hidden_states=None) -> (q, k, v)``.

    q is ``[..., num_heads * head_size]`` from the decoder states; k and v are ``[..., num_kv_heads *
    head_size]`` from the encoder states, or None when ``encoder_hidden_states`` is None (decode steps once
    the cross-attention K/V are cached). The constructor, the KV-head split/replication rules, the
    parameters and their loaders are those of :class:`QKVParallelLinear`.

    With ``skip_bias_add=True`` the biases are not added and come back beside the outputs:
    ``((q, k, v), (q_bias, k_bias, v_bias))``, each bias this rank's slice (a view) matching its output, None
    where the output is None or the layer has no bias.
    """

    def _split_bias(self) -> _Biases:
        if self.bias is None:
            return None, None, None
        q_bias, k_bias, v_bias = self.bias.split([self.q_size, self.kv_size, self.kv_size])
        return q_bias, k_bias, v_bias

    def forward(
        self, decoder_hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None = None
    ) -> _QKV | tuple[_QKV, _Biases]:
        # decoder [..., hidden_size] -> q [..., q_size]; encoder [..., hidden_size] -> k, v [..., kv_size]
        q_bias, k_bias, v_bias = self._split_bias()
        add_bias = not self.skip_bias_add
        decoder_hidden_states = self._input_region(decoder_hidden_states)
        q = self._product(decoder_hidden_states, q_bias if add_bias else None, slice(0, self.q_size))
        k = v = None
        if encoder_hidden_states is not None:
            encoder_hidden_states = self._input_region(encoder_hidden_states)
            kv_bias = None if self.bias is None or not add_bias else self.bias[self.q_size:]
            kv = self._product(encoder_hidden_states, kv_bias, slice(self.q_size, None))
            k, v = kv.split([self.kv_size, self.kv_size], -1)
        if add_bias:
            return q, k, v
        if k is None:
            k_bias = v_bias = None
        return (q, k, v), (q_bias, k_bias, v_bias)
