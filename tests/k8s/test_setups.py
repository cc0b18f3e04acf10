"""What each kept setup deploys: the resources, storage and secrets its values promise."""

from __future__ import annotations

from raytp.serve.args import SERVE_ENV_DEFAULTS
from tests.k8s.chart import cluster_spec, container_env, load_values, of_kind, one, pod_templates, render, serve_config


def _containers(template: dict) -> list[dict]:
    return template["spec"]["containers"]


def test_cpu_small_runs_the_embedded_model_on_cpu_workers() -> None:
    objs = render(load_values("cpu-small"))
    service = one(objs, "RayService")
    spec = cluster_spec(service)
    assert spec["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"  # no model replica on the head
    (group,) = spec["workerGroupSpecs"]
    assert (group["replicas"], group["minReplicas"], group["maxReplicas"]) == (1, 1, 1)
    for _, template in pod_templates(service):
        (container,) = _containers(template)
        assert container["image"] == "raytp:0.1.0-cpu"
        assert not any("gpu" in k for k in container["resources"].get("limits", {}))
        assert not any(m["name"] == "model" for m in container.get("volumeMounts", []))
        # every node runs a Serve HTTP proxy; each must validate X-Request-Id (issue 8)
        proxy_hook = container_env(template)["RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"]
        assert proxy_hook == "raytp.openai.request_id:proxy_middlewares"
        # Serve's high-throughput mode, as `raytp serve` starts Ray with it
        assert SERVE_ENV_DEFAULTS.items() <= container_env(template).items()
    args = serve_config(objs)["applications"][0]["args"]
    assert "model" not in args and args["device"] == "cpu" and args["num_replicas"] == 1
    assert container_env(group["template"])["RAYTP_CPUS_PER_WORKER"] == "3"


def test_gpu_tp2_gives_each_of_two_replicas_two_gpus() -> None:
    objs = render(load_values("gpu-tp2"))
    service = one(objs, "RayService")
    (group,) = cluster_spec(service)["workerGroupSpecs"]
    assert (group["replicas"], group["minReplicas"], group["maxReplicas"]) == (2, 2, 2)
    (container,) = _containers(group["template"])
    assert container["image"] == "raytp:0.1.0-gpu"
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert container["resources"]["requests"]["nvidia.com/gpu"] == 2
    assert container["resources"]["limits"]["cpu"] == "10"  # the values' own limits are kept
    pod = group["template"]["spec"]
    assert pod["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    args = serve_config(objs)["applications"][0]["args"]
    assert (args["tensor_parallel_size"], args["num_replicas"]) == (2, 2)
    assert args["model"] == "/models/qwen2.5-7b-instruct"
    # The model claim is mounted read-only wherever the tokenizer or the weights are read.
    for _, template in pod_templates(service):
        mounts = {m["name"]: m for m in _containers(template)[0]["volumeMounts"]}
        assert mounts["model"] == {"name": "model", "mountPath": "/models", "readOnly": True}
        volumes = {v["name"]: v for v in template["spec"]["volumes"]}
        assert volumes["model"]["persistentVolumeClaim"] == {"claimName": "models", "readOnly": True}
    assert cluster_spec(service)["headGroupSpec"]["template"]["spec"].get("tolerations") is None


def test_gpus_per_pod_can_hold_several_replicas() -> None:
    values = {
        "engine": {"tensor_parallel_size": 2},
        "serving": {"numReplicas": 3},
        "worker": {"gpu": {"enabled": True, "perPod": 4}},
    }
    (group,) = cluster_spec(one(render(values), "RayService"))["workerGroupSpecs"]
    assert group["replicas"] == 2  # ceil(3 replicas / (4 GPUs / TP 2))
    assert _containers(group["template"])[0]["resources"]["limits"]["nvidia.com/gpu"] == 4


def test_batch_runs_a_retryable_rayjob_on_the_data_claim() -> None:
    objs = render(load_values("batch"))
    assert not of_kind(objs, "RayService")
    job = one(objs, "RayJob")
    assert job["spec"]["backoffLimit"] == 3 and job["spec"]["shutdownAfterJobFinishes"] is True
    (group,) = cluster_spec(job)["workerGroupSpecs"]
    assert group["replicas"] == 2  # one pod per engine replica
    for _, template in pod_templates(job):
        env = container_env(template)
        assert env["HF_TOKEN"] == {"secretKeyRef": {"name": "hf-token", "key": "token"}}
        assert env["HF_HOME"] == "/home/ray/.cache/huggingface"
        assert "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH" not in env  # a batch job runs no proxy
        volumes = {v["name"]: v for v in template["spec"]["volumes"]}
        assert volumes["batch-data"]["persistentVolumeClaim"] == {"claimName": "batch-data"}
        assert volumes["hf-cache"]["persistentVolumeClaim"] == {"claimName": "raytp-hf-cache"}
    claim = one(objs, "PersistentVolumeClaim")
    assert claim["metadata"]["name"] == "raytp-hf-cache"
    assert claim["spec"]["resources"]["requests"]["storage"] == "20Gi"


def test_hf_cache_without_a_claim_is_an_empty_dir() -> None:
    values = {"model": {"source": "huggingface", "huggingface": {"id": "org/model"}}}
    objs = render(values)
    assert not of_kind(objs, "PersistentVolumeClaim")
    for _, template in pod_templates(one(objs, "RayService")):
        volumes = {v["name"]: v for v in template["spec"]["volumes"]}
        assert volumes["hf-cache"] == {"name": "hf-cache", "emptyDir": {}}
        assert "HF_TOKEN" not in container_env(template)


def test_scaling_headroom_is_the_autoscalers_ceiling() -> None:
    """KubeRay never copies changed replica counts onto a RayService's running cluster: new model
    replicas get their pods from the in-tree autoscaler, up to the ceiling set at install."""
    cluster = cluster_spec(one(render({"serving": {"numReplicas": 2}, "worker": {"maxReplicas": 6}}), "RayService"))
    assert cluster["enableInTreeAutoscaling"] is True
    (group,) = cluster["workerGroupSpecs"]
    assert (group["replicas"], group["minReplicas"], group["maxReplicas"]) == (2, 2, 6)


def test_upgrade_strategy_is_passed_to_kuberay() -> None:
    values = {
        "rayService": {
            "upgradeStrategy": {
                "type": "NewClusterWithIncrementalUpgrade",
                "clusterUpgradeOptions": {"gatewayClassName": "istio", "stepSizePercent": 25, "intervalSeconds": 60},
            }
        },
    }
    strategy = one(render(values), "RayService")["spec"]["upgradeStrategy"]
    assert strategy == {
        "type": "NewClusterWithIncrementalUpgrade",
        "clusterUpgradeOptions": {"gatewayClassName": "istio", "stepSizePercent": 25, "intervalSeconds": 60},
    }
