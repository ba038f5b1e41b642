"""The kernel configuration: one immutable value chosen once per call.

An operator's rule (e.g. ``hla_fast.ops.hla2.chunk.hla2_config``) picks a :class:`ChunkConfig` from
the shapes, dtype and device, citing the measurement behind each choice; a caller may pass one
explicitly instead (tests and benchmarks compare layouts that way). The autograd Function keeps it
on its context, so the backward runs with the configuration the forward was given.
"""
from __future__ import annotations

import dataclasses

_CHUNKS = (16, 32, 64, 128)
_WARPS = (1, 2, 4, 8, 16)
_STAGES = (1, 2, 3, 4)
# the fields that take one of a few ints, with their choices
_CHOICES = {"fwd_chunk": _CHUNKS, "bwd_chunk": _CHUNKS, "fwd_warps": _WARPS, "bwd_warps": _WARPS,
            "fwd_stages": _STAGES, "bwd_stages": _STAGES}
# rows per chunk when a call passes chunk_size=None: the torch backend's chunk, and what the
# kernels' rules start from (each rule says where a measured layout departs from it)
DEFAULT_CHUNK = 64


def chunk_or_default(chunk_size) -> int:
    """A call's ``chunk_size`` (an int, or None for the default), as rows per chunk."""
    return DEFAULT_CHUNK if chunk_size is None else chunk_size


def _power_of_two(name: str, x, least: int) -> None:
    """Refuse a config field ``name`` that is not an int power of two >= ``least`` (a bool is not)."""
    if isinstance(x, bool) or not isinstance(x, int) or x < least or x & (x - 1):
        raise ValueError(f"config.{name} must be a power of two >= {least}, got {x!r}")


