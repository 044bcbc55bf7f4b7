"""Correct bodies for memory/memory_timeline.py's regions, each written unlike the reference."""

from tests.alternatives import Alternative

ALTERNATIVES = [
    Alternative(
        region="memory_timeline.MemoryTimeline._held_for_backward",
        name="walk the live storages, look up where each was made",
        body="""
### BEGIN SOLUTION
held = set()
for sid in list(self._refs):
    if self._origin.get(sid) == "forward":
        held.add(sid)
return held
### END SOLUTION
""",
    ),
    Alternative(
        region="memory_timeline.predicted_optimizer_state_bytes",
        name="buffers counted per group, bytes from nbytes, step dtype from a probe tensor",
        body="""
### BEGIN SOLUTION
def buffers(opt, group):
    if isinstance(opt, torch.optim.Adam):
        return 3 if group["amsgrad"] else 2
    if isinstance(opt, torch.optim.SGD):
        return 1 if group["momentum"] else 0
    return 1

nbytes = 0
for opt in optimizers:
    for group in opt.param_groups:
        count = buffers(opt, group)
        beside = bool(group.get("fused")) or bool(group.get("capturable"))
        step_dtype = torch.float32 if group.get("fused") else torch.get_default_dtype()
        step_size = torch.empty((), dtype=step_dtype).element_size()
        for p in group["params"]:
            if _on_device(p.device, device):
                nbytes += count * p.nbytes
            if isinstance(opt, torch.optim.Adam):
                if _on_device(p.device if beside else torch.device("cpu"), device):
                    nbytes += step_size
return nbytes
### END SOLUTION
""",
    ),
]
