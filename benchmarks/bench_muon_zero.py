"""Benchmark for muon_zero.py: the plan at V4 scale, gradient-sync error, and what batching and sharding buy.

    .venv/bin/python benchmarks/bench_muon_zero.py          # about a minute on 2 idle CPU cores

Tables, all from one run:
  1. the ownership plan for a DeepSeek-V4-Flash-like inventory (built by the planner alone, no processes)
     at data-parallel sizes 8..256: matrices per rank, padding, NS-cost imbalance;
  2. optimizer-state bytes per rank at that scale: MuonZeRO vs replicated Muon vs replicated AdamW;
  3. gradient-sync error against an fp64 sum at 2..64 ranks: bf16 stochastic rounding + all-to-all + fp32
     sum (V4) vs a bf16 ring reduce-scatter vs fp32 (numerics simulated exactly, rank by rank);
  4. batched vs per-matrix Newton-Schulz time; MuonZeRO step time vs torch.optim.Muon (one process).
"""
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import muon_zero as mz  # noqa: E402

torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "2")))


def v4_flash_inventory(layers=range(43), hidden=4096, heads=64, head_dim=512, q_rank=1024, o_groups=8, o_rank=1024,
                       index_heads=64, index_dim=128, experts=256, expert_dim=2048, hash_layers=3, n_hc=4):
    """Muon matrices of a DeepSeek-V4-Flash-like model from its public config.  -> (dense, experts, adamw numel).

    Shapes are [out, in] as stored. Choices where the config does not pin a shape down (ours):
    - the grouped output projection wo_a is one stored matrix [groups·o_rank, heads·head_dim/groups];
    - layers alternate CSA (m=4, even) and HCA (m=128, odd); a compressor has a KV and a gate projection
      to the head dim, twice as wide under CSA's overlapping windows (two weight sets);
    - CSA layers carry the lightning indexer: query up-projection from the query latent, a key
      projection, per-head weights, and its own compressor at the indexer head dim;
    - mHC: one [n + n + n², n·hidden] projection per hyper-connection, two per layer (attention, FFN);
    - the first `hash_layers` layers route by hash, so they have no router matrix.
    """
    dense = []
    for layer in layers:
        csa = layer % 2 == 0
        width = 2 if csa else 1
        dense += [(q_rank, hidden), (heads * head_dim, q_rank), (head_dim, hidden),     # wq_a, wq_b, wkv
                  (o_groups * o_rank, heads * head_dim // o_groups), (hidden, o_groups * o_rank),  # wo_a, wo_b
                  (width * head_dim, hidden), (width * head_dim, hidden)]             # compressor kv, gate
        if csa:
            dense += [(index_heads * index_dim, q_rank), (index_dim, hidden), (index_heads, hidden),
                      (2 * index_dim, hidden), (2 * index_dim, hidden)]
        dense += [(expert_dim, hidden), (expert_dim, hidden), (hidden, expert_dim)]   # shared expert
        if layer >= hash_layers:
            dense.append((experts, hidden))                                           # router
        dense += [(2 * n_hc + n_hc * n_hc, n_hc * hidden)] * 2                        # mHC projections
    down = [(hidden, expert_dim)] * (len(layers) * experts)
    up = gate = [(expert_dim, hidden)] * (len(layers) * experts)
    adamw = 2 * 129280 * hidden + len(layers) * (4 * hidden) + hidden  # embedding, head, norms (mHC biases ~0)
    return dense, down + up + gate, adamw


def record_rank_timeline(rank, world, zero_width=None, steps=2, optimizer="muon_zero"):
    """One rank's memory timeline for the notebook (run on W gloo ranks through tests/harness.py, or alone).

    optimizer: "muon_zero" (sharded; at world 1 this is replicated Muon) or "adamw" (torch's, replicated).
    """
    from memory_timeline import MemoryTimeline
    torch.manual_seed(0)
    model = mz.TinyMoE(vocab=512, dim=96, heads=4, kv_dim=24, layers=2, experts=8, ffn=96)
    if optimizer == "adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95))
    else:
        opt = mz.MuonZeRO(mz.muon_param_groups(model), lr=0.02, zero_width=zero_width)
    x = torch.randint(0, 512, (4, 16), generator=torch.Generator().manual_seed(rank))
    tl = MemoryTimeline(model=model, optimizer=opt, name=f"{optimizer} rank {rank} of {world}")
    with tl.record():
        for step in range(steps):
            with tl.phase("forward", step):
                loss = F.cross_entropy(model(x).flatten(0, 1), x.flatten())
            with tl.phase("backward", step):
                loss.backward()
            with tl.phase("optimizer", step):
                opt.step()
                opt.zero_grad()
                if optimizer != "adamw":  # MuonZeRO keeps its stacked momentum outside .state
                    tl.tag(opt.local_state_tensors(), "optimizer_state")
    return tl


def table(rows, headers):
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    line = lambda cells: "  ".join(c.rjust(w) for c, w in zip(cells, widths))  # noqa: E731
    return "\n".join([line(headers), line(["-" * w for w in widths])] + [line(r) for r in rows])


def plan_rows(dense, experts, settings):
    rows = []
    for dp, cap in settings:
        plans = {b: mz.plan_muon(dense, experts if b == "both" else [], dp, cap, balance=b)
                 for b in ("ns_cost", "numel", "both")}
        s = {b: p.summary() for b, p in plans.items()}
        rows.append([str(dp), str(cap), str(dp // cap)]
                    + [f"{s[b]['max_dense_per_rank']} / {100 * s[b]['dense_padding']:.1f}% / {s[b]['dense_imbalance']:.2f}"
                       for b in ("ns_cost", "numel", "both")]
                    + [str(s["both"]["max_experts_per_rank"]), f"{100 * s['both']['expert_padding']:.2f}%"])
    return rows


PLAN_HEADERS = ["dp", "cap", "replicas", "by NS cost", "by elements", "by both (default)", "experts/rank",
                "MoE pad"]


def bench_plan():
    dense, experts, adamw = v4_flash_inventory()
    dense_numel = sum(n * m for n, m in dense)
    expert_numel = sum(n * m for n, m in experts)
    print(f"V4-Flash-like inventory: {len(dense)} dense matrices ({dense_numel / 1e9:.2f} B elements, "
          f"{len(set(dense))} distinct shapes, largest {max(n * m for n, m in dense) / 1e6:.1f} M), "
          f"{len(experts)} expert matrices ({expert_numel / 1e9:.1f} B), AdamW {adamw / 1e9:.2f} B")
    print("\nTable 1. Ownership plan for the whole model (no pipeline parallelism). 'cap' is the ZeRO width; dp/cap\n"
          "replica groups repeat the dense updates. Each packing cell: max dense matrices per rank / padding of\n"
          "the dense buckets (padded to the largest) / NS-cost imbalance (max / mean per rank).")
    settings = [(dp, cap) for dp in (8, 16, 32, 64, 128, 256) for cap in sorted({min(dp, 64), dp})]
    print(table(plan_rows(dense, experts, settings), PLAN_HEADERS))
    stage = range(8, 14)  # one of 8 pipeline stages: 6 of the 43 layers (layers 8-13)
    s_dense, s_experts, _ = v4_flash_inventory(layers=stage)
    print(f"\nTable 1b. The same for one pipeline stage (layers 8-13 of 43, as with 8 stages): {len(s_dense)} dense\n"
          "matrices. Whole matrices cannot pad below (largest matrix) / (mean bucket) - 1; compare with V4's\n"
          "'<= 5 matrices per rank, < 10% padding'.")
    print(table(plan_rows(s_dense, s_experts, [(dp, dp) for dp in (8, 16, 32, 64)]), PLAN_HEADERS))
    memory = []
    for dp in (8, 16, 32, 64, 128, 256):
        plan = mz.plan_muon(dense, experts, dp, dp)
        per_rank = max(r["numel"] + r["dense_padding"] + r["expert_padding"] for r in plan.rows())
        memory.append([str(dp), f"{4 * per_rank / 2**30:.2f}", f"{8 * adamw / 2**30:.2f}",
                       f"{4 * (dense_numel + expert_numel) / 2**30:.1f}",
                       f"{8 * (dense_numel + expert_numel + adamw) / 2**30:.1f}"])
    print("\nTable 2. fp32 optimizer state per rank at V4-Flash scale, GiB (whole model, no width cap). MuonZeRO: one\n"
          "momentum per Muon element, sharded (padding included), plus replicated AdamW moments for embedding/head.")
    print(table(memory, ["dp", "MuonZeRO Muon", "+ AdamW part", "replicated Muon", "replicated AdamW (all)"]))


def ring_bf16(grads):
    """A bf16 ring reduce-scatter for one chunk: the running sum is rounded to bf16 at every hop."""
    acc = grads[0].to(torch.bfloat16)
    for g in grads[1:]:
        acc = (acc.float() + g.to(torch.bfloat16).float()).to(torch.bfloat16)
    return acc.double()


def bench_sync_error():
    g = torch.Generator().manual_seed(0)
    N, rows = 1 << 20, []
    for world in (2, 4, 8, 16, 32, 64):
        # Per-rank gradients: a shared signal plus rank-specific noise of larger size, as micro-batches give.
        signal = torch.randn(N, generator=g) * 1e-3
        grads = [signal + 3e-3 * torch.randn(N, generator=g) for _ in range(world)]
        exact = torch.stack([x.double() for x in grads]).sum(0)
        fp32 = torch.stack(grads).sum(0).double()
        sr = torch.stack([mz.stochastic_round_to_bf16(x, generator=g).float() for x in grads]).sum(0).double()
        rne = torch.stack([x.to(torch.bfloat16).float() for x in grads]).sum(0).double()
        ring = ring_bf16(grads)
        scale = exact.norm()
        err = lambda est: ((est - exact).norm() / scale).item()  # noqa: E731
        # Bias: the error's component along the true sum, relative (+ = too large, - = shrunk).
        bias = lambda est: ((est - exact) @ exact / scale ** 2).item()  # noqa: E731
        rows.append([str(world), f"{err(sr):.2e}", f"{bias(sr):+.1e}", f"{err(rne):.2e}", f"{bias(rne):+.1e}",
                     f"{err(ring):.2e}", f"{bias(ring):+.1e}", f"{err(fp32):.1e}", f"{err(ring) / err(sr):.1f}x"])
    print("\nTable 3. Gradient-sum error vs an fp64 sum (2^20 elements per rank; relative L2 error and bias along\n"
          "the true sum). V4: each rank's gradient stochastically rounded to bf16 once, all-to-all, fp32 sum.\n"
          "Ring: bf16 partial sums re-rounded (to nearest) at each of the world-1 hops.")
    print(table(rows, ["ranks", "SR a2a err", "SR bias", "RNE a2a err", "RNE bias", "bf16 ring err", "ring bias",
                       "fp32 err", "ring/SR"]))


def timed(fn, repeat=3):
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def bench_speed():
    rows = []
    for count, shape in ((64, (64, 128)), (16, (128, 256)), (4, (256, 512))):
        X = torch.randn(count, *shape)
        one = timed(lambda: [mz.newton_schulz(x, mz.V4_NS_COEFFICIENTS) for x in X])
        batched = timed(lambda: mz.newton_schulz(X, mz.V4_NS_COEFFICIENTS))
        rows.append([f"{count} x {shape[0]}x{shape[1]}", f"{1e3 * one:.1f}", f"{1e3 * batched:.1f}",
                     f"{one / batched:.2f}x"])
    print("\nTable 4. Newton-Schulz, V4 schedule (10 iterations, bf16), best of 3: a loop over the matrices vs one\n"
          "batched call on their stack.")
    print(table(rows, ["matrices", "per-matrix ms", "batched ms", "speed-up"]))

    torch.manual_seed(0)
    model = mz.TinyMoE(vocab=256, dim=128, heads=8, kv_dim=32, layers=4, experts=8, ffn=128)
    x = torch.randint(0, 256, (8, 64))
    loss = F.cross_entropy(model(x).flatten(0, 1), x.flatten())
    loss.backward()
    groups = mz.muon_param_groups(model)
    adamw_params = [p for g in groups if g["role"] == "adamw" for p in g["params"]]
    dense = [p for g in groups if g["role"] == "dense" for p in g["params"]]
    stacks = [p for g in groups if g["role"].startswith("expert") for p in g["params"]]
    # torch.optim.Muon takes 2-D parameters only: give it each expert as its own leaf with its gradient.
    expert_leaves = [e.detach().clone().requires_grad_() for s in stacks for e in s]
    for leaf, grad in zip(expert_leaves, (e for s in stacks for e in s.grad)):
        leaf.grad = grad.clone()
    torch_muon = torch.optim.Muon(dense + expert_leaves, lr=0.02, adjust_lr_fn="match_rms_adamw")
    torch_adam = torch.optim.AdamW(adamw_params, lr=3e-3, betas=(0.9, 0.95))
    ours_std = mz.MuonZeRO(mz.muon_param_groups(model), lr=0.02, ns_coefficients=mz.STANDARD_NS_COEFFICIENTS,
                           update_rms=0.2)
    ours_v4 = mz.MuonZeRO(mz.muon_param_groups(model), lr=0.02)
    t_torch = timed(lambda: (torch_muon.step(), torch_adam.step()))
    t_std = timed(ours_std.step)
    t_v4 = timed(ours_v4.step)
    n = sum(p.numel() for p in model.parameters())
    print(f"\nTable 5. Optimizer step time, one process, TinyMoE with {n / 1e6:.1f} M parameters "
          f"({len(dense)} dense matrices, {len(expert_leaves)} expert matrices), best of 3.")
    print(table([["torch.optim.Muon + AdamW (5 NS iterations)", f"{1e3 * t_torch:.1f}", "1.00x"],
                 ["MuonZeRO, standard 5 NS iterations", f"{1e3 * t_std:.1f}", f"{t_std / t_torch:.2f}x"],
                 ["MuonZeRO, V4 schedule (10 NS iterations)", f"{1e3 * t_v4:.1f}", f"{t_v4 / t_torch:.2f}x"]],
                ["optimizer", "ms / step", "vs torch"]))


if __name__ == "__main__":
    t0 = time.time()
    bench_plan()
    bench_sync_error()
    bench_speed()
    print(f"\n(total {time.time() - t0:.0f} s, torch {torch.__version__}, {torch.get_num_threads()} threads)")
