# A whole record forged on the real result descriptor: at import the submission finds the pipe
# the grader drew (the one pipe in /proc/self/fd besides the output and the decoy at 3), reads the
# request from the worker's frames, answers it without checkpointing anything (constants of the
# public test, the plain model's outputs and gradients, byte and FLOP counts made up from them),
# writes one well-framed record and exits 0 before the probe can write its own.
# file: tensor_ckpt.py
# target: stub
# where: suffix
# include: forged/record.py
# honest: 0
def _forged_value(probe, args):
    import torch
    from models_tensor_ckpt import MODELS, B, C, H, measured_run

    def plain_run(name, state, x, weights):
        model = MODELS[name]()
        model.load_state_dict(state)
        return measured_run(model, model, x, weights)

    f32 = 4
    if probe == "tensor_ckpt:forget_marks":
        return {"eager_is_x": True, "marked": [["gelu"]], "ops": ["call_function"]}
    if probe == "tensor_ckpt:storage_units_of":  # the public case's answer
        return [[["cpu", 1], ["base", "view"]], [["cpu", 2], ["other"]]]
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
        weights = torch.linspace(-1, 1, x.numel()).view_as(x)
        out = {}
        for name, state in cases:
            ref = plain_run(name, state, x, weights)
            out[name] = {
                "fwd_bytes": ref["fwd_bytes"] - freed[name],
                "bytes_freed": freed[name],
                "out": ref["out"],
            }
        return out
    if probe == "tensor_ckpt:checkpointed":
        name, state, x, weights = args[:4]
        T = x.shape[1]
        out = plain_run(name, state, x, weights)
        out["fwd_bytes"] -= 1
        out["fwd_peak"], out["bwd_peak"] = 0, 0
        unit = {"name": "fc", "members": ["fc", "getitem", "getitem_1"], "nodes": ["fc"]}
        extra = 2 * B * T * C * 2 * C if name == "view_and_base" else 0
        out["plan"] = {"units": [unit], "recompute_flops": extra}
        out["bwd_flops"] += extra
        out["recomputations"] = 1
        return out
    return None
