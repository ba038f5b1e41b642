"""hla_fast: GPU (Triton) kernels for Higher-order Linear Attention.

Public API (``q, k: [B, T, H, K]``, ``v: [B, T, H, V]``, log-gates ``g: [B, T, H]``):
    hla2(q, k, v, *, gamma=None, g=None, normalize=False, eps=1e-6, initial_state=None,
         output_final_state=False, chunk_size=None, backend=None, config=None) -> (o, final_state)
    hla2_step(q, k, v, state=None, *, gamma=None, g=None, normalize=False, eps=1e-6,
              backend=None) -> (o, state)
    HLA2State(S, W, z)
    hla3(q, k, v, *, ...same keywords as hla2...) -> (o, final_state);  hla3_step(...) -> (o, state)
    HLA3State(S, P, F, p, f): masked third-order HLA
    ahla(q, k, v, *, ...same keywords as hla2...) -> (o, final_state);  ahla_step(...) -> (o, state)
    AHLAState(P, E, p, e): asymmetric HLA (first-order linear attention applied twice)
    ChunkConfig: the kernels' layout, chosen per call by ``hla2_config`` or passed as ``config``.
    context_parallel(op, q, k, v, *, group=None, ...op keywords...) -> (o, final_state): an
        operator on a sequence split over the ranks of a torch.distributed group (exact).
    Packed sequences: ``hla2 / ahla / hla3(..., cu_seqlens=)``, int32 offsets [N + 1] (B == 1).

The operators live in ``hla_fast.ops`` (one folder each, on the shared ``hla_fast.ops.common``).
``hla_fast.layers`` holds the token mixer built on them (``HigherOrderLinearAttention``, with its decode
cache ``HLACache``); ``hla_fast.ops.library`` registers the operators as ``torch.library`` custom ops
(namespace ``hla``) so that ``torch.compile`` sees them.
"""
import importlib.util

# `pip install hla` brings NumPy only (hla_ref's one dependency); hla_fast needs its extra
for _name in ("torch", "triton"):
    if importlib.util.find_spec(_name) is None:
        raise ModuleNotFoundError(f"hla_fast needs PyTorch and Triton, which `pip install hla` alone does not install "
                                  f"({_name} is missing): pip install 'hla[fast]' (hla_ref needs NumPy only)",
                                  name=_name)
del _name

from .ops.common.config import ChunkConfig
from .ops.ahla import AHLAState, ahla, ahla_step
from .ops.cp import context_parallel
from .ops.hla2 import HLA2State, hla2, hla2_step
from .ops.hla3 import HLA3State, hla3, hla3_step

__all__ = ["hla2", "hla2_step", "HLA2State", "ChunkConfig", "hla2_config", "ahla", "ahla_step", "AHLAState",
           "ahla_config"]

__all__ += ["context_parallel"]
__all__ += ["hla3", "hla3_step", "HLA3State", "hla3_config"]


def __getattr__(name):
    # hla2_config lives beside the kernels; importing it imports Triton, so only on first use
    if name == "hla2_config":
        from .ops.hla2.chunk import hla2_config

        return hla2_config
    if name == "ahla_config":
        from .ops.ahla.chunk import ahla_config

        return ahla_config
    if name == "hla3_config":
        from .ops.hla3.chunk import hla3_config

        return hla3_config
    raise AttributeError(f"module 'hla_fast' has no attribute {name!r}")
