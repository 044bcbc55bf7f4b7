"""The small MoE block that muon_zero.py's tests train: the graded tests, their probes and the
private tests alike.

Its matrices are sized so that no world size of 2-4 divides them evenly: 5 dense matrices and 15
expert matrices. make_params draws them from a seed, forward_loss is the plain single-process
model (the reference), batch(step, seed) the global batch the test slices, one slice per rank (the
graded test seeds it: it moves with the grading's draw, which only the test process knows; a
worker gets its own slices, never the batch).
"""

import math

import torch
import torch.nn.functional as F

VOCAB, DIM, HIDDEN, EXPERTS, FFN = 16, 12, 20, 5, 8
GLOBAL_BATCH, SEQ = 12, 6  # 12 samples split evenly over 1, 2, 3 and 4 ranks

# Dense matrices: tall, wide, square twice (a same-shape pair for batched NS), the router; 5 of
# them, which divides neither 2, 3 nor 4. Expert stacks of 5 experts: 15 matrices, divides 3 only.
DENSE = {
    "w_in": (HIDDEN, DIM),
    "w_out": (DIM, HIDDEN),
    "w_sq1": (DIM, DIM),
    "w_sq2": (DIM, DIM),
    "router": (EXPERTS, DIM),
}
EXPERT = {"gate": (EXPERTS, FFN, DIM), "up": (EXPERTS, FFN, DIM), "down": (EXPERTS, DIM, FFN)}
ADAMW = {"embed": (VOCAB, DIM), "norm": (DIM,), "head": (VOCAB, DIM)}


def make_params(seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = {**DENSE, **EXPERT, **ADAMW}
    P = {k: torch.randn(s, generator=g) / math.sqrt(s[-1]) for k, s in shapes.items()}
    P["norm"] = 1 + 0.1 * torch.randn(DIM, generator=g)
    return P


def forward_loss(P, tokens, targets):
    """A small MoE block; P's expert entries: 3-D tensors or lists of 2-D leaves."""
    E = {k: (torch.stack(P[k]) if isinstance(P[k], list) else P[k]) for k in EXPERT}
    x = P["embed"][tokens]  # [B, T, D]
    x = x + torch.tanh(x @ P["w_in"].T) @ P["w_out"].T
    x = x + torch.tanh(x @ P["w_sq1"].T) @ P["w_sq2"].T
    route = torch.sigmoid(x @ P["router"].T)  # softmax would leave the router rank-deficient
    h = F.silu(torch.einsum("btd,efd->btef", x, E["gate"]))
    h = h * torch.einsum("btd,efd->btef", x, E["up"])
    x = x + torch.einsum("btef,edf,bte->btd", h, E["down"], route)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * P["norm"]
    return F.cross_entropy((x @ P["head"].T).flatten(0, 1), targets.flatten())


def batch(step, seed=None):
    """Step ``step``'s global batch: tokens and next-token targets, [GLOBAL_BATCH, SEQ] each,
    drawn from ``seed`` (the public case's: 1000 + step)."""
    gen = torch.Generator().manual_seed(1000 + step if seed is None else seed)
    tokens = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]