@dataclasses.dataclass(frozen=True)
class ChunkConfig:
    """How the chunked kernels of one call are laid out. The result does not depend on it.

    fwd_chunk, bwd_chunk: rows per chunk in the forward and the backward (16, 32, 64 or 128).
    fwd_segments, bwd_segments: how many pieces of the sequence are walked in parallel (their
        summaries folded into each piece's start state first); 1 walks the whole sequence.
    fwd_warps, bwd_warps: warps per program.
    fwd_stages, bwd_stages: how deep the compiler pipelines the loads of the forward's kernels
        (its walks, their segment summaries) and of the backward's (Triton's ``num_stages``): with
        more than 1 a walk copies its next chunks' tiles into shared memory while it computes the
        current one, at the cost of that memory; 1 loads each chunk when its turn comes. Unlike
        ``*_prefetch`` the tiles wait in shared memory, not in registers. AHLA's layered backward
        (``bwd_layers``) pipelines by its own constants and takes only ``bwd_stages=1``.
    fwd_block_v: value columns per forward program (a power of two >= 16; the launch takes no
        fewer than the device's ``common.launch.min_value_block``, 64 on CUDA).
    grad_parts: launches of the per-chunk gradient kernel, each a mask of the gradients it
        stores (1 dq, 2 dk, 4 dv); together they must cover each exactly once.
    save_states: a forward that will be differentiated keeps its chunk-start states for the
        backward (memory held between the passes) instead of the backward recomputing them.
    bf16_snapshots: per-chunk snapshots the backward reads only as dot operands are stored in
        bf16 for bf16 inputs.
    bwd_pieces: the backward walks the sequence in this many pieces, the last first, and keeps
        the chunk-end state gradients of one piece at a time (a piece-sized buffer instead of
        one as large as the chunk states); the same launches, in smaller grids. Needs a backward
        walk of one segment (the wide heads'): a config with ``bwd_segments`` > 1 is refused. HLA2
        and AHLA, and HLA3's second stage on HLA2's fused kernels.
    fwd_prefetch, bwd_prefetch: the forward's walks (and its segment summaries), the backward's
        state walk (and its summaries), load the next chunk's tiles before computing the current
        one, so that their memory latency overlaps the products, at the cost of the registers
        holding them. AHLA; HLA2 and HLA3 take only False.
    bwd_layers: the backward runs as two first-order backwards, the outer layer (on the first
        order's output, which the forward then keeps) before the inner one, each a state-gradient
        walk split over key and value blocks and a per-chunk kernel, instead of one walk carrying
        both state gradients and one per-chunk kernel. Needs ``bwd_segments``, ``bwd_pieces`` of 1
        and no ``bwd_prefetch``. AHLA; HLA2 and HLA3 take only False.
    fwd_output_pass: the forward runs in two launches: a walk that only carries the state and
        stores every chunk's start state, then one program per chunk (and value block) computing
        the chunk's outputs from it, all chunks at once. The outputs are the one-walk forward's:
        the stored states are what its dots read. HLA2 (and HLA3's second stage); AHLA takes only
        False.
    fwd_row_blocks: with ``fwd_output_pass``, the state walk splits the key rows of S and W over
        this many programs a head and value block (a power of two; each block at least the device's
        narrowest key tile, ``common.launch.min_key_block``: 64 rows on CUDA, 16 under the
        interpreter), which never exchange data: row block a of the update reads rows a of the
        state and columns a of K^T only. 1 without ``fwd_output_pass``.
    fwd_two_walks: with ``fwd_output_pass``, the state walk is two walks: S alone (a first-order
        walk in blocks of S, storing every chunk's start S), then W (and z) alone, each chunk's
        update reading S from those stored states instead of carrying it, so that no program holds
        both states. The states are the one walk's. Needs ``fwd_segments`` of 1. False without
        ``fwd_output_pass``.
    fwd_output_block_v: with ``fwd_output_pass``, value columns per program of the output pass (a
        power of two >= 16, bounded as ``fwd_block_v`` is and, for keys up to 64 wide, at most 64,
        as the backward's value tiles are), or None for ``fwd_block_v``'s. Each output program
        reads its chunk's whole S and forms Q S0 whatever its value block, so wider blocks do that
        once for more columns. None without ``fwd_output_pass``.
    layers: both passes run the operator as first-order layers (gated linear attention, AHLA's
        single-layer forward walk and per-layer backward kernels): HLA2 as K' = LA(Q, K, K) with
        state S, then O = LA(Q, K', V) at twice the log-gates with state W (``hla2.chunk``). The
        forward fields then lay out each layer's walk as they do AHLA's (``fwd_prefetch`` too),
        the backward takes ``bwd_chunk`` and ``bwd_warps``. Needs no ``fwd_output_pass``,
        ``bwd_segments`` and ``bwd_pieces`` of 1, no ``bwd_prefetch`` and no ``bwd_layers``. HLA2,
        and HLA3's second stage (at three times the log-gates, ``hla3.chunk``); AHLA (whose
        ``bwd_layers`` is its own) takes only False.
    fwd_shared_walk: with ``layers``, HLA3's forward runs its two first-order layers on the same
        queries and keys, R = LA(Q, K, V) and K' = LA(Q, K, K), as one walk over the values
        [V | K]: each chunk's Q K^T and its reads of Q and K serve both (one program holds both
        when ``fwd_block_v`` covers V + K columns), and R's layer takes this config's layout
        (so ``hla3`` takes it as one ChunkConfig, not a pair). Needs ``layers``. HLA3 only.
    fwd_den_pass: with ``layers``, a normalized call's outer layer takes the state of its
        denominator LA(Q, K', 1) at every chunk's start, and q_t . z_c per token, from passes of
        their own parallel over chunks (``common/denominator.py``); its walk then carries no z and
        forms the denominator from those and its own scores. Needs ``layers``; changes nothing
        unnormalized. HLA2 only.
    bwd_den_pass: with ``layers``, a normalized call's outer layer takes the gradient of its
        denominator's state at every chunk's end from passes of their own (the same two passes run
        from the last chunk, ``common/denominator.py``); its state-gradient walk then carries dW
        alone. Needs ``layers``; changes nothing unnormalized. HLA2 only.
    """

    fwd_chunk: int = 64
    bwd_chunk: int = 64
    fwd_segments: int = 1
    bwd_segments: int = 1
    fwd_warps: int = 4
    bwd_warps: int = 4
    fwd_stages: int = 1
    bwd_stages: int = 1
    fwd_block_v: int = 64
    grad_parts: tuple = (1, 6)
    save_states: bool = True
    bf16_snapshots: bool = True
    bwd_pieces: int = 1
    fwd_prefetch: bool = False
    bwd_prefetch: bool = False
    bwd_layers: bool = False
    fwd_output_pass: bool = False
    fwd_row_blocks: int = 1
    fwd_two_walks: bool = False
    fwd_output_block_v: int | None = None
    layers: bool = False
    fwd_shared_walk: bool = False
    fwd_den_pass: bool = False
    bwd_den_pass: bool = False

    def __post_init__(self):
        for name, choices in _CHOICES.items():
            x = getattr(self, name)
            if type(x) is not int or x not in choices:
                raise ValueError(f"config.{name} must be one of {choices}, got {x!r}")
        for name in ("fwd_segments", "bwd_segments", "bwd_pieces"):
            x = getattr(self, name)
            if isinstance(x, bool) or not isinstance(x, int) or x < 1:
                raise ValueError(f"config.{name} must be an int >= 1, got {x!r}")
        if self.bwd_pieces > 1 and self.bwd_segments > 1:
            raise ValueError(f"config.bwd_pieces={self.bwd_pieces} needs config.bwd_segments=1 (a piece starts from "
                             f"the state gradient its successor ends with, which a segmented walk does not form), got "
                             f"bwd_segments={self.bwd_segments}")
        _power_of_two("fwd_block_v", self.fwd_block_v, 16)
        if self.fwd_output_block_v is not None:
            _power_of_two("fwd_output_block_v", self.fwd_output_block_v, 16)
        if self.fwd_output_block_v is not None and not self.fwd_output_pass:
            raise ValueError(f"config.fwd_output_block_v must be None without fwd_output_pass (there is no output "
                             f"pass), got {self.fwd_output_block_v}")
        parts = self.grad_parts
        if not isinstance(parts, tuple) or not parts or any(isinstance(m, bool) or not isinstance(m, int)
                                                            or not 1 <= m <= 7 for m in parts):
            raise ValueError(f"config.grad_parts must be a tuple of masks in 1..7, got {parts!r}")
        if sorted(b for m in parts for b in (1, 2, 4) if m & b) != [1, 2, 4]:
            raise ValueError(f"config.grad_parts must cover dq (1), dk (2) and dv (4) once each, got {parts!r}")
        for name in ("save_states", "bf16_snapshots", "fwd_prefetch", "bwd_prefetch", "bwd_layers", "fwd_output_pass",
                     "fwd_two_walks", "layers", "fwd_shared_walk", "fwd_den_pass", "bwd_den_pass"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"config.{name} must be True or False, got {getattr(self, name)!r}")
        rb = self.fwd_row_blocks
        _power_of_two("fwd_row_blocks", rb, 1)
        if rb > 1 and not self.fwd_output_pass:
            raise ValueError(f"config.fwd_row_blocks must be 1 without fwd_output_pass (a walk that computes "
                             f"outputs carries every key row), got {rb}")
        if self.fwd_two_walks and not self.fwd_output_pass:
            raise ValueError("config.fwd_two_walks must be False without fwd_output_pass (a walk that computes "
                             "outputs carries S itself), got True")
        if self.fwd_two_walks and self.fwd_segments != 1:
            raise ValueError(f"config.fwd_two_walks needs config.fwd_segments=1 (the two walks run whole "
                             f"sequences), got {self.fwd_segments}")
        for name in ("fwd_den_pass", "bwd_den_pass"):
            if getattr(self, name) and not self.layers:
                raise ValueError(f"config.{name} needs config.layers (it is how hla2's outer first-order layer forms "
                                 f"its denominator), got layers=False")
        if self.fwd_shared_walk and not self.layers:
            raise ValueError("config.fwd_shared_walk needs config.layers (it runs two of hla3's first-order layers in "
                             "one walk), got layers=False")
        if self.layers:
            clash = {name: getattr(self, name) for name, ok in (
                ("fwd_output_pass", False), ("bwd_segments", 1), ("bwd_pieces", 1), ("bwd_prefetch", False),
                ("bwd_layers", False)) if getattr(self, name) != ok}
            if clash:
                raise ValueError(f"config.layers needs fwd_output_pass=False, bwd_segments=1, bwd_pieces=1, "
                                 f"bwd_prefetch=False and bwd_layers=False (each layer's backward walks whole "
                                 f"sequences by its own kernels), got {clash}")

    @property
    def keeps_states(self) -> bool:
        """Whether a forward that will be differentiated keeps its chunk-start states for the
        backward: ``save_states`` and both passes in chunks of one size (states at other chunks
        would not serve the backward's)."""
        return self.save_states and self.fwd_chunk == self.bwd_chunk

    def replace(self, **changes) -> "ChunkConfig":
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)


