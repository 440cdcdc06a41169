"""``dslaunch k8s manifest``: the objects validate against Kubeflow Trainer's published API models
(``kubeflow-trainer-api``: Kubernetes' core and batch objects and the TrainJob CRD, as pydantic
models): each loads and dumps back unchanged, so no field is unknown, misspelt or mistyped."""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml

pytestmark = pytest.mark.timeout(60)
models = pytest.importorskip("kubeflow_trainer_api.models", reason="kubeflow-trainer-api is a dev dependency")
MODELS = {"TrainJob": models.TrainerV1alpha1TrainJob, "Job": models.IoK8sApiBatchV1Job,
          "Service": models.IoK8sApiCoreV1Service}


def _manifest(*args: str) -> list[dict]:
    out = subprocess.run([sys.executable, "-m", "dslaunch.launcher.cli", "k8s", "manifest", "--name", "llm",
                          "--image", "reg/img:1", "--nodes", "3", *args, "train.py", "--deepspeed_config", "ds.json"],
                         capture_output=True, text=True, timeout=50)
    assert out.returncode == 0, out.stderr
    return list(yaml.safe_load_all(out.stdout))


@pytest.mark.parametrize("kind, kinds", [("trainjob", ["TrainJob"]), ("job", ["Service", "Job"])])
@pytest.mark.parametrize("extra", [[], ["--gpus_per_node", "8", "--nproc_per_node", "8", "--namespace", "ml"]])
def test_every_object_validates_against_the_published_models(kind, kinds, extra):
    objects = _manifest("--kind", kind, *extra)
    assert [o["kind"] for o in objects] == kinds
    for obj in objects:
        assert MODELS[obj["kind"]].from_dict(obj).to_dict() == obj


def test_the_indexed_job_gives_each_pod_what_a_trainjobs_operator_would():
    service, job = _manifest("--kind", "job", "--nproc_per_node", "2", "--master_port", "23456")
    spec = job["spec"]
    assert (spec["completionMode"], spec["completions"], spec["parallelism"]) == ("Indexed", 3, 3)
    pod = spec["template"]["spec"]
    assert pod["subdomain"] == service["metadata"]["name"] == "llm" and service["spec"]["clusterIP"] == "None"
    container = pod["containers"][0]
    assert container["command"] == ["dslaunch", "train.py", "--deepspeed_config", "ds.json"]
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env == {"PET_NNODES": "3", "PET_MASTER_ADDR": "llm-0.llm", "PET_MASTER_PORT": "23456",
                   "PET_NPROC_PER_NODE": "2"}
    # what dslaunch makes of it in pod 2 (JOB_COMPLETION_INDEX is Kubernetes' own)
    from dslaunch.launcher.kubernetes import Pod, pod_from_env

    assert pod_from_env({**env, "JOB_COMPLETION_INDEX": "2"}) == Pod(3, 2, "llm-0.llm", 23456, 2)


def test_a_bad_option_is_one_line():
    out = subprocess.run([sys.executable, "-m", "dslaunch.launcher.cli", "k8s", "manifest", "--name", "x",
                          "--image", "i", "--nodes", "0", "t.py"], capture_output=True, text=True, timeout=50)
    assert out.returncode == 2 and "--nodes" in out.stderr and "Traceback" not in out.stderr
