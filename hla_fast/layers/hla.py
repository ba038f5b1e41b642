"""HigherOrderLinearAttention: a token mixer built on the HLA operators.

The layer follows flash-linear-attention's layer conventions: projections ``q_proj``, ``k_proj``,
``v_proj`` (and ``g_proj`` for data-dependent gates) from the hidden states [B, T, D] to heads
[B, T, H, K] / [B, T, H, V], the operator, a per-head output norm, ``o_proj`` back to [B, T, D], and
``forward(hidden_states, past_key_values=None, use_cache=False) -> (o, None, past_key_values)``.

What the projections feed. For second order (``order="hla2"``, the masked HLA2 of
``hla_fast.hla2``), with b_t the running sum of log-gates:

    o_t = sum_{i <= j <= t} exp(2 b_t - b_i - b_j) (q_t . k_i)(q_j . k_i) v_j

i.e. the query is matched against the keys through the key second moment S_t = sum k_i k_i^T, and
the values are weighted by a second query-key product, so the state is a K x K matrix S plus a
K x V matrix W per head (``HLA2State``) instead of first-order linear attention's single K x V
matrix. ``order="ahla"`` (asymmetric, states P, E of K x V) and ``order="hla3"`` (third order,
states S, P, F) are the other operators of ``hla_fast``; each has the same call signature.

Where the state lives. A full-sequence call (training, prefill) runs the chunked operator; with
``use_cache=True`` its final state is stored in an :class:`~hla_fast.layers.HLACache` under the
layer's ``layer_idx``. A call of one token with a cached state runs the decode step
``hla_fast.<order>_step``, O(K^2 + K V) per head and token, which reads the state and stores the
next one. Any mix of chunk calls (with ``initial_state``) and steps gives the outputs of one call
over all tokens.

Grouped key/value heads (``num_kv_heads < num_heads``). Keys and values are projected to
``num_kv_heads`` heads and shared by the ``num_heads // num_kv_heads`` query heads of a group, so the
key second moment S^K_t = sum k_i k_i^T (which depends only on the keys) is the same for every
head of a group, as long as the group's heads decay alike (no decay; per-head or per-token gates
decay each head's S at its own rate). The operators take one key per query head, so the shared keys
and values are repeated over the group: the group's heads compute their S parts separately (the
layer's parameters and projection cost shrink; the state memory does not).

Decay (``gate``): "none"; "fixed", one constant factor gamma_h per head (log-gates log(gamma_h) on
every token), spaced so that 1 - gamma_h runs geometrically from 2^-5 to 2^-10 over the heads
(memories of roughly 32 to 1024 tokens); "data", per-token gates
g = logsigmoid(g_proj(x)) / gate_logit_normalizer of shape [B, T, H] (flash-linear-attention's gated
linear attention convention), so the model chooses per token how much to forget.

Keeping the states in range. Without decay the HLA2 output is a sum over O(t^2) index pairs, so
its size grows with the position t; the states are fp32 (even for bf16 inputs), so overflow is far,
but the output's scale drifts with t, which the next layer sees. fp16 is the exception: the
operator returns its output in the inputs' dtype, and without decay fp16's largest value (65504)
is passed within 640 to 14624 tokens by order and q/k norm (a fresh 64-wide layer at the defaults:
token 1764 for hla3, 10987 for hla2; ``benchmarks/results/fp16_range_cpu.md``), while a decay (``gate="fixed"``
or ``"data"``) kept all 16384 tokens finite: in fp16, use a gate, or bf16. The layer offers: ``qk_norm="l2"``
(unit-norm q and k per head: every q . k in [-1, 1]; otherwise q and k are each scaled by K^-1/4 so
q . k carries softmax attention's 1/sqrt(K)), ``output_norm=True`` (an RMS norm over each head's
V outputs, with a learned scale, as flash-linear-attention's layers do), and ``normalize=True``
(the operator's own denominator, a signed sum that can cross zero). The defaults, l2 q/k norm and
the output norm with ``normalize=False``, were chosen by measurement: ``python benchmarks/mqar.py
--state-range`` (output RMS against position over 4096 tokens, the largest state entry, and the MQAR
smoke accuracy for each combination; recorded in benchmarks/results/mqar_state_range_cpu.json and
discussed in hla_fast/README.md, "The layer").

Context parallelism (``forward(..., cp_group=group)``). With a ``torch.distributed`` process group
(``torch.distributed.group.WORLD`` for the default one), this rank's ``hidden_states`` are its
contiguous slice of the sequence (slices in rank order) and the operator call goes through
``hla_fast.context_parallel(self.order, q, k, v, group=cp_group, ...)`` with the layer's gates,
normalize, eps, chunk_size and backend; projections, norms and gates are per token, so every rank's
output is its slice of the single-process layer's output on the whole sequence. Every rank must run
backward, and the gradients of the (replicated) parameters are this rank's share: summed over the
group (as a data-parallel all-reduce does) they are the single-process gradients. The group is a
``forward`` argument, not a constructor one, because it is a runtime object of the training setup
(not a property of the weights): the same module can run with or without context parallelism, and
it stays deep-copyable and picklable. A cache (``past_key_values``, ``use_cache=True``) and
decode steps are refused with ``cp_group`` (the state would be the global one, held on every rank),
and so is ``torch.compile`` tracing (the autograd-aware all-gather is not traced): compile the
projections around it or run the layer eagerly.

Backends. ``backend=None`` lets the operator choose (Triton kernels for CUDA tensors, the torch
chunk form otherwise). Under ``torch.compile`` the layer calls the operators through their
``torch.library`` custom ops (``hla_fast.ops.library``), which the compiler treats as single nodes
with known output shapes; in eager mode it calls them directly.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..ops import library
from ..ops.common.autograd import autograd_records
from ..ops.common.checks import MAX_DIM, check_eps, check_finite_float
from .cache import HLACache

GATES = ("none", "fixed", "data")
QK_NORMS = ("l2", None)


def _fp32_or_wider(x):
    """x in fp32, or as it is when float64 (the float64 path stays exact to rounding)."""
    return x if x.dtype == torch.float64 else x.float()


def _rms_norm(x, weight, eps):
    """RMS norm over the last dim in fp32 (float64 kept), returned in x's dtype. x: [..., V]; weight: [V]."""
    xf = _fp32_or_wider(x)
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.to(xf.dtype)
    return y.to(x.dtype)


