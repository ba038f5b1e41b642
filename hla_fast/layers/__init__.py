"""Model layers on the hla_fast operators: the HLA token mixer and its decode cache.

    HigherOrderLinearAttention(hidden_size=1024, num_heads=8, head_dim=None, num_kv_heads=None,
                               order="hla2", gate="none", normalize=False, qk_norm="l2",
                               output_norm=True, layer_idx=None, backend=None, ...)
        forward(hidden_states [B, T, D], attention_mask=None, past_key_values=None, use_cache=False,
                cp_group=None) -> (o [B, T, D], None, past_key_values)
    HLACache: the per-layer recurrent states between calls (prefill, then decode steps).
"""
from .cache import HLACache
from .hla import HigherOrderLinearAttention

__all__ = ["HigherOrderLinearAttention", "HLACache"]
