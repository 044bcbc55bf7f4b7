# The whole record forged on the real result descriptor, as tensor_ckpt_record.py forges it, but
# with what a careful student could work out from the kit alone: the plain model's outputs and
# gradients (checkpointing changes no value), the public cases' bytes and recomputed ops, and the
# public chain's costs copied from the kit's stored expected values. Nothing is checkpointed. At
# grading time the chain is drawn, and the measured tests count only beside its costs.
# file: tensor_ckpt.py
# target: stub
# where: suffix
# include: forged/record.py
# honest: 0
def _forged_value(probe, args):
    import torch
    from models_tensor_ckpt import B, C, H, build, measured_run

    def plain_run(name, state, x, weights):
        model = build(name)
        model.load_state_dict(state)
        return measured_run(model, model, x, weights)

    f32 = 4
    roots = {
        "mlp": {"aten.gelu.default": 1},
        "attention": {"aten._softmax.default": 1},
        "block": {"aten.native_layer_norm.default": 2, "aten.gelu.default": 1},
        "view_and_base": {"aten.addmm.default": 1},
        "attention_qkv": {},
        "stack": {"aten.native_layer_norm.default": 8, "aten.gelu.default": 4},
    }

    chain = {  # the public chain's costs, as the kit's tests/graded/stored/tensor_ckpt.pt has them
        "freed": 12288,
        "extra_ops": {"aten.tanh.default": 1, "aten.addmm.default": 1, "aten.gelu.default": 1,
                      "aten.relu.default": 1, "aten.sin.default": 1},
    }  # fmt: skip

    def add_ops(out, name):
        ops = dict(out["bwd_ops"])
        for op, n in (chain["extra_ops"] if name.startswith("chain:") else roots[name]).items():
            ops[op] = ops.get(op, 0) + n
        return ops

    if probe == "tensor_ckpt:forward_bytes":
        cases, x = args[:2]
        T = x.shape[1]
        freed = {
            "mlp": B * T * 4 * C * f32,
            "block": (2 * B * T * C + B * T * 4 * C) * f32,
            "view_and_base": B * T * 2 * C * f32,
            "attention": (B * H * T * T + B * T * C) * f32,
            "attention_qkv": 0,
        }
        freed.update({name: chain["freed"] for name, _ in cases if name.startswith("chain:")})
        weights = torch.linspace(-1, 1, x.numel()).view_as(x)
        out = {}
        for name, state in cases:
            ref = plain_run(name, state, x, weights)
            out[name] = {
                "fwd_bytes": ref["fwd_bytes"] - freed[name],
                "bytes_freed": freed[name],
                "out": ref["out"],
                "bwd_ops": add_ops(ref, name),
            }
        return out
    if probe == "tensor_ckpt:checkpointed":
        name, state, x, weights = args[:4]
        T = x.shape[1]
        out = plain_run(name, state, x, weights)
        out["fwd_bytes"] -= chain["freed"] if name.startswith("chain:") else 1
        out["fwd_peak"], out["bwd_peak"] = 0, 0
        unit = {"name": "fc", "members": ["fc", "getitem", "getitem_1"], "nodes": ["fc"]}
        extra = 2 * B * T * C * 2 * C if name == "view_and_base" else 0
        if name.startswith("chain:"):
            extra = chain["extra_ops"].get("aten.addmm.default", 0) * 2 * B * T * C * C
        out["plan"] = {"units": [unit], "recompute_flops": extra}
        out["bwd_flops"] += extra
        out["bwd_ops"] = add_ops(out, name)
        return out
    return None
