"""Plausible wrong solutions for memory/memory_timeline.py's regions, each with the first line it
must get."""

from tests.mistakes import Mistake

PREDICT_BODY = """
### BEGIN SOLUTION
total = 0
for opt in optimizers:
    for group in opt.param_groups:
        for p in group["params"]:
            like_p = p.numel() * p.element_size() if _on_device(p.device, device) else 0
            if isinstance(opt, torch.optim.Adam):
                total += (3 if group["amsgrad"] else 2) * like_p
                on_device = bool(group["fused"] or group["capturable"])
                step_device = p.device if on_device else torch.device("cpu")
                if _on_device(step_device, device):
                    total += 4
            elif isinstance(opt, torch.optim.SGD):
                total += like_p if group["momentum"] != 0 else 0
            else:  # Muon
                total += like_p
return total
### END SOLUTION
"""


def _swap(body, old, new):
    assert old in body, old
    return body.replace(old, new)


MISTAKES = [
    Mistake(
        region="memory_timeline.MemoryTimeline._held_for_backward",
        name="every live storage counted as held for backward",
        message="not every live storage",
        body="""
### BEGIN SOLUTION
return set(self._refs)
### END SOLUTION
""",
    ),
    Mistake(
        region="memory_timeline.MemoryTimeline._held_for_backward",
        name="every storage the forward allocated, freed or not",
        message="still alive as it ends",
        body="""
### BEGIN SOLUTION
return {sid for sid, origin in self._origin.items() if origin == "forward"}
### END SOLUTION
""",
    ),
    Mistake(
        region="memory_timeline.predicted_optimizer_state_bytes",
        name="AdamW's step counters always beside the parameters",
        message="the `step` counters stay on the CPU",
        body=_swap(PREDICT_BODY, 'p.device if on_device else torch.device("cpu")', "p.device"),
    ),
    Mistake(
        region="memory_timeline.predicted_optimizer_state_bytes",
        name="amsgrad's third buffer forgotten",
        message="on the CPU: predicted",
        body=_swap(PREDICT_BODY, '(3 if group["amsgrad"] else 2)', "2"),
    ),
    Mistake(
        region="memory_timeline.predicted_optimizer_state_bytes",
        name="SGD's momentum buffer counted without momentum",
        message="on the CPU: predicted",
        body=_swap(PREDICT_BODY, 'like_p if group["momentum"] != 0 else 0', "like_p"),
    ),
]
