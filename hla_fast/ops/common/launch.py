"""Host-side launch arithmetic shared by every operator: block sizes, grid splits, occupancy.

Nothing here touches a kernel; it turns shapes and a device into the integers a launch needs.
"""
from __future__ import annotations

import functools
import os

import torch


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for positive ints. (``triton.cdiv`` is a jit function: calling it from Python
    goes through the JIT's dispatch and costs microseconds per call on the host.)"""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (n >= 1), without the JIT dispatch of ``triton.next_power_of_2``."""
    return 1 << (n - 1).bit_length()


def pow2_block(n: int, lo: int = 16) -> int:
    """Tile width for n features: a power of two, at least ``lo`` (``tl.dot`` needs 16)."""
    return max(lo, next_pow2(n))


def interpreter_on() -> bool:
    """True when Triton runs kernels on the CPU (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def min_value_block(device: torch.device) -> int:
    """Narrowest value block on ``device``: 64 on CUDA (a 32-wide value block hit an illegal
    memory address on an H200 with Triton 3.6, see hla_fast/README.md; AHLA's forward did so
    whenever its value block was narrower than its chunk), 16 under the interpreter."""
    return 64 if device.type == "cuda" else 16


def value_block(V: int, block_v: int, device: torch.device) -> int:
    """A forward program's value block for V columns and ``config.fwd_block_v``: at most
    ``block_v`` wide (and no wider than V's tile) but never below ``min_value_block``, so a narrower
    request on CUDA runs 64-wide blocks instead of the layout that crashed there (the result does
    not depend on the block)."""
    lo = min_value_block(device)
    return min(pow2_block(V, lo), max(block_v, lo))


def min_key_block(device: torch.device) -> int:
    """Narrowest key tile on ``device``: 64 on CUDA (a first forward + backward at K = 32 in bf16,
    on 32-wide key tiles, hit an illegal memory access on an H200 with Triton 3.6; narrower keys are
    masked into a 64-wide tile, whose zeros cost time but no accuracy), 16 under the interpreter."""
    return 64 if device.type == "cuda" else 16


def bf16_dots(dtype: torch.dtype) -> bool:
    """Whether the dots take bf16 operands: for bf16 inputs, except under the interpreter (whose
    bf16 dot is unreliable, so its tiles are widened to fp32). fp16 inputs are widened to fp32 in
    the kernels: an fp16 operand cannot hold a growing state."""
    return dtype == torch.bfloat16 and not interpreter_on()


def snapshot_dtype(cfg, dtype: torch.dtype) -> torch.dtype:
    """dtype of the per-chunk state snapshots a backward reads as dot operands: bf16 where the dots
    take bf16 operands and ``cfg.bf16_snapshots`` (a ChunkConfig) allows it, else fp32."""
    return torch.bfloat16 if (cfg.bf16_snapshots and bf16_dots(dtype)) else torch.float32


def fp32_tiles(dtype: torch.dtype) -> bool:
    """Whether the kernels widen inputs of ``dtype`` to fp32 tiles on every device: fp32 and fp16
    (not bf16, whose tiles are bf16 on a GPU). The rules give both the same layouts and the dots the
    same precision (``dot_precision``), so that fp16 inputs run the fp32 kernels the GPU tests and
    the shared-memory checks cover."""
    return dtype != torch.bfloat16


def dot_precision(dtype: torch.dtype) -> str:
    """``tl.dot`` input precision: the tensor cores' bf16 path for bf16 inputs (the argument is
    ignored for bf16 operands); for fp32 tiles (fp32 and fp16 inputs, ``fp32_tiles``) ``tf32x3`` on
    a GPU (three tf32 products, error at fp32's level, compiled as tensor-core code) and exact
    ``ieee`` products under the interpreter. Single tf32 products of fp32 tiles would round every
    operand to 10 bits of mantissa, below fp16's 11, and the compiler stages both operands of every
    such dot in shared memory: by an sm_90 compile HLA2's gradient kernel at K = V = 128 then asked
    for 307 KB, past Hopper's 227 KB (hla_fast/README.md, "fp16 inputs")."""
    if not fp32_tiles(dtype):
        return "tf32"
    return "ieee" if interpreter_on() else "tf32x3"


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """Multiprocessors of a CUDA device (looked up once per device)."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    return _sm_count(idx)


def one_wave_segments(n_programs: int, n_chunks: int, device: torch.device, per_sm: int,
                      min_chunks: int) -> int:
    """Most segments that keep ``n_programs * segments`` within one wave of ``per_sm`` programs a
    multiprocessor, each at least ``min_chunks`` chunks long; 1 off CUDA. (A partial second wave
    costs a whole program's length.)"""
    if device.type != "cuda":
        return 1
    return max(1, min((per_sm * sm_count(device)) // n_programs, n_chunks // min_chunks))


# longest forward chunk the rules give inputs whose tiles are fp32 (fp32 and fp16 inputs), past
# which Hopper's 227 KB of shared memory do not hold the walk: by an sm_90 compile HLA2's forward walk
# on chunks of 128 at K = 16 takes more than that, fp32 and fp16 alike (benchmarks/results/
# compile_hla2_fp32_chunk128_cpu.md, compile_hla2_fp16_chunk128_cpu.md; an H200 refused third
# order's launch of it), and AHLA's segment summary of fp32 chunks of 128 asked an H200 for more
# (test_ahla_kernels.py::test_chunks_of_128_scale_the_rows)
FP32_MAX_CHUNK = 64


def tile_chunk(chunk_size: int, dtype: torch.dtype) -> int:
    """``chunk_size`` as a forward walk can take it: bf16 inputs as asked, fp32 and fp16 inputs (fp32
    tiles) at most FP32_MAX_CHUNK."""
    return chunk_size if dtype == torch.bfloat16 else min(chunk_size, FP32_MAX_CHUNK)

# pieces of a one-segment backward walk in the rules, and the fewest chunks worth cutting (a piece
# adds a walk launch and the gradient launches; below some 256 chunks the buffer it saves is small)
BWD_PIECES = 4
BWD_PIECES_MIN_CHUNKS = 256


def rule_pieces(wide: bool, bwd_segments: int, n_chunks: int) -> int:
    """The rules' ``bwd_pieces``: BWD_PIECES for heads wider than 64 whose backward walk is one
    segment over at least BWD_PIECES_MIN_CHUNKS chunks (there the chunk-end state gradients are
    as large as the chunk states), else 1."""
    return BWD_PIECES if (wide and bwd_segments == 1 and n_chunks >= BWD_PIECES_MIN_CHUNKS) else 1


def backward_pieces(n_chunks: int, pieces: int):
    """(starts, per): the first chunk of each piece of a backward walked in ``pieces`` pieces, the
    last piece first, and the chunks per piece (the last may be shorter; no piece is empty)."""
    per = cdiv(n_chunks, max(1, min(int(pieces), n_chunks)))
    return list(range(0, n_chunks, per))[::-1], per


def run_pieces(starts, per: int, n_chunks: int, de, dh0, pair, step):
    """Run a backward in pieces, the last first: ``step(c0, n, de, dh0)`` launches the walk of the
    n chunks from c0, starting from the end gradient ``de`` and leaving the gradient at c0 in
    ``dh0``, then the per-chunk gradients of those chunks. de, dh0: the whole sequence's end
    gradient and where its start gradient goes (pairs of tensors, or (None, None): zero, nowhere).
    ``pair(zero)`` allocates a pair of fp32 state-gradient buffers. With several pieces every walk
    gets an end gradient (zeros in) and leaves a start gradient (scratch out), so all of them are
    one specialization of the kernel: one compile."""
    carries = []
    if len(starts) > 1:
        carries = [pair(False), pair(False)]
        if de[0] is None:
            de = pair(True)
    for n, c0 in enumerate(starts):
        out = dh0 if (c0 == 0 and (dh0[0] is not None or not carries)) else carries[n % 2]
        step(c0, min(per, n_chunks - c0), de, out)
        de = out


def even_blocks(n: int, width: int):
    """Bounds (start, stop) cutting range(n) into the fewest blocks at most ``width`` long, as even
    as possible."""
    parts = cdiv(n, width)
    edges = [round(i * n / parts) for i in range(parts + 1)]
    return list(zip(edges[:-1], edges[1:]))


def split_segments(n_chunks: int, segments: int):
    """(chunks per segment, segments) for ``segments`` asked, with no empty segment."""
    segments = max(1, min(int(segments), n_chunks))
    per = cdiv(n_chunks, segments)
    return per, cdiv(n_chunks, per)
