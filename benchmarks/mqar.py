"""MQAR: does higher order help a small model recall? Zoology's multi-query associative recall grid.

The task (Arora, Eyuboglu et al., "Zoology", multi-query associative recall). A sequence of
``seq_len`` tokens from a vocabulary of ``vocab`` begins with ``kv`` key-value pairs
(k_1 v_1 k_2 v_2 ...): keys drawn without replacement from the lower half of the vocabulary
(token 0 excluded), values without replacement from the upper half. The rest of the sequence holds
every key once more, as a query, at position 2 kv + 2 gap_i, where the gaps are drawn without
replacement from {0, ..., (seq_len - 2 kv) / 2 - 1} with probability proportional to
a * (gap + 1)^(a - 1), a = 0.01 (a power law: most queries come soon after the pairs, some late).
Every other position holds a random token of the whole vocabulary. The label of a query position
is the value paired with its key; every other label is -100 (ignored): the loss and the accuracy
count answer positions only. Test sequences come from another seed than training sequences.

The model, the same around every mixer: token embedding; 2 blocks of RMS norm -> short causal
depthwise convolution (width 4) -> mixer -> residual, each followed by RMS norm -> MLP (x4, GELU)
-> residual unless ``--no-mlp``; final RMS norm; LM head, tied to the embedding as in Zoology
(``--no-tie``: a head of its own). There is no position embedding: the short convolution lets a
layer see the previous tokens, which binds each value to the key before it (``--conv 0`` removes
it). The head runs at the answer positions only, the only positions the loss and the accuracy
count.

Mixers: ``attention`` (causal softmax attention, torch SDPA), ``linear`` (first-order linear
attention o_t = sum_{i <= t} (q_t . k_i) v_i: the torch chunk form below, or with
``--linear-impl fla`` flash-linear-attention's ``chunk_linear_attn`` on CUDA, which autotunes for
about a minute per process), ``hla2``, ``ahla``, ``hla3`` (the
``HigherOrderLinearAttention`` layer without decay) and ``hla2_gated`` (HLA2 with data-dependent
gates). Every linear mixer uses the layer's defaults: unit-norm q and k per head and an RMS norm
over each head's output. Heads are ``head_dim`` (64) wide for every d_model (d_model / 64 of them),
so the Triton kernels keep one tile shape across the grid and compile few variants.

Training: AdamW (weight decay 0.1, betas 0.9 / 0.98; fused on CUDA), linear warm-up over the first
10% of steps then cosine decay to 0, gradient norm clipped at 1, bf16 autocast on CUDA, a fixed
seed per run (model init and batch order), the same data for every mixer. Each task has its own
number of optimizer steps and batch size (``REGIME``; ``--steps``, ``--batch-size`` override it
for every task); the training set holds steps x batch size sequences, so every step sees new
ones (``--train-examples`` fixes its size instead, and the batches go round it in epochs). Zoology's
figure-2 sweep trains each configuration for up to 64 epochs of 100k sequences (batches of 512 up
to 128 tokens, 256 at 256; learning rates 1e-4 .. 1e-2) and stops at 99% accuracy; a grid of 180
runs in minutes of one GPU affords about 200 steps a run. The tied head, new sequences at every
step and a high learning rate make that enough for softmax attention on the shortest task (on an
H200: 0.96-1.00 at (64, 4), 0.05-0.35 at (128, 8), chance on the tasks of 256 tokens); the linear
mixers learn recall more slowly, so at this budget a cell measures how far a mixer gets in a fixed
number of steps, not the capacity it would reach with Zoology's training (``--steps`` trains longer). The
learning rate is swept (the first learning rate of ``--lrs`` for every configuration before the
next); the table reports each configuration's best test accuracy. Training throughput (tokens per
second) excludes the first steps, which include kernel compilation. ``--compile`` runs the
training forward and backward through ``torch.compile`` (one compilation per mixer, d_model and
task; the layer's operators are ``torch.library`` custom ops, so the model compiles whole).

``--plan`` prints the runs of an invocation, their steps, and the projected H200 time (the
PLAN_* assumptions: measured eager step times of every mixer), so that the grid can be split into
parts that fit a time limit; the default parts (``DEFAULT_PARTS``) fit 9 minutes each. The budget
guard (``--budget-s``) starts a run only if its estimate, the measured time of the configuration at
an earlier learning rate or else its projection, ends within the budget.

Usage:
    python benchmarks/mqar.py --cpu-smoke                       # seconds, HLA2 learns the tiny task
    python benchmarks/mqar.py --state-range benchmarks/results/mqar_state_range_cpu.json
    python benchmarks/mqar.py --part easy --plan                # runs, steps, projected H200 time
    python benchmarks/mqar.py --part easy --budget-s 530        # (64, 4), (128, 8), (256, 16)
    python benchmarks/mqar.py --part hard --budget-s 530        # (256, 32), (256, 64)
    python benchmarks/mqar.py --part all --lrs 0.01 --fit-s 530 # one learning rate, steps fitted
    python benchmarks/mqar.py --part all --workers 5 --budget-s 480 --throughput
                                 # the whole grid, a process per task side by side on one GPU, then
                                 # each mixer's training throughput measured alone
``--workers N`` runs the tasks in N processes side by side on the device (the small models leave a
GPU idle between kernel launches, so they finish sooner together than one after the other); their
rows are merged into ``--out``, and since their tokens/s were measured beside each other,
``--throughput`` measures every mixer's training rate again, one process alone on the device
(THROUGHPUT), for the throughput table.
Each run appends its row to ``--out`` (default benchmarks/results/mqar_h200.json; a rerun of the
same configuration replaces its row) and renders the markdown table next to it (.md).
"""
from __future__ import annotations

import argparse
import datetime
import inspect
import json
import math
import os
import platform
import sys
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from hla_fast.layers import HigherOrderLinearAttention  # noqa: E402

MIXERS = ("attention", "linear", "hla2", "ahla", "hla3", "hla2_gated")
PARTS = {
    "easy": [(64, 4), (128, 8), (256, 16)],
    "hard": [(256, 32), (256, 64)],
}
PARTS["all"] = PARTS["easy"] + PARTS["hard"]
DEFAULT_PARTS = ("easy", "hard")  # the grid in parts that fit 9 minutes each by the projection (--plan)
D_MODELS = (64, 128, 256)
LRS = (1e-2, 3e-3)  # in this order: a budget cut drops points of the second

# The default training regime per task (seq_len, kv): optimizer steps and batch size. The training
# set is steps x batch_size sequences unless --train-examples is given: every training sequence is
# seen once. (On a fixed set of 20k sequences, 600 steps of 256 -- 7.7 epochs -- took an HLA2 model
# to a training loss of 1.3 at a test accuracy of 0.14: it memorizes pairs instead of learning to
# recall. Generating the data is cheap, so every step sees new sequences.)
# The step counts make each default part (DEFAULT_PARTS, both learning rates of LRS) fit 9 minutes
# of an H200 by the projection below; ``--fit-s`` rescales them to another time.
REGIME = {
    (64, 4): dict(steps=210, batch_size=512),
    (128, 8): dict(steps=210, batch_size=256),
    (256, 16): dict(steps=170, batch_size=256),
    (256, 32): dict(steps=220, batch_size=256),
    (256, 64): dict(steps=220, batch_size=256),
}
REGIME_FALLBACK = dict(steps=220, batch_size=256)  # a task outside REGIME

