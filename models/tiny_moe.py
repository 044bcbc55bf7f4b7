"""The small mixture-of-experts transformer muon_zero.py's demo trains, and its learnable data.

Dense matrices of several shapes (square, wide, tall) and 3-D expert stacks [E, n, m]: every
kind of matrix MuonZeRO shards. The benchmarks and tests build it too.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F


class TinyMoE(nn.Module):
    """Embedding -> [attention + top-2 MoE of SwiGLU experts] x layers -> head."""

    def __init__(self, vocab=64, dim=48, heads=4, kv_dim=16, layers=2, experts=6, ffn=32, top_k=2):
        super().__init__()
        self.heads, self.kv_dim, self.top_k = heads, kv_dim, top_k
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList()
        for _ in range(layers):
            L = nn.Module()
            L.attn_norm, L.ffn_norm = nn.RMSNorm(dim), nn.RMSNorm(dim)
            L.wq = nn.Parameter(torch.randn(heads * kv_dim, dim) / dim**0.5)  # tall
            L.wkv = nn.Parameter(torch.randn(2 * kv_dim, dim) / dim**0.5)  # wide
            L.wo = nn.Parameter(torch.randn(dim, heads * kv_dim) / dim**0.5)  # wide
            L.router = nn.Parameter(torch.randn(experts, dim) / dim**0.5)
            L.w_gate = nn.Parameter(torch.randn(experts, ffn, dim) / dim**0.5)
            L.w_up = nn.Parameter(torch.randn(experts, ffn, dim) / dim**0.5)
            L.w_down = nn.Parameter(torch.randn(experts, dim, ffn) / ffn**0.5)
            self.layers.append(L)
        self.norm = nn.RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        B, T, D = x.shape
        for L in self.layers:
            h = L.attn_norm(x)
            q = (h @ L.wq.T).view(B, T, self.heads, self.kv_dim).transpose(1, 2)  # [B, H, T, kv]
            kv = (h @ L.wkv.T).unsqueeze(1).expand(-1, self.heads, -1, -1)  # one shared KV head
            att = F.scaled_dot_product_attention(q, *kv.split(self.kv_dim, -1), is_causal=True)
            x = x + att.transpose(1, 2).reshape(B, T, -1) @ L.wo.T
            h = L.ffn_norm(x)
            weights, chosen = (h @ L.router.T).softmax(-1).topk(self.top_k, dim=-1)
            gates = x.new_zeros(B, T, L.router.size(0)).scatter(-1, chosen, weights)  # [B, T, E]
            up = torch.einsum("btd,efd->btef", h, L.w_up)
            hidden = F.silu(torch.einsum("btd,efd->btef", h, L.w_gate)) * up
            x = x + torch.einsum("btef,edf,bte->btd", hidden, L.w_down, gates)
        return self.head(self.norm(x))


def demo_batch(batch, seq, vocab, generator):
    """Sequences t_{i+1} = (5 t_i + 3) mod vocab from a random start: learnable next-token data.
    In O(seq): t_i = (a_i t_0 + b_i) mod vocab, the maps (a_i, b_i) built by doubling."""
    start = torch.randint(0, vocab, (batch, 1), generator=generator, device="cpu")
    a, b = torch.ones(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64)
    while a.numel() < seq + 1:  # map n + i is map i after map n
        a_n, b_n = a[-1] * 5 % vocab, (b[-1] * 5 + 3) % vocab
        a, b = torch.cat([a, a * a_n % vocab]), torch.cat([b, (a * b_n + b) % vocab])
    tokens = (start * a[: seq + 1] + b[: seq + 1]) % vocab  # [batch, seq + 1]
    return tokens[:, :-1], tokens[:, 1:]
