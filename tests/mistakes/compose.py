"""Plausible wrong bodies for compose.py's solution region (see tests/mistakes/__init__.py)."""

from tests.mistakes import Mistake

MISTAKES = [
    Mistake(
        region="compose.layout_groups",
        name="the optimizer over the data-parallel replicas only",
        message="MuonZeRO's group must hold every rank of the stage",
        body="""
### BEGIN SOLUTION
mesh = init_device_mesh(device_type, (pp, cp, dp), mesh_dim_names=("pp", "cp", "dp"))
pipelines = mesh.mesh.permute(1, 2, 0).reshape(-1, pp).tolist()
backward, _ = dist.new_subgroups_by_enumeration(pipelines)
pipeline = {"forward": mesh["pp"].get_group(), "backward": backward}
stage = mesh["dp"].get_group()
return Layout(pp, cp, dp, tuple(mesh.get_coordinate()), pipeline, mesh["cp"].get_group(),
              stage)
### END SOLUTION
""",
    ),
    Mistake(
        region="compose.layout_groups",
        name="one process group for both pipeline directions",
        message="the pipeline needs two process groups",
        body="""
### BEGIN SOLUTION
mesh = init_device_mesh(device_type, (pp, cp, dp), mesh_dim_names=("pp", "cp", "dp"))
pipeline = {"forward": mesh["pp"].get_group(), "backward": mesh["pp"].get_group()}
stage = mesh["cp", "dp"]._flatten().get_group()
return Layout(pp, cp, dp, tuple(mesh.get_coordinate()), pipeline, mesh["cp"].get_group(),
              stage)
### END SOLUTION
""",
    ),
    Mistake(
        region="compose.layout_groups",
        name="the mesh's dimensions in the wrong order (pp innermost)",
        message="dp innermost",
        body="""
### BEGIN SOLUTION
mesh = init_device_mesh(device_type, (dp, cp, pp), mesh_dim_names=("dp", "cp", "pp"))
pipelines = mesh.mesh.reshape(-1, pp).tolist()
backward, _ = dist.new_subgroups_by_enumeration(pipelines)
pipeline = {"forward": mesh["pp"].get_group(), "backward": backward}
stage = mesh["dp", "cp"]._flatten().get_group()
d, c, p = mesh.get_coordinate()
return Layout(pp, cp, dp, (p, c, d), pipeline, mesh["cp"].get_group(), stage)
### END SOLUTION
""",
    ),
]