def refuse_split_forward(cfg: ChunkConfig, op: str) -> None:
    """Refuse the fields only HLA2's forward takes (``fwd_output_pass``, ``fwd_row_blocks``,
    ``fwd_two_walks``, which needs the first) for an operator whose forward walk computes its
    outputs itself."""
    if cfg.fwd_output_pass or cfg.fwd_row_blocks != 1:
        raise ValueError(f"config.fwd_output_pass must be False and config.fwd_row_blocks 1 for {op} (its forward "
                         f"walk computes the outputs; hla2's may not), got {cfg.fwd_output_pass} and "
                         f"{cfg.fwd_row_blocks}")


def refuse_layers(cfg: ChunkConfig, op: str) -> None:
    """Refuse ``layers`` for an operator that does not run as first-order layers in both passes."""
    if cfg.layers:
        raise ValueError(f"config.layers must be False for {op} (only hla2 and hla3's second stage run as first-order "
                         f"layers in both passes; ahla's backward has bwd_layers), got True")


def refuse_shared_walk(cfg: ChunkConfig, op: str) -> None:
    """Refuse ``fwd_shared_walk`` for an operator whose layers do not share their queries and keys."""
    if cfg.fwd_shared_walk:
        raise ValueError(f"config.fwd_shared_walk must be False for {op} (its first-order layers read different keys; "
                         f"only hla3's R and K' share theirs), got True")


def refuse_den_pass(cfg: ChunkConfig, op: str) -> None:
    """Refuse ``fwd_den_pass`` and ``bwd_den_pass`` for an operator whose normalized calls do not
    run HLA2's outer layer."""
    for name in ("fwd_den_pass", "bwd_den_pass"):
        if getattr(cfg, name):
            raise ValueError(f"config.{name} must be False for {op} (only hla2's normalized outer layer takes its "
                             f"denominator from passes of its own), got True")


def refuse_ahla_fields(cfg: ChunkConfig, op: str) -> None:
    """Refuse the fields only AHLA's kernels take for another operator: ``fwd_prefetch`` /
    ``bwd_prefetch`` (its walks do not load ahead) and ``bwd_layers`` (its backward is not two
    first-order ones)."""
    if cfg.fwd_prefetch or cfg.bwd_prefetch:
        raise ValueError(f"config.fwd_prefetch and config.bwd_prefetch must be False for {op} (its walks do not load "
                         f"ahead; ahla's do), got {cfg.fwd_prefetch} and {cfg.bwd_prefetch}")
    if cfg.bwd_layers:
        raise ValueError(f"config.bwd_layers must be False for {op} (its backward is not two first-order layers; "
                         f"ahla's is), got True")
