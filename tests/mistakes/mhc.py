"""Plausible wrong bodies for mhc.py's solution regions (see tests/mistakes/__init__.py)."""

from tests.mistakes import Mistake

MISTAKES = [
    Mistake(
        region="mhc.sinkhorn_knopp",
        name="rows first: softmax along rows, columns normalised last",
        message="B is normalised rows first",
        edits=(
            (
                (
                    "matrix = torch.softmax(logits, dim=-2) + eps  # round 1's column step\n"
                    "matrix = matrix / (matrix.sum(dim=-1, keepdim=True) + eps)  #"
                    " round 1's row step"
                ),
                (
                    "matrix = torch.softmax(logits, dim=-1) + eps\n"
                    "matrix = matrix / (matrix.sum(dim=-2, keepdim=True) + eps)"
                ),
            ),
            (
                "for _ in range(iters - 1):",
                (
                    "for _ in range(iters - 1):\n"
                    "    matrix = matrix / (matrix.sum(dim=-1, keepdim=True) + eps)"
                ),
            ),
            ("    matrix = matrix / (matrix.sum(dim=-1, keepdim=True) + eps)  # rows\n", ""),
        ),
    ),
    Mistake(
        region="mhc.sinkhorn_knopp",
        name="no eps in the sums",
        message="NaN or inf at logits of +-60",
        edits=(
            (
                (
                    "matrix = torch.softmax(logits, dim=-2) + eps  # round 1's column step\n"
                    "matrix = matrix / (matrix.sum(dim=-1, keepdim=True) + eps)  #"
                    " round 1's row step"
                ),
                (
                    "matrix = torch.softmax(logits, dim=-2)\n"
                    "matrix = matrix / matrix.sum(dim=-1, keepdim=True)"
                ),
            ),
            ("(matrix.sum(dim=-2, keepdim=True) + eps)", "matrix.sum(dim=-2, keepdim=True)"),
            (
                " matrix = matrix / (matrix.sum(dim=-1, keepdim=True) + eps)",
                " matrix = matrix / matrix.sum(dim=-1, keepdim=True)",
            ),
        ),
    ),
    Mistake(
        region="mhc.sinkhorn_knopp",
        name="one round too many",
        message="B differs from V4's Sinkhorn",
        edits=(("iters - 1):", "iters):"),),
    ),
    Mistake(
        region="mhc.mhc_coefficients",
        name="A without V4's + eps",
        message="A differs from V4",
        edits=(("dtype)) + EPS", "dtype))"),),
    ),
    Mistake(
        region="mhc.mhc_coefficients",
        name="W_res read column-major (B's logits transposed)",
        message="B differs from V4",
        edits=(("(n, n)) + hc.bias_res.to(dtype),", "(n, n)).mT + hc.bias_res.to(dtype),"),),
    ),
    Mistake(
        region="mhc.mhc_coefficients",
        name="C = sigmoid without the factor 2",
        message="C differs from V4",
        edits=(("2 * torch.sigmoid(gate[1]", "torch.sigmoid(gate[1]"),),
    ),
    Mistake(
        region="mhc.mhc_coefficients",
        name="RMS norm over each lane instead of the flattened stream",
        message="A differs from V4",
        edits=(
            (
                "flat = stream.flatten(-2).to(dtype)  # [..., n*d]",
                (
                    "lanes = stream.to(dtype)\n"
                    "flat = (lanes * torch.rsqrt(lanes.pow(2).mean(-1, keepdim=True)"
                    " + EPS)).flatten(-2)"
                ),
            ),
            (
                (
                    "logits = (flat * torch.rsqrt(flat.pow(2).mean(-1, keepdim=True)"
                    " + EPS)) @ proj\n"
                    "pre, post, res = logits.split([n, n, n * n], dim=-1)"
                ),
                "pre, post, res = (flat @ proj).split([n, n, n * n], dim=-1)",
            ),
        ),
    ),
    Mistake(
        region="mhc.post_mix_backward",
        name="dX through B instead of B^T",
        message="dX differs from autograd",
        edits=(("b.transpose(-1, -2),", "b,"),),
    ),
    Mistake(
        region="mhc.post_mix_backward",
        name="dB transposed (X dX'^T)",
        message="dB differs from autograd",
        edits=(("grad_out, stream.transpose(-1,", "stream, grad_out.transpose(-1,"),),
    ),
    Mistake(
        region="mhc.post_mix_backward",
        name="df without C (the sum of dX' over lanes)",
        message="df differs from autograd",
        edits=(("lanes_matmul(c.unsqueeze(-2), grad_out).squeeze(-2)", "grad_out.sum(-2)"),),
    ),
    Mistake(
        region="mhc.RecomputedBlock.backward",
        name="one lane state too many rebuilt: each layer reads the next layer's input",
        message="backward must read its own input X_",
        edits=(
            ("n_layers if head is not None else n_layers - 1):", "n_layers):"),
            ("states.pop(),", "states[-1],"),
        ),
    ),
    Mistake(
        region="mhc.RecomputedBlock.backward",
        name="F run again in backward instead of its kept graph",
        message="F must run once per layer",
        edits=(
            ("(_, hc), (h, f),", "(sublayer, hc), (h, _),"),
            (
                "    torch.autograd.backward(f, grad_f)",
                (
                    "    h = h.detach().requires_grad_()\n"
                    "    with torch.enable_grad():\n"
                    "        f = sublayer(h)  # recomputed: F runs twice per step\n"
                    "    torch.autograd.backward(f, grad_f)"
                ),
            ),
        ),
    ),
    Mistake(
        region="mhc.RecomputedBlock.backward",
        name="the post-mix's dX dropped (only the pre-mix path reaches X)",
        message="the gradient passed down from layer",
        edits=(
            ("grad_b, grad_c, grad_x, stream", "grad_b, grad_c, torch.zeros_like(grad_x), stream"),
        ),
    ),
    Mistake(
        region="mhc.one_f_one_b",
        name="warm-up off by one (n_stages - stage forwards)",
        message="the warm-up is n_stages - stage - 1 forwards",
        edits=(("min(n_stages - stage - 1, n_micro)", "min(n_stages - stage, n_micro)"),),
    ),
    Mistake(
        region="mhc.one_f_one_b",
        name="steady state runs the backward before the forward",
        message="the steady state runs a forward, then a backward",
        edits=(('[("F", i), ("B", i - warmup)]', '[("B", i - warmup), ("F", i)]'),),
    ),
    Mistake(
        region="mhc.one_f_one_b",
        name="GPipe: every forward, then every backward",
        message="the warm-up is n_stages - stage - 1 forwards",
        body="""
### BEGIN SOLUTION
return [("F", i) for i in range(n_micro)] + [("B", i) for i in range(n_micro)]
### END SOLUTION
""",
    ),
    Mistake(
        region="mhc.pipeline_step",
        name="micro-batch losses summed, not averaged",
        message="divide each micro-batch's loss by n_micro",
        edits=(("tgt_micro[i]) / n_micro", "tgt_micro[i])"),),
    ),
    Mistake(
        region="mhc.pipeline_step",
        name="variant and block not passed on: every stage runs naive",
        message="pipeline_step ignored variant='optimised'",
        edits=(("variant, block, final=last)", "final=last)"),),
    ),
    Mistake(
        region="mhc.pipeline_step",
        name="last stage scores the next micro-batch's targets",
        message="each micro-batch's idx and targets must stay paired",
        edits=(("tgt_micro[i]) /", "tgt_micro[(i + 1) % n_micro]) /"),),
    ),
    Mistake(
        region="mhc.pipeline_step",
        name="GPipe order: every forward, then every backward (same numbers, all activations held)",
        message="1F1B holds at most n_stages - stage",
        edits=(
            ("_, i in order[:warmup]:", "i in range(n_micro):"),
            (
                (
                    "for kind, i in order[warmup : 2 * n_micro - warmup]:  # steady"
                    " state: one F, one B\n"
                    '    forward(i) if kind == "F" else backward(i)\n'
                    "for _, i in order[2 * n_micro - warmup :]:  # cool-down: the"
                    " last backwards drain it"
                ),
                "for i in range(n_micro):",
            ),
        ),
    ),
]
