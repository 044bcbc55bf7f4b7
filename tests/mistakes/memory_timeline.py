"""Plausible wrong solutions for memory/memory_timeline.py's regions, each with the first line it
must get."""

from tests.mistakes import Mistake

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
        edits=(
            (
                'step_device = p.device if on_device else torch.device("cpu")',
                "step_device = p.device",
            ),
        ),
    ),
    Mistake(
        region="memory_timeline.predicted_optimizer_state_bytes",
        name="amsgrad's third buffer forgotten",
        message="on the CPU: predicted",
        edits=(('(3 if group["amsgrad"] else 2)', "2"),),
    ),
    Mistake(
        region="memory_timeline.predicted_optimizer_state_bytes",
        name="SGD's momentum buffer counted without momentum",
        message="on the CPU: predicted",
        edits=(('like_p if group["momentum"] != 0 else 0', "like_p"),),
    ),
]