# Projected H200 time (--plan, and the budget guard before a configuration has been timed).
# Measured on an H200 (bf16 autocast, eager, batch 256, full-vocabulary head): every mixer
# trained at 2-6 M tokens/s, and a step never took less than ~7 ms (attention) or ~13 ms (the
# linear and HLA mixers: launch and host overhead). The projection of one step is
# max(floor, tokens / rate), with the rate of the slowest mixer at 256 tokens per d_model; the
# head now runs at the answer positions only, so this overestimates the longer tasks.
PLAN_STEP_FLOOR_S = {"attention": 0.007}
PLAN_STEP_FLOOR_DEFAULT_S = 0.013
PLAN_TOKENS_PER_S = {64: 4.8e6, 128: 3.9e6, 256: 2.75e6}
PLAN_RUN_S = 1.0     # per run: model construction, the evaluation, the first steps
PLAN_START_S = 20.0  # per process: imports, CUDA start, the data
# first call of a mixer at a d_model in a process (Triton compilation of the HLA kernels), as
# measured on the first H200 run; flash-linear-attention's chunk_linear_attn (--linear-impl fla)
# autotunes at every d_model (55 s at the first, 10-15 s at the others)
PLAN_FIRST_CALL_S = {"attention": 1.0, "linear": 1.0, "hla2": 3.0, "ahla": 3.0, "hla3": 6.0, "hla2_gated": 4.0}
PLAN_FIRST_CALL_FLA_S = 27.0
PLAN_COMPILE_S = 30.0  # per (mixer, d_model, task) graph with --compile (an assumption, not measured on a GPU)
DEFAULT_OUT = os.path.join(HERE, "results", "mqar_h200.json")
SCHEMA = "mqar/1"


# ----------------------------------------------------------------------------------------------
# data


def _distinct_rows(rng, n: int, k: int, low: int, high: int) -> np.ndarray:
    """[n, k] int64: each row k distinct integers of [low, high) in random order, uniform over such
    ordered tuples (as ``rng.choice(high - low, k, replace=False) + low`` per row).

    Rows of independent uniform draws, those with a repeat drawn again (i.i.d. draws conditioned on
    being distinct are a uniform ordered sample without replacement); when a repeat is likely
    (k^2 / 2 > high - low), the first k entries of a random permutation per row instead."""
    m = high - low
    if k > m:
        raise ValueError(f"cannot draw {k} distinct values from {m}")
    if k * (k - 1) > 2 * m:
        return np.argsort(rng.random((n, m)), axis=1)[:, :k].astype(np.int64) + low
    out = rng.integers(low, high, size=(n, k), dtype=np.int64)
    todo = np.arange(n)
    while todo.size:
        s = np.sort(out[todo], axis=1)
        todo = todo[(s[:, 1:] == s[:, :-1]).any(axis=1)]
        out[todo] = rng.integers(low, high, size=(todo.size, k), dtype=np.int64)
    return out


def _power_law_gaps(rng, n: int, k: int, space: int, power_a: float, rows: int = 1 << 14) -> np.ndarray:
    """[n, k] int64: per row k distinct gaps of {0, ..., space - 1}, drawn one after another with
    probability proportional to a (gap + 1)^(a - 1) among those not drawn yet (what
    ``rng.choice(space, k, replace=False, p=p)`` does per row), vectorized by the Gumbel top-k
    trick: the k largest of log p + Gumbel noise, in decreasing order, are such a sequence."""
    logp = (power_a - 1) * np.log(np.arange(1, space + 1, dtype=np.float64))
    out = np.empty((n, k), np.int64)
    for i in range(0, n, rows):  # bounded memory: [rows, space] at a time
        z = logp - np.log(-np.log(rng.random((min(rows, n - i), space))))
        top = np.argpartition(-z, k - 1, axis=1)[:, :k] if k < space else np.tile(np.arange(space), (z.shape[0], 1))
        order = np.argsort(-np.take_along_axis(z, top, axis=1), axis=1)
        out[i:i + z.shape[0]] = np.take_along_axis(top, order, axis=1)
    return out


def mqar_data(vocab: int, n: int, seq_len: int, kv: int, seed: int, power_a: float = 0.01):
    """n MQAR sequences: (inputs [n, seq_len] int64, labels [n, seq_len] int64, -100 off answers).

    Definition in the module docstring; every step is vectorized over the n sequences (no loop
    over them), so the grid's data takes seconds. Drawn with numpy's Generator from ``seed``."""
    if seq_len % 2 or 4 * kv > seq_len or vocab <= seq_len or kv < 1:
        raise ValueError(f"MQAR needs an even seq_len >= 4 kv and vocab > seq_len, got seq_len={seq_len}, "
                         f"kv={kv}, vocab={vocab}")
    rng = np.random.default_rng(seed)
    half = vocab // 2
    ctx = 2 * kv
    space = (seq_len - ctx) // 2
    keys = _distinct_rows(rng, n, kv, 1, half)            # 1 .. half - 1
    vals = _distinct_rows(rng, n, kv, half, vocab)        # half .. vocab - 1
    gaps = _power_law_gaps(rng, n, kv, space, power_a)
    inputs = np.zeros((n, seq_len), np.int64)
    labels = np.full((n, seq_len), -100, np.int64)
    inputs[:, 0:ctx:2] = keys
    inputs[:, 1:ctx:2] = vals
    rows = np.arange(n)[:, None]
    qpos = ctx + 2 * gaps
    inputs[rows, qpos] = keys
    labels[rows, qpos] = vals
    fill = inputs == 0
    inputs[fill] = rng.integers(0, vocab, size=int(fill.sum()))
    return torch.from_numpy(inputs), torch.from_numpy(labels)


# ----------------------------------------------------------------------------------------------
# mixers


def linear_attention_torch(q, k, v, chunk: int = 64):
    """Causal first-order linear attention, chunked: o_t = sum_{i <= t} (q_t . k_i) v_i.

    q, k: [B, T, H, K]; v: [B, T, H, V] -> o [B, T, H, V] (fp32 accumulation). Within a chunk the
    masked product (Q K^T o L) V; across chunks the exclusive prefix sum of the chunk states K^T V."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    C = min(chunk, T)
    N = -(-T // C)
    pad = N * C - T

    def tiles(x):
        x = x.float().transpose(1, 2)
        if pad:
            x = F.pad(x, (0, 0, 0, pad))
        return x.reshape(B, H, N, C, x.shape[-1])

    Q, Kc, Vc = tiles(q), tiles(k), tiles(v)
    L = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    intra = ((Q @ Kc.transpose(-1, -2)) * L) @ Vc
    states = Kc.transpose(-1, -2) @ Vc                      # [B, H, N, K, V]
    prefix = torch.cumsum(states, dim=2) - states           # state before each chunk
    o = intra + Q @ prefix
    return o.reshape(B, H, N * C, V)[:, :, :T].transpose(1, 2).to(v.dtype)


def fla_linear_attention():
    """flash-linear-attention's chunk_linear_attn as f(q, k, v) -> o on [B, T, H, K], or None."""
    try:
        from fla.ops.linear_attn import chunk_linear_attn
    except Exception:  # not installed, or it does not import with this torch / triton
        return None
    extra = {"head_first": False} if "head_first" in inspect.signature(chunk_linear_attn).parameters else {}

    def run(q, k, v):
        # scale=1: q and k are already unit-norm; normalize=False: the plain sum, as in the torch form
        o = chunk_linear_attn(q, k, v, scale=1.0, normalize=False, **extra)
        return o[0] if isinstance(o, tuple) else o

    # use it only if it computes our definition here (its layout and scaling conventions changed
    # between versions): one bf16 call against the torch chunk form
    try:
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k = (F.normalize(torch.randn(2, 100, 2, 64, device="cuda", generator=g), dim=-1) for _ in range(2))
        v = torch.randn(2, 100, 2, 64, device="cuda", generator=g)
        want = linear_attention_torch(q, k, v)
        got = run(q.bfloat16(), k.bfloat16(), v.bfloat16()).float()
        if not float((got - want).norm() / want.norm()) < 3e-2:
            return None
    except Exception:
        return None
    return run