def fixed_log_decays(num_heads: int) -> torch.Tensor:
    """log(gamma_h) [H], float64 on the CPU, with 1 - gamma_h = 2^-(5 + 5 h / (H - 1)): geometric
    from 2^-5 to 2^-10 (2^-5 for a single head)."""
    if num_heads > 1:
        e = torch.linspace(5.0, 10.0, num_heads, dtype=torch.float64)
    else:
        e = torch.tensor([5.0], dtype=torch.float64)
    return torch.log1p(-torch.pow(2.0, -e))


def _positive_int(x, name):
    if isinstance(x, bool) or not isinstance(x, int) or x < 1:
        raise ValueError(f"{name} must be an int >= 1, got {x!r}")
    return x


class HigherOrderLinearAttention(nn.Module):
    """Higher-order linear attention token mixer (see the module docstring).

    Args:
        hidden_size: D, width of the hidden states.
        num_heads: H, query heads.
        head_dim: K = V, width of one head (default hidden_size // num_heads).
        num_kv_heads: key/value heads (default num_heads); must divide num_heads.
        order: "hla2", "ahla" or "hla3".
        gate: "none", "fixed" (per-head constant decay) or "data" (per-token gates from g_proj).
        normalize: use the operator's denominator (bool).
        qk_norm: "l2" (unit-norm q, k per head) or None (q, k scaled by K^-1/4 each).
        output_norm: RMS norm over each head's outputs before o_proj.
        gate_logit_normalizer: divisor of logsigmoid(g_proj(x)) for gate="data".
        gate_bias_init: initial bias of g_proj: 3.0 starts every token's factor near
            exp(logsigmoid(3) / 16) = 0.997 (a memory of some hundreds of tokens), so a model
            starts out remembering and learns where to forget.
        chunk_size: chunk rows of the chunked operator (None: the operator's default).
        eps: the operator's eps (normalize=True); norm_eps: the output norm's eps.
        layer_idx: this layer's slot in an HLACache (needed with a cache).
        backend: None (by device), "triton" or "torch".
    """

    def __init__(self, hidden_size: int = 1024, num_heads: int = 8, head_dim: int | None = None,
                 num_kv_heads: int | None = None, order: str = "hla2", gate: str = "none",
                 normalize: bool = False, qk_norm: str | None = "l2", output_norm: bool = True,
                 gate_logit_normalizer: float = 16.0, gate_bias_init: float = 3.0, chunk_size: int | None = None,
                 eps: float = 1e-6, norm_eps: float = 1e-5, layer_idx: int | None = None,
                 backend: str | None = None):
        super().__init__()
        _positive_int(hidden_size, "hidden_size")
        _positive_int(num_heads, "num_heads")
        if head_dim is None:
            if hidden_size % num_heads:
                raise ValueError(f"hidden_size {hidden_size} is not divisible by num_heads {num_heads}: pass head_dim")
            head_dim = hidden_size // num_heads
        _positive_int(head_dim, "head_dim")
        if head_dim > MAX_DIM:
            raise ValueError(f"head_dim must be at most {MAX_DIM} (the operators' widest head), got {head_dim}")
        num_kv_heads = num_heads if num_kv_heads is None else _positive_int(num_kv_heads, "num_kv_heads")
        if num_heads % num_kv_heads:
            raise ValueError(f"num_kv_heads {num_kv_heads} must divide num_heads {num_heads}")
        library.check_order(order)
        if gate not in GATES:
            raise ValueError(f"gate must be one of {GATES}, got {gate!r}")
        if not isinstance(normalize, bool):
            raise TypeError(f"normalize must be True or False, got {normalize!r}")
        if qk_norm not in QK_NORMS:
            raise ValueError(f"qk_norm must be 'l2' or None, got {qk_norm!r}")
        if not isinstance(output_norm, bool):
            raise TypeError(f"output_norm must be True or False, got {output_norm!r}")
        gate_logit_normalizer = check_finite_float(gate_logit_normalizer, "gate_logit_normalizer", above=0)
        gate_bias_init = check_finite_float(gate_bias_init, "gate_bias_init")
        if chunk_size is not None:   # the operator checks what its backend takes (triton: 16 to 128)
            _positive_int(chunk_size, "chunk_size")
        eps = check_eps(eps)
        norm_eps = check_finite_float(norm_eps, "norm_eps", above=0)
        if layer_idx is not None and (isinstance(layer_idx, bool) or not isinstance(layer_idx, int) or layer_idx < 0):
            raise ValueError(f"layer_idx must be None or an int >= 0, got {layer_idx!r}")
        if backend not in (None, "triton", "torch"):
            raise ValueError(f"backend must be None, 'triton' or 'torch', got {backend!r}")
        library.resolve(order)  # a clear error now if the operator is not installed

        self.hidden_size, self.num_heads, self.head_dim = hidden_size, num_heads, head_dim
        self.num_kv_heads, self.num_kv_groups = num_kv_heads, num_heads // num_kv_heads
        self.order, self.gate, self.normalize = order, gate, normalize
        self.qk_norm, self.output_norm = qk_norm, output_norm
        self.gate_logit_normalizer = gate_logit_normalizer
        self.chunk_size, self.eps, self.norm_eps = chunk_size, eps, norm_eps
        self.layer_idx, self.backend = layer_idx, backend

        self.q_proj = nn.Linear(hidden_size, num_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=False)
        self.g_proj = nn.Linear(hidden_size, num_heads, bias=True) if gate == "data" else None
        if self.g_proj is not None:
            nn.init.constant_(self.g_proj.bias, gate_bias_init)
        # gate="fixed": the log-decays by (device, dtype), made from num_heads when first asked for
        # (``_fixed_gates``); not a buffer, which would follow the module's dtype casts (bf16
        # included) and hold no values when the module is built on the meta device
        self._fixed = {}
        self.o_norm_weight = nn.Parameter(torch.ones(head_dim)) if output_norm else None
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=False)

    @property
    def log_decay(self):
        """gate="fixed": log(gamma_h) [H] (float64, ``fixed_log_decays``); else None."""
        return fixed_log_decays(self.num_heads) if self.gate == "fixed" else None

    def _fixed_gates(self, x):
        """gate="fixed": log(gamma_h) [H] on x's device in the gates' dtype (fp32, float64 for
        float64 hidden states), copied there once (a host copy on every call would wait for the GPU)."""
        dtype = _fp32_or_wider(x).dtype
        g = self._fixed.get((x.device, dtype))
        if g is None:
            g = fixed_log_decays(self.num_heads).to(device=x.device, dtype=dtype)
            if not torch.compiler.is_compiling():
                self._fixed[(x.device, dtype)] = g
        return g

    def extra_repr(self) -> str:
        return (f"order={self.order!r}, heads={self.num_heads}, kv_heads={self.num_kv_heads}, "
                f"head_dim={self.head_dim}, gate={self.gate!r}, qk_norm={self.qk_norm!r}, "
                f"output_norm={self.output_norm}, normalize={self.normalize}")

    def _heads(self, x):
        """q, k [B, T, H, K], v [B, T, H, V], g [B, T, H] or None from hidden states [B, T, D]."""
        B, T, _ = x.shape
        H, K = self.num_heads, self.head_dim
        q = self.q_proj(x).view(B, T, H, K)
        k = self.k_proj(x).view(B, T, self.num_kv_heads, K)
        v = self.v_proj(x).view(B, T, self.num_kv_heads, K)
        if self.qk_norm == "l2":
            # in fp32 (float64 kept): fp16 rounds the norm's eps (1e-12) to 0, and a zero vector
            # (an all-zero hidden state) then gives 0/0 = NaN, which the states carry to every
            # later token; back in the projections' dtype, which v has too (the operators take
            # one dtype for q, k, v; CUDA autocast would otherwise promote q and k)
            q, k = (F.normalize(_fp32_or_wider(x), dim=-1).to(v.dtype) for x in (q, k))
        else:
            s = K ** -0.25
            q, k = q * s, k * s
        if self.num_kv_groups > 1:  # every query head of a group reads its group's keys and values
            k = k.repeat_interleave(self.num_kv_groups, dim=2)
            v = v.repeat_interleave(self.num_kv_groups, dim=2)
        g = None
        if self.gate == "data":
            g = F.logsigmoid(_fp32_or_wider(self.g_proj(x))) / self.gate_logit_normalizer
        elif self.gate == "fixed":
            g = self._fixed_gates(x)[None, None, :].expand(B, T, H)
        return q, k, v, g

    def forward(self, hidden_states: torch.Tensor, attention_mask=None, past_key_values: HLACache | None = None,
                use_cache: bool = False, cp_group=None, **kwargs):
        """hidden_states [B, T, D] -> (o [B, T, D], None, past_key_values).

        ``cp_group``: None (one process), or a ``torch.distributed`` process group
        (``torch.distributed.group.WORLD`` for the default group) over which the sequence is split
        for context parallelism: ``hidden_states`` is this rank's contiguous slice (see the module
        docstring). Not with a cache, ``use_cache`` or under ``torch.compile``.

        ``past_key_values``: an HLACache or None. With a cache holding this layer's state, the call
        continues from it; with ``use_cache=True`` the state after the call is stored (an empty cache
        is created when none is passed). ``attention_mask`` must be None (padding is not supported:
        a padded token would enter the state). Other keyword arguments are refused."""
        if kwargs:
            raise TypeError(f"unexpected keyword arguments {sorted(kwargs)}")
        x = hidden_states
        if not isinstance(x, torch.Tensor) or x.dim() != 3 or x.shape[-1] != self.hidden_size:
            got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"hidden_states must have shape [B, T, {self.hidden_size}], got {got}")
        if attention_mask is not None:
            raise ValueError("attention_mask is not supported by HigherOrderLinearAttention: pass None "
                             "(sequences without padding)")
        if not isinstance(use_cache, bool):
            raise TypeError(f"use_cache must be True or False, got {use_cache!r}")
        if past_key_values is not None and not isinstance(past_key_values, HLACache):
            raise TypeError(f"past_key_values must be an HLACache or None, got {type(past_key_values).__name__}")
        if cp_group is not None:
            if isinstance(cp_group, (bool, int, str)):
                raise TypeError(f"cp_group must be None or a torch.distributed process group, got {cp_group!r}")
            if use_cache or past_key_values is not None:
                raise ValueError("cp_group (context parallelism) cannot be combined with past_key_values or "
                                 "use_cache=True: a cache and decode steps run in one process")
            if torch.compiler.is_compiling():
                raise RuntimeError("cp_group (context parallelism) is not supported under torch.compile: "
                                   "run the layer eagerly (or compile around it)")
        if use_cache and past_key_values is None:
            past_key_values = HLACache()
        if past_key_values is not None and self.layer_idx is None:
            raise ValueError("a cache needs the layer's slot: construct the layer with layer_idx")

        B, T, _ = hidden_states.shape
        q, k, v, g = self._heads(hidden_states)
        state = past_key_values[self.layer_idx] if past_key_values is not None else None
        compiling = torch.compiler.is_compiling()
        kw = dict(gamma=None, g=None, normalize=self.normalize, eps=self.eps, backend=self.backend)
        if cp_group is not None:
            from ..ops.cp import context_parallel
            o, _ = context_parallel(self.order, q, k, v, group=cp_group, g=g, normalize=self.normalize,
                                    eps=self.eps, chunk_size=self.chunk_size, backend=self.backend)
            new = None
        elif T == 1 and (state is not None or use_cache) and not (
                compiling and autograd_records(q, k, v, g, *(state or ()))):
            # one decode step; traced while autograd records, the token runs as a chunk call
            # instead (same output and state), since the step op has no autograd formula
            kw["g"] = None if g is None else g[:, 0]
            if compiling:
                o, new = library.stepped(self.order, q[:, 0], k[:, 0], v[:, 0], state, **kw)
            else:
                o, new = library.resolve(self.order)[1](q[:, 0], k[:, 0], v[:, 0], state, **kw)
            o = o[:, None]
        else:
            kw.update(g=g, initial_state=state, output_final_state=use_cache, chunk_size=self.chunk_size)
            if compiling:
                o, new = library.chunked(self.order, q, k, v, **kw)
            else:
                o, new = library.resolve(self.order)[0](q, k, v, **kw)
        if use_cache:
            past_key_values.update(self.layer_idx, new, T)
        if self.output_norm:
            o = _rms_norm(o, self.o_norm_weight, self.norm_eps)
        o = self.o_proj(o.reshape(B, T, self.num_heads * self.head_dim))
        return o, None, past_key_values

