"""``dslaunch k8s manifest``: the Kubernetes objects that run a dslaunch job (printed as YAML).

A thin click command over ``launcher.kubernetes.manifests``; ``kubectl apply -f -`` takes its
output. In every pod, ``dslaunch SCRIPT ARGS`` reads the PET_* variables (see that module).
"""

from __future__ import annotations

import click

__all__ = ["command"]


@click.group("k8s")
def command() -> None:
    """Kubernetes: manifests for a dslaunch job (each pod runs `dslaunch SCRIPT ARGS`)."""


@command.command("manifest", context_settings={"ignore_unknown_options": True})
@click.option("--name", required=True, help="The job's name (also the headless service's, for --kind job).")
@click.option("--image", required=True, help="The container image with dslaunch and the script.")
@click.option("--nodes", type=click.IntRange(1), required=True, help="Pods (nodes) in the job.")
@click.option("--nproc_per_node", type=click.IntRange(1), default=None,
              help="Workers per pod (default: the pod's GPUs).")
@click.option("--gpus_per_node", type=click.IntRange(0), default=0, help="nvidia.com/gpu limit of each pod.")
@click.option("--namespace", default=None, help="The objects' namespace (default: kubectl's).")
@click.option("--master_port", type=click.IntRange(1, 65535), default=29500, help="Pod 0's rendezvous port.")
@click.option("--kind", type=click.Choice(["trainjob", "job"]), default="trainjob",
              help="trainjob: a Kubeflow Trainer TrainJob; job: an indexed Job + headless Service (no operator).")
@click.option("--runtime", default="torch-distributed", help="The Trainer runtime a TrainJob refers to.")
@click.argument("script")
@click.argument("script_args", nargs=-1, type=click.UNPROCESSED)
def manifest(name: str, image: str, nodes: int, nproc_per_node: int | None, gpus_per_node: int, namespace: str | None,
             master_port: int, kind: str, runtime: str, script: str, script_args: tuple[str, ...]) -> int:
    """Print the manifests (YAML) that run `dslaunch SCRIPT ARGS` in NODES pods."""
    import yaml

    from dslaunch.launcher.kubernetes import JobShape, manifests

    shape = JobShape(name=name, image=image, nodes=nodes, command=("dslaunch", script, *script_args),
                     nproc_per_node=nproc_per_node, gpus_per_node=gpus_per_node, namespace=namespace,
                     master_port=master_port, runtime=runtime)
    click.echo(yaml.safe_dump_all(manifests(shape, kind), sort_keys=False), nl=False)
    return 0