class SoftmaxAttention(nn.Module):
    """Causal multi-head softmax attention (torch SDPA)."""

    def __init__(self, d, heads):
        super().__init__()
        self.h = heads
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.o_proj = nn.Linear(d, d, bias=False)

    def forward(self, x):
        B, T, D = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.h, D // self.h).permute(2, 0, 3, 1, 4)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(o.transpose(1, 2).reshape(B, T, D))


class LinearAttention(nn.Module):
    """First-order linear attention with the HLA layer's q/k l2 norm and per-head output RMS norm."""

    def __init__(self, d, heads, impl):
        super().__init__()
        self.h = heads
        self.impl = impl
        self.q_proj = nn.Linear(d, d, bias=False)
        self.k_proj = nn.Linear(d, d, bias=False)
        self.v_proj = nn.Linear(d, d, bias=False)
        self.o_norm = nn.RMSNorm(d // heads, eps=1e-5)
        self.o_proj = nn.Linear(d, d, bias=False)

    def forward(self, x):
        B, T, D = x.shape
        shape = (B, T, self.h, D // self.h)
        v = self.v_proj(x).view(shape)
        # under CUDA autocast the norm runs in fp32: keep q, k in v's dtype
        q = F.normalize(self.q_proj(x).view(shape), dim=-1).to(v.dtype)
        k = F.normalize(self.k_proj(x).view(shape), dim=-1).to(v.dtype)
        o = self.impl(q, k, v)
        o = self.o_norm(o.float()).to(x.dtype)
        return self.o_proj(o.reshape(B, T, D))


class HLAMixer(nn.Module):
    def __init__(self, d, heads, order, gate, backend, **layer_kw):
        super().__init__()
        self.layer = HigherOrderLinearAttention(d, heads, order=order, gate=gate, backend=backend, **layer_kw)

    def forward(self, x):
        return self.layer(x)[0]


class ShortConv(nn.Module):
    """Causal depthwise convolution over time: [B, T, D] -> [B, T, D]."""

    def __init__(self, d, width):
        super().__init__()
        self.width = width
        self.conv = nn.Conv1d(d, d, width, groups=d, padding=width - 1)

    def forward(self, x):
        return self.conv(x.transpose(1, 2))[..., : x.shape[1]].transpose(1, 2)


def make_mixer(name, d, head_dim, backend, linear_impl, layer_kw=None):
    """The mixer ``name`` for width d with heads of head_dim; layer_kw: extra arguments of the HLA
    layer (the state-range measurement)."""
    heads = max(1, d // head_dim)
    layer_kw = layer_kw or {}
    if name == "attention":
        return SoftmaxAttention(d, heads)
    if name == "linear":
        return LinearAttention(d, heads, linear_impl)
    if name == "hla2_gated":
        return HLAMixer(d, heads, "hla2", "data", backend, **layer_kw)
    if name in ("hla2", "ahla", "hla3"):
        return HLAMixer(d, heads, name, "none", backend, **layer_kw)
    raise ValueError(f"unknown mixer {name!r}; choose from {MIXERS}")


class Block(nn.Module):
    def __init__(self, d, mixer, conv, mlp):
        super().__init__()
        self.norm1 = nn.RMSNorm(d)
        self.conv = ShortConv(d, conv) if conv else None
        self.mixer = mixer
        self.mlp = nn.Sequential(nn.RMSNorm(d), nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d)) if mlp else None

    def forward(self, x):
        h = self.norm1(x)
        if self.conv is not None:
            h = self.conv(h)
        x = x + self.mixer(h)
        if self.mlp is not None:
            x = x + self.mlp(x)
        return x


class MQARModel(nn.Module):
    """Embedding, 2 blocks (norm -> short conv -> mixer -> residual (+ MLP)), norm, LM head.

    ``tie``: the LM head is the embedding matrix (as in Zoology): recalling a value then means
    carrying the value token's own embedding to the query position, which a short training run
    learns far sooner than an independent head (initialized N(0, 0.02^2), as Zoology does, so
    the initial logits are small). ``forward(ids, pos)``: logits only at the positions ``pos``
    [B, P] (the answer positions), [B, P, vocab]; the loss ignores every other position, so the
    head and the cross entropy need not run there (at vocab 8192 they would dominate a step)."""

    def __init__(self, vocab, d, mixer, *, head_dim=64, n_layers=2, conv=4, mlp=True, backend=None, linear_impl=None,
                 layer_kw=None, tie=True):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList([Block(d, make_mixer(mixer, d, head_dim, backend, linear_impl, layer_kw), conv, mlp)
                                     for _ in range(n_layers)])
        self.norm = nn.RMSNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        if tie:
            nn.init.normal_(self.emb.weight, std=0.02)
            self.head.weight = self.emb.weight

    def forward(self, ids, pos=None):
        x = self.emb(ids)
        for b in self.blocks:
            x = b(x)
        if pos is not None:
            x = x.gather(1, pos[..., None].expand(-1, -1, x.shape[-1]))
        return self.head(self.norm(x))


# ----------------------------------------------------------------------------------------------
# training


def lr_at(step, steps, lr):
    warm = max(1, steps // 10)
    if step < warm:
        return lr * (step + 1) / warm
    return 0.5 * lr * (1 + math.cos(math.pi * (step - warm) / max(1, steps - warm)))


def answer_positions(y):
    """[n, P] int64: the positions of the answers of every sequence (labels [n, T], -100 off
    answers, the same number P of answers in every row), in increasing order."""
    m = y != -100
    P = int(m[0].sum())
    if not bool((m.sum(1) == P).all()):
        raise ValueError("every sequence must have the same number of answers")
    return torch.nonzero(m)[:, 1].view(y.shape[0], P)


def accuracy(model, x, y, batch, amp):
    """Fraction of answer positions whose argmax is the answer (x, y: inputs, labels [n, T])."""
    model.eval()
    pos = answer_positions(y)
    ans = y.gather(1, pos)
    hit = 0
    with torch.no_grad(), amp():
        for i in range(0, x.shape[0], batch):
            logits = model(x[i:i + batch], pos[i:i + batch])
            hit += int((logits.argmax(-1) == ans[i:i + batch]).sum())
    model.train()
    return hit / ans.numel()


def train_one(mixer, d, lr, data, cfg, device, linear_impl):
    """Train one model for ``cfg["steps"]`` optimizer steps (batches of ``cfg["batch_size"]``
    drawn by epochs over the training set, reshuffled each epoch); returns the row of the results
    (accuracy, loss, tokens/s, ...). The loss is the cross entropy at the answer positions only
    (the same value as over all positions with -100 ignored). ``cfg["compile"]``: the training
    forward and backward run through ``torch.compile`` (the evaluation runs eagerly, which saves
    a second compilation)."""
    xtr, ytr, xte, yte = data
    torch.manual_seed(cfg["seed"])
    model = MQARModel(cfg["vocab"], d, mixer, head_dim=cfg["head_dim"], conv=cfg["conv"], mlp=cfg["mlp"],
                      backend=cfg["backend"], linear_impl=linear_impl, layer_kw=cfg.get("layer_kw"),
                      tie=cfg.get("tie", True)).to(device)
    cuda = device.type == "cuda"
    # fused AdamW on CUDA: one kernel for the whole update instead of a few per parameter group
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1, betas=(0.9, 0.98),
                            **({"fused": True} if cuda else {}))
    fwd = torch.compile(model) if cfg.get("compile") else model

    def amp():
        return torch.autocast("cuda", dtype=torch.bfloat16) if cuda else torch.autocast("cpu", enabled=False)

    n, T = xtr.shape
    pos_tr = answer_positions(ytr)
    ans_tr = ytr.gather(1, pos_tr)
    bs = cfg["batch_size"]
    if bs > n:
        raise ValueError(f"batch_size {bs} > {n} training sequences")
    per_epoch = n // bs
    steps = int(cfg["steps"])
    gen = torch.Generator().manual_seed(cfg["seed"] + 1)
    skip = min(cfg["warm_steps"], steps - 1)  # steps left out of the throughput (compilation)
    t_start, losses, batches = None, [], None
    t0 = time.perf_counter()
    for step in range(steps):
        if step % per_epoch == 0:
            batches = torch.randperm(n, generator=gen)[: per_epoch * bs].view(per_epoch, bs).to(device)
        idx = batches[step % per_epoch]
        if step == skip:
            if cuda:
                torch.cuda.synchronize()
            t_start = time.perf_counter()
        for gr in opt.param_groups:
            gr["lr"] = lr_at(step, steps, lr)
        with amp():
            logits = fwd(xtr[idx], pos_tr[idx])
        loss = F.cross_entropy(logits.float().flatten(0, 1), ans_tr[idx].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 20 == 0 or step == steps - 1:
            losses.append(float(loss.detach()))
    if cuda:
        torch.cuda.synchronize()
    t_end = time.perf_counter()
    acc = accuracy(model, xte, yte, cfg["eval_batch"], amp)
    return {
        "accuracy": acc, "final_loss": losses[-1], "steps": steps, "epochs": round(steps * bs / n, 2),
        "train_tokens_per_s": (steps - skip) * bs * T / (t_end - t_start),
        "train_s": t_end - t0, "run_s": time.perf_counter() - t0,
        "params": sum(p.numel() for p in model.parameters()),
        "loss_curve_every_20": losses,
    }


# ----------------------------------------------------------------------------------------------
# bookkeeping


def versions():
    out = {"torch": torch.__version__, "python": platform.python_version()}
    try:
        import triton
        out["triton"] = triton.__version__
    except Exception:
        out["triton"] = None
    try:
        import fla
        out["fla"] = getattr(fla, "__version__", "installed")
    except Exception:
        out["fla"] = None
    return out


def device_name(device):
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def row_key(r):
    return (r["mixer"], r["d_model"], r["seq_len"], r["num_kv_pairs"], r["lr"])


def load(path):
    if os.path.exists(path):
        with open(path) as f:
            res = json.load(f)
        if res.get("schema") != SCHEMA:
            raise ValueError(f"{path} has schema {res.get('schema')!r}, expected {SCHEMA!r}")
        return res
    return {"schema": SCHEMA, "runs": []}


def save(res, path):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(res, f, indent=1)
    os.replace(tmp, path)
    with open(markdown_path(path), "w") as f:
        f.write(render(res))


def markdown_path(path):
    """The markdown table rendered beside the results file ``path``."""
    return os.path.splitext(path)[0] + ".md"


def load_for_device(path, device):
    """The results at ``path`` (load), refused when they hold runs of another device than
    ``device``: one results file per device."""
    res = load(path)
    here = device_name(device)
    others = sorted({r["device"] for r in res["runs"]} - {here})
    if others:
        raise ValueError(f"{path} holds runs from {others}, this run is on {here}: one results file per device "
                         "(remove it or pass another --out)")
    res["path"] = os.path.basename(path)
    return res


def merge_rows(res, rows):
    """res["runs"] with ``rows`` added, each replacing an earlier run of its configuration (row_key)."""
    keys = {row_key(r) for r in rows}
    res["runs"] = [x for x in res["runs"] if row_key(x) not in keys] + list(rows)


def best_runs(runs):
    """{(mixer, d_model, seq_len, kv): the run with the best accuracy over learning rates}."""
    best = {}
    for r in runs:
        key = row_key(r)[:4]
        if key not in best or r["accuracy"] > best[key]["accuracy"]:
            best[key] = r
    return best


def render(res):
    runs = res["runs"]
    if not runs:
        return "# MQAR\n\nNo runs yet.\n"
    best = best_runs(runs)
    mixers = [m for m in MIXERS if any(r["mixer"] == m for r in runs)]
    tasks = sorted({(r["seq_len"], r["num_kv_pairs"]) for r in runs})
    ds = sorted({r["d_model"] for r in runs})
    r0 = runs[-1]
    lines = [
        "# MQAR (Zoology's multi-query associative recall)",
        "",
        "Written by `benchmarks/mqar.py` from `" + os.path.basename(res.get("path", "mqar_h200.json")) + "`. "
        f"Device: {r0['device']}; torch {r0['versions']['torch']}, triton {r0['versions']['triton']}, "
        f"flash-linear-attention {r0['versions']['fla']}. Vocabulary {r0['vocab']}, "
        f"{r0['test_examples']} test sequences, head_dim {r0['head_dim']}, seed {r0['seed']}, "
        f"tied embedding and head: {r0.get('tie', False)}, learning rates {sorted({r['lr'] for r in runs})}"
        + "".join(f", linear attention: {x}" for x in sorted({r.get("linear_impl") or "" for r in runs} - {""}))
        + ".",
        "",
        "Test accuracy on answer positions (best learning rate in brackets); '-' not run.",
        "",
    ]
    for T, kv in tasks:
        regs = sorted({(r["steps"], r["batch_size"], r["train_examples"]) for r in runs
                       if (r["seq_len"], r["num_kv_pairs"]) == (T, kv)})
        lines += [f"## seq_len {T}, {kv} key-value pairs", "",
                  "Training: " + "; ".join(f"{s} steps of batch {b} over {n} sequences" for s, b, n in regs) + ".", "",
                  "| mixer | " + " | ".join(f"d_model {d}" for d in ds) + " |",
                  "|---|" + "---|" * len(ds)]
        for m in mixers:
            cells = []
            for d in ds:
                b = best.get((m, d, T, kv))
                cells.append("-" if b is None else f"{b['accuracy']:.3f} ({b['lr']:g})")
            lines.append(f"| {m} | " + " | ".join(cells) + " |")
        lines.append("")
    lines += throughput_lines(res, mixers, ds, tasks)
    return "\n".join(lines)


def throughput_lines(res, mixers, ds, tasks):
    """The throughput table of render: the dedicated measurement (``--throughput``, one process
    alone on the device) when the results hold one, else the median over the runs of each mixer and
    d_model at the longest sequence, leaving out runs that shared the device with other processes
    (``--workers``), whose rate says as much about their neighbours as about them."""
    lines = ["## Training throughput", ""]
    tp = res.get("throughput")
    if tp:
        lines += [f"Tokens per second of training (forward, backward, optimizer) at seq_len {tp['seq_len']}, batch "
                  f"{tp['batch_size']}: {tp['steps_timed']} steps timed after {tp['warm_steps']} warm-up steps, "
                  f"one process alone on the device ({tp['device']}, {tp['date']}).", ""]
        rate = {(r["mixer"], r["d_model"]): r["train_tokens_per_s"] for r in tp["rows"]}
        tds = sorted({d for _, d in rate})
        lines += ["| mixer | " + " | ".join(f"d_model {d}" for d in tds) + " |", "|---|" + "---|" * len(tds)]
        for m in [m for m in MIXERS if any(mm == m for mm, _ in rate)]:
            lines.append(f"| {m} | " + " | ".join("-" if (m, d) not in rate else f"{rate[(m, d)]:,.0f}" for d in tds)
                         + " |")
        lines.append("")
        return lines
    runs = [r for r in res["runs"] if r.get("concurrent_processes", 1) == 1]
    if not runs:
        return lines + ["Not measured: every run shared the device with other processes (`--workers`), so their "
                        "rates are not reported; `--throughput` measures each mixer alone.", ""]
    Tmax = max(T for T, _ in tasks)
    lines += ["Tokens per second of training (forward, backward, optimizer), median over the runs of each "
              "mixer and d_model at the longest sequence that had the device to themselves.", "",
              "| mixer | " + " | ".join(f"d_model {d}" for d in ds) + " |", "|---|" + "---|" * len(ds)]
    for m in mixers:
        cells = []
        for d in ds:
            v = [r["train_tokens_per_s"] for r in runs if r["mixer"] == m and r["d_model"] == d and r["seq_len"] == Tmax]
            cells.append("-" if not v else f"{float(np.median(v)):,.0f}")
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    lines.append("")
    return lines


# ----------------------------------------------------------------------------------------------
# regime and projection


def regime_for(task, cfg):
    """{steps, batch_size, train_examples} of task (seq_len, kv): REGIME's entry, where cfg sets
    a key (not None) cfg's value instead (``task_steps``: {task: steps}); train_examples defaults to
    steps x batch_size."""
    r = dict(REGIME.get(tuple(task), REGIME_FALLBACK))
    for k in ("steps", "batch_size", "train_examples"):
        if cfg.get(k) is not None:
            r[k] = cfg[k]
    if cfg.get("task_steps") and tuple(task) in cfg["task_steps"]:  # from --fit-s
        r["steps"] = cfg["task_steps"][tuple(task)]
    r.setdefault("train_examples", r["steps"] * r["batch_size"])
    return r


def projected_run_s(mixer, d, T, batch, steps):
    """Projected H200 seconds of one run (see PLAN_*): PLAN_RUN_S + steps x one step's time,
    max(the mixer's floor, batch T tokens at the d_model's rate)."""
    rate = min((r for dd, r in PLAN_TOKENS_PER_S.items() if dd >= d),
               default=PLAN_TOKENS_PER_S[max(PLAN_TOKENS_PER_S)] * max(PLAN_TOKENS_PER_S) / d)
    step = max(PLAN_STEP_FLOOR_S.get(mixer, PLAN_STEP_FLOOR_DEFAULT_S), batch * T / rate)
    return PLAN_RUN_S + steps * step


def first_call_s(mixer, compiled, linear_impl="torch chunk form"):
    """Projected one-time seconds when a process first runs mixer at a d_model (compilation,
    autotuning), plus, with --compile, one graph compilation."""
    s = PLAN_FIRST_CALL_FLA_S if mixer == "linear" and linear_impl.startswith("fla") else PLAN_FIRST_CALL_S.get(mixer, 5.0)
    return s + (PLAN_COMPILE_S if compiled else 0.0)


def plan(tasks, mixers, d_models, lrs, cfg):
    """The runs of a grid invocation and their projected H200 time: a dict with ``tasks`` (per task:
    steps, batch_size, train_examples, runs, train_s), ``first_call_s``, ``start_s``, ``total_s``."""
    out = []
    compiled = bool(cfg.get("compile"))
    for T, kv in tasks:
        r = regime_for((T, kv), cfg)
        s = sum(projected_run_s(m, d, T, r["batch_size"], r["steps"]) for m in mixers for d in d_models) * len(lrs)
        out.append(dict(seq_len=T, num_kv_pairs=kv, runs=len(mixers) * len(d_models) * len(lrs), train_s=s, **r))
    lin = "fla" if cfg.get("linear_impl") == "fla" else "torch chunk form"
    first = sum(first_call_s(m, False, lin) for m in mixers) * len(d_models)
    if compiled:
        first += PLAN_COMPILE_S * len(mixers) * len(d_models) * len(tasks)
    total = PLAN_START_S + first + sum(t["train_s"] for t in out)
    return dict(tasks=out, first_call_s=first, start_s=PLAN_START_S, total_s=total,
                runs=sum(t["runs"] for t in out), compiled=compiled)


def fit_steps(tasks, mixers, d_models, lrs, cfg, seconds):
    """{task: steps}: every task's steps (regime_for) scaled by one factor so that the projected time
    of the invocation (plan) is at most ``seconds``; at least 10 steps a task."""
    p = plan(tasks, mixers, d_models, lrs, cfg)
    fixed = p["start_s"] + p["first_call_s"] + p["runs"] * PLAN_RUN_S
    stepping = p["total_s"] - fixed
    factor = max(0.0, seconds - fixed) / stepping if stepping > 0 else 1.0
    return {(t["seq_len"], t["num_kv_pairs"]): max(10, int(t["steps"] * factor)) for t in p["tasks"]}


def format_plan(p, budget_s=None):
    lines = ["task (seq_len, kv) | steps | batch | train seqs | runs | projected s"]
    for t in p["tasks"]:
        lines.append(f"({t['seq_len']}, {t['num_kv_pairs']}) | {t['steps']} | {t['batch_size']} | "
                     f"{t['train_examples']} | {t['runs']} | {t['train_s']:.0f}")
    lines.append(f"{p['runs']} runs: {sum(t['train_s'] for t in p['tasks']):.0f} s training + "
                 f"{p['first_call_s']:.0f} s first calls + {p['start_s']:.0f} s start = "
                 f"{p['total_s']:.0f} s ({p['total_s'] / 60:.1f} min) projected on an H200")
    lines.append("assumption: a step takes max(floor, batch x seq_len / rate), floor "
                 f"{PLAN_STEP_FLOOR_S['attention'] * 1e3:.0f} ms (attention) / {PLAN_STEP_FLOOR_DEFAULT_S * 1e3:.0f} ms "
                 "(others), rate " + ", ".join(f"{r / 1e6:.2f} M tok/s (d_model {d})" for d, r in
                                                 PLAN_TOKENS_PER_S.items()) +
                 f"; {PLAN_RUN_S:.0f} s a run besides its steps (eager H200 measurements, full-vocabulary head)")
    if p.get("compiled"):
        lines.append(f"--compile: {PLAN_COMPILE_S:.0f} s of compilation per mixer, d_model and task (an assumption) "
                     "and the eager step time (its gain is not measured on a GPU)")
    if budget_s is not None:
        lines.append(f"budget {budget_s:.0f} s: " + ("fits" if p["total_s"] <= budget_s else
                                                      "does NOT fit: the budget guard will skip the last runs"))
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# entry points


def run_grid(*, tasks, mixers, d_models, lrs, cfg, device, out, budget_s=None, part="custom", log=print):
    """Train every (lr, task, d_model, mixer) in that order (all configurations at the first
    learning rate before any at the second, so a budget cut loses sweep points, not cells) and
    append each finished run to ``out``. Each task trains with ``regime_for(task, cfg)``. With
    ``budget_s``, a run is started only if its estimate ends within the budget: the measured time of
    the same configuration at an earlier learning rate, else its projection (PLAN_*) plus the
    first-call allowance of a mixer and d_model not run yet. Returns the list of new rows."""
    t0 = time.perf_counter()
    res = load_for_device(out, device)
    use_fla = device.type == "cuda" and cfg.get("linear_impl", "torch") == "fla"
    linear_impl = (fla_linear_attention() if use_fla else None) or linear_attention_torch
    linear_name = "fla.chunk_linear_attn" if linear_impl is not linear_attention_torch else "torch chunk form"
    data, regimes = {}, {}
    for T, kv in tasks:
        regimes[(T, kv)] = reg = regime_for((T, kv), cfg)
        g = mqar_data(cfg["vocab"], reg["train_examples"], T, kv, seed=cfg["seed"])
        h = mqar_data(cfg["vocab"], cfg["test_examples"], T, kv, seed=cfg["seed"] + 10)
        data[(T, kv)] = tuple(x.to(device) for x in (*g, *h))
    log(f"data ready in {time.perf_counter() - t0:.1f}s; linear attention: {linear_name}")
    compiled = bool(cfg.get("compile"))
    durations, new, unavailable, called = {}, [], set(), set()
    for lr in lrs:
        for T, kv in tasks:
            reg = regimes[(T, kv)]
            tcfg = {**cfg, **reg}
            for d in d_models:
                for m in mixers:
                    if m in unavailable:
                        continue
                    est = durations.get((m, T, kv, d))
                    if est is None:
                        est = projected_run_s(m, d, T, reg["batch_size"], reg["steps"])
                        if (m, d) not in called:
                            est += first_call_s(m, compiled, linear_name)
                        elif compiled:
                            est += PLAN_COMPILE_S
                    spent = time.perf_counter() - t0
                    if budget_s is not None and spent + est > budget_s:
                        log(f"budget: skip {m} d={d} T={T} kv={kv} lr={lr} ({spent:.0f}s spent, ~{est:.0f}s needed)")
                        continue
                    ts = time.perf_counter()
                    called.add((m, d))
                    try:
                        r = train_one(m, d, lr, data[(T, kv)], tcfg, device, linear_impl)
                    except NotImplementedError as e:  # an operator this installation lacks
                        log(f"{m}: unavailable ({e})")
                        unavailable.add(m)
                        continue
                    durations[(m, T, kv, d)] = time.perf_counter() - ts
                    r.update(mixer=m, d_model=d, seq_len=T, num_kv_pairs=kv, lr=lr, part=part,
                             linear_impl=linear_name if m == "linear" else None,
                             device=device_name(device), versions=versions(),
                             date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
                             **{k: tcfg[k] for k in ("vocab", "train_examples", "test_examples", "batch_size",
                                                      "head_dim", "seed", "conv", "mlp")},
                             tie=bool(cfg.get("tie", True)), compiled=compiled,
                             dtype="bf16 autocast" if device.type == "cuda" else "fp32")
                    merge_rows(res, [r])
                    save(res, out)
                    new.append(r)
                    log(f"{m:>10} d={d:<3} T={T:<3} kv={kv:<2} lr={lr:g}: acc {r['accuracy']:.3f} "
                        f"loss {r['final_loss']:.3f} {r['train_tokens_per_s']:,.0f} tok/s {r['train_s']:.1f}s")
    log(f"done in {time.perf_counter() - t0:.0f}s, {len(new)} runs -> {out}")
    return new


def _grid_worker(spec_path):
    """One process of run_workers: run_grid on the spec's tasks (a JSON file), within its deadline,
    each log line prefixed with the tasks."""
    with open(spec_path) as f:
        spec = json.load(f)
    cfg = dict(spec["cfg"])
    if cfg.get("task_steps"):
        cfg["task_steps"] = {(T, kv): n for T, kv, n in cfg["task_steps"]}
    tasks = [tuple(t) for t in spec["tasks"]]
    tag = ",".join(f"{T}:{kv}" for T, kv in tasks) + " lr " + ",".join(f"{x:g}" for x in spec["lrs"])
    budget = None if spec["deadline"] is None else spec["deadline"] - time.time()
    run_grid(tasks=tasks, mixers=spec["mixers"], d_models=spec["d_models"], lrs=spec["lrs"], cfg=cfg,
             device=torch.device(spec["device"]), out=spec["out"], budget_s=budget, part=spec["part"],
             log=lambda s: print(f"[{tag}] {s}", flush=True))


def deal_tasks(tasks, workers, cfg):
    """tasks dealt to min(workers, len(tasks)) groups, balanced by their projected time (plan):
    the longest task first, each to the group with the least projected time so far."""
    n = max(1, min(int(workers), len(tasks)))
    regimes = {tuple(t): regime_for(t, cfg) for t in tasks}
    cost = {t: projected_run_s("hla3", 256, t[0], r["batch_size"], r["steps"]) for t, r in regimes.items()}
    groups, load_s = [[] for _ in range(n)], [0.0] * n
    for t in sorted(tasks, key=lambda t: -cost[tuple(t)]):
        i = load_s.index(min(load_s))
        groups[i].append(tuple(t))
        load_s[i] += cost[tuple(t)]
    return [sorted(g, key=list(map(tuple, tasks)).index) for g in groups]


def deal_jobs(tasks, lrs, workers, cfg):
    """[(tasks, lrs)]: what each process of run_workers runs. Up to one process a task: the tasks
    dealt by deal_tasks, every process all learning rates; more workers than tasks: a process per
    task and share of the learning rates (lrs[j::k], at most one process a learning rate)."""
    n = max(1, int(workers))
    if n <= len(tasks):
        return [(g, list(lrs)) for g in deal_tasks(tasks, n, cfg)]
    k = min(len(lrs), n // len(tasks))
    return [([tuple(t)], list(lrs[j::k])) for t in tasks for j in range(k)]


def run_workers(*, tasks, workers, out, budget_s=None, device, log=print, **kw):
    """run_grid over ``tasks`` in ``workers`` processes that share the device, then every row merged
    into ``out``. The small models of the grid leave a GPU idle between their kernel launches (a step
    never takes less than PLAN_STEP_FLOOR_*), so processes side by side finish the grid sooner than
    one. Each process gets a group of tasks (deal_tasks) and the whole budget, writes its own file
    next to ``out`` (removed after the merge) and keeps run_grid's order, all configurations at the
    first learning rate first (deal_jobs: with more workers than tasks, a task's learning rates are
    shared among processes too). Its rows record ``concurrent_processes``; their tokens/s were measured
    beside other processes, so the throughput table comes from measure_throughput instead."""
    import subprocess

    t0 = time.perf_counter()
    groups = deal_jobs(tasks, kw["lrs"], workers, kw["cfg"])
    if len(groups) == 1:
        return run_grid(tasks=tasks, out=out, budget_s=budget_s, device=device, log=log, **kw)
    res = load_for_device(out, device)
    cfg = dict(kw["cfg"])
    if cfg.get("task_steps"):  # JSON has no tuple keys
        cfg["task_steps"] = [[T, kv, n] for (T, kv), n in cfg["task_steps"].items()]
    stem = os.path.splitext(out)[0]
    procs, parts = [], []
    log(f"{len(groups)} processes: " + "; ".join(",".join(f"{T}:{kv}" for T, kv in g) + " lr " +
                                                   ",".join(f"{x:g}" for x in glr) for g, glr in groups))
    for i, (g, glr) in enumerate(groups):
        part, spec_path = f"{stem}.worker{i}.json", f"{stem}.worker{i}.spec.json"
        for x in (part, markdown_path(part)):
            if os.path.exists(x):
                os.remove(x)
        parts.append(part)
        with open(spec_path, "w") as f:
            json.dump(dict(tasks=g, mixers=kw["mixers"], d_models=kw["d_models"], lrs=glr, cfg=cfg,
                           device=str(device), out=part, part=kw.get("part", "custom"),
                           deadline=None if budget_s is None else time.time() + budget_s - (time.perf_counter() - t0)),
                      f)
        # a process of its own (not a fork: a CUDA context does not survive one), this file run as a script
        procs.append((subprocess.Popen([sys.executable, os.path.abspath(__file__), "--grid-worker", spec_path]),
                      spec_path))
    for p, _ in procs:
        p.wait()
    for _, spec_path in procs:
        os.remove(spec_path)
    failed = [i for i, (p, _) in enumerate(procs) if p.returncode != 0]
    new = []
    for part in parts:
        if os.path.exists(part):
            rows = load(part)["runs"]
            for r in rows:
                r["concurrent_processes"] = len(procs)
            new += rows
            for x in (part, markdown_path(part)):
                if os.path.exists(x):
                    os.remove(x)
    merge_rows(res, new)
    save(res, out)
    log(f"merged {len(new)} runs of {len(procs)} processes in {time.perf_counter() - t0:.0f}s -> {out}"
        + (f"; processes {failed} failed" if failed else ""))
    if failed:
        raise RuntimeError(f"grid processes {failed} exited with an error (their finished runs are merged)")
    return new


THROUGHPUT = dict(seq_len=256, kv=16, batch_size=256, warm_steps=5, steps_timed=30)


def measure_throughput(*, mixers, d_models, cfg, device, out, log=print, linear_impl=None, shape=None):
    """Training tokens/s of every mixer and d_model, one process alone on the device: the task and
    batch of ``shape`` (default THROUGHPUT), its warm-up steps (compilation) left out, stored as
    ``throughput`` in ``out`` (render's throughput table)."""
    s = shape or THROUGHPUT
    n = (s["warm_steps"] + s["steps_timed"]) * s["batch_size"]
    g = mqar_data(cfg["vocab"], n, s["seq_len"], s["kv"], seed=cfg["seed"])
    h = mqar_data(cfg["vocab"], 250, s["seq_len"], s["kv"], seed=cfg["seed"] + 10)
    data = tuple(x.to(device) for x in (*g, *h))
    tcfg = {**cfg, "steps": s["warm_steps"] + s["steps_timed"], "batch_size": s["batch_size"],
            "warm_steps": s["warm_steps"], "train_examples": n}
    rows = []
    for d in d_models:
        for m in mixers:
            r = train_one(m, d, 3e-3, data, tcfg, device, linear_impl or linear_attention_torch)
            rows.append(dict(mixer=m, d_model=d, train_tokens_per_s=r["train_tokens_per_s"]))
            log(f"throughput {m:>10} d={d:<3}: {r['train_tokens_per_s']:,.0f} tok/s")
    res = load(out)
    res["path"] = os.path.basename(out)
    res["throughput"] = dict(rows=rows, seq_len=s["seq_len"], batch_size=s["batch_size"], warm_steps=s["warm_steps"],
                             steps_timed=s["steps_timed"], device=device_name(device), versions=versions(),
                             date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
                             dtype="bf16 autocast" if device.type == "cuda" else "fp32",
                             compiled=bool(cfg.get("compile")))
    save(res, out)
    return rows


SMOKE = dict(vocab=64, seq_len=16, kv=2, d_model=64, head_dim=32, train_examples=3072, test_examples=256,
             steps=192, batch_size=64, lr=1e-2, seed=0)


def smoke(mixer="hla2", layer_kw=None, **over):
    """The CPU smoke task (SMOKE, seconds on a CPU, torch backend): returns the test accuracy.
    Chance is 2 / vocab (a value guessed among vocab / 2)."""
    s = {**SMOKE, **over}
    cfg = dict(vocab=s["vocab"], train_examples=s["train_examples"], test_examples=s["test_examples"],
               steps=s["steps"], batch_size=s["batch_size"], eval_batch=256, head_dim=s["head_dim"],
               seed=s["seed"], conv=4, mlp=True, backend="torch", warm_steps=3, layer_kw=layer_kw,
               tie=s.get("tie", True), compile=s.get("compile", False))
    g = mqar_data(s["vocab"], s["train_examples"], s["seq_len"], s["kv"], seed=s["seed"])
    h = mqar_data(s["vocab"], s["test_examples"], s["seq_len"], s["kv"], seed=s["seed"] + 10)
    r = train_one(mixer, s["d_model"], s["lr"], (*g, *h), cfg, torch.device("cpu"), linear_attention_torch)
    return r["accuracy"]


STATE_RANGE_OPTIONS = {
    "l2 q/k + output norm (default)": dict(qk_norm="l2", output_norm=True),
    "l2 q/k, no output norm": dict(qk_norm="l2", output_norm=False),
    "K^-1/4 scaling + output norm": dict(qk_norm=None, output_norm=True),
    "K^-1/4 scaling, no output norm": dict(qk_norm=None, output_norm=False),
    "l2 q/k + output norm + normalize": dict(qk_norm="l2", output_norm=True, normalize=True),
}


def state_range(T=4096, d=64, seed=0, orders=("hla2",), smoke_acc=True):
    """The measurement behind the layer's default state-range choice.

    For each option of STATE_RANGE_OPTIONS: the RMS of the operator's output (before the output
    norm) over positions [2^i, 2^(i+1)) of one random sequence of T tokens through a freshly
    initialized layer (one head of d), the largest |state entry| after T tokens, the RMS of the
    layer's output, and the smoke task's accuracy with that option. Returns a dict."""
    from hla_fast.ops import library

    out = {"T": T, "d_model": d, "seed": seed, "options": {}}
    x = torch.randn(1, T, d, generator=torch.Generator().manual_seed(seed))
    for order in orders:
        for name, kw in STATE_RANGE_OPTIONS.items():
            torch.manual_seed(seed)
            layer = HigherOrderLinearAttention(d, 1, order=order, backend="torch", layer_idx=0, **kw)
            with torch.no_grad():
                q, k, v, g = layer._heads(x)
                o, st = library.resolve(order)[0](q, k, v, g=g, normalize=layer.normalize, output_final_state=True,
                                                  backend="torch")
                y = layer(x)[0]
            bins, i = {}, 0
            while 2 ** i < T:
                lo, hi = 2 ** i, min(2 ** (i + 1), T)
                bins[f"{lo}-{hi - 1}"] = float(o[0, lo:hi].pow(2).mean().sqrt())
                i += 1
            rec = {"op_output_rms_by_position": bins,
                   "max_abs_state": max(float(t.abs().max()) for t in st if t is not None),
                   "layer_output_rms": float(y.pow(2).mean().sqrt())}
            if smoke_acc:
                rec["smoke_accuracy"] = smoke(order, layer_kw=kw)
            out["options"][f"{order}: {name}"] = rec
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cpu-smoke", action="store_true", help="train HLA2 on the tiny smoke task on the CPU")
    ap.add_argument("--grid-worker", metavar="SPEC", help=argparse.SUPPRESS)  # one process of --workers
    ap.add_argument("--state-range", metavar="JSON", help="run the state-range measurement, write it to JSON")
    ap.add_argument("--part", choices=sorted(PARTS), help="tasks of the grid to run")
    ap.add_argument("--tasks", help="override: seq_len:kv pairs, e.g. 64:4,128:8")
    ap.add_argument("--plan", action="store_true", help="print the runs and their projected H200 time; run nothing")
    ap.add_argument("--mixers", default=",".join(MIXERS))
    ap.add_argument("--d-models", default=",".join(map(str, D_MODELS)))
    ap.add_argument("--lrs", default=",".join(map(str, LRS)))
    ap.add_argument("--budget-s", type=float, default=None, help="start no run that would end past this")
    ap.add_argument("--workers", type=int, default=1,
                    help="processes sharing the device, each a group of the tasks (the rows are merged into --out)")
    ap.add_argument("--throughput", action="store_true",
                    help="after the grid (or alone), measure each mixer's training tokens/s alone on the device")
    ap.add_argument("--out", default=DEFAULT_OUT)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--backend", choices=["triton", "torch"], default=None, help="HLA backend (default: by device)")
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=None, help="optimizer steps of every run (default: REGIME per task)")
    ap.add_argument("--batch-size", type=int, default=None, help="default: REGIME per task")
    ap.add_argument("--train-examples", type=int, default=None,
                    help="training sequences of every task (default: steps x batch size, each seen once)")
    ap.add_argument("--fit-s", type=float, default=None,
                    help="scale every task's steps so that the projected H200 time (--plan) is this")
    ap.add_argument("--test-examples", type=int, default=1000)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-mlp", action="store_true")
    ap.add_argument("--no-tie", action="store_true", help="an LM head of its own instead of the embedding")
    ap.add_argument("--conv", type=int, default=4, help="short convolution width (0: none)")
    ap.add_argument("--compile", action="store_true", help="torch.compile the model for training")
    ap.add_argument("--linear-impl", choices=["torch", "fla"], default="torch",
                    help="first-order linear attention: the torch chunk form, or flash-linear-attention's "
                         "chunk_linear_attn on CUDA (autotunes per d_model: about a minute per process)")
    a = ap.parse_args(argv)
    if a.grid_worker:
        _grid_worker(a.grid_worker)
        return
    if a.cpu_smoke:
        t = time.perf_counter()
        acc = smoke(compile=a.compile)
        print(f"cpu smoke: HLA2 test accuracy {acc:.3f} (chance {2 / SMOKE['vocab']:.3f}) in {time.perf_counter() - t:.1f}s")
        return
    if a.state_range:
        res = state_range()
        res.update(device=device_name(torch.device("cpu")), versions=versions(),
                   date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"))
        with open(a.state_range, "w") as f:
            json.dump(res, f, indent=1)
        for name, r in res["options"].items():
            b = r["op_output_rms_by_position"]
            print(f"{name:44s} op RMS {min(b.values()):.3g}..{max(b.values()):.3g}  max|state| "
                  f"{r['max_abs_state']:.3g}  layer RMS {r['layer_output_rms']:.3g}  smoke acc {r['smoke_accuracy']:.3f}")
        return
    if a.tasks:
        tasks = [tuple(int(x) for x in t.split(":")) for t in a.tasks.split(",")]
        part = a.part or "custom"
    elif a.part:
        tasks, part = PARTS[a.part], a.part
    elif a.throughput:
        tasks, part = [], None  # the throughput measurement alone
    else:
        ap.error("give --cpu-smoke, --part, --tasks or --throughput")
    cfg = dict(vocab=a.vocab, steps=a.steps, batch_size=a.batch_size, train_examples=a.train_examples,
               test_examples=a.test_examples, eval_batch=250, head_dim=a.head_dim, seed=a.seed, conv=a.conv,
               mlp=not a.no_mlp, tie=not a.no_tie, compile=a.compile, backend=a.backend, warm_steps=5,
               linear_impl=a.linear_impl)
    mixers = a.mixers.split(",")
    for m in mixers:
        if m not in MIXERS:
            ap.error(f"unknown mixer {m!r}; choose from {MIXERS}")
    d_models = [int(x) for x in a.d_models.split(",")]
    lrs = [float(x) for x in a.lrs.split(",")]
    if a.workers < 1:
        ap.error(f"--workers must be >= 1, got {a.workers}")
    if a.fit_s is not None:
        cfg["task_steps"] = fit_steps(tasks, mixers, d_models, lrs, cfg, a.fit_s)
    if a.plan:
        print(f"part {part}: tasks {tasks}, mixers {mixers}, d_models {d_models}, lrs {lrs}"
              + (", --compile" if a.compile else ""))
        print(format_plan(plan(tasks, mixers, d_models, lrs, cfg), a.budget_s))
        if a.workers > 1:
            for g, glr in deal_jobs(tasks, lrs, a.workers, cfg):
                p = plan(g, mixers, d_models, glr, cfg)
                print(f"process {g} lr {glr}: {p['total_s']:.0f} s projected alone (the processes share the device, "
                      "so each takes longer than alone)")
        return
    log = lambda s: print(s, flush=True)  # noqa: E731
    device = torch.device(a.device)
    if tasks:
        run_workers(tasks=tasks, workers=a.workers, mixers=mixers, d_models=d_models, lrs=lrs, cfg=cfg, device=device,
                    out=a.out, budget_s=a.budget_s, part=part, log=log)
    if a.throughput:
        use_fla = device.type == "cuda" and a.linear_impl == "fla"
        measure_throughput(mixers=mixers, d_models=d_models, cfg=cfg, device=device, out=a.out, log=log,
                           linear_impl=fla_linear_attention() if use_fla else None)


if __name__ == "__main__":
    main()
