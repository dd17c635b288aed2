"""deploy/k8s: the kustomization renders; every built-in object passes the Kubernetes OpenAPI
schemas offline (kubernetes-validate, strict: unknown fields fail); the Gateway API Inference
Extension objects carry the fields its docs define; the pieces point at each other (selectors,
ports, the picker's pool and metric names); and `tokstream serve` starts with the Deployment's
own arguments and files, answering the probes' paths."""

from __future__ import annotations

import copy
import shutil
import subprocess

import httpx
import jsonschema
import kubernetes_validate
import pytest
import yaml

from helpers.metrics_series import exported_series
from helpers.serving import ROOT, ServerProcess

K8S = ROOT / "deploy" / "k8s"
# The oldest Kubernetes still commonly run (grpc probes and policy/v1 need >= 1.24) and the
# newest schema kubernetes-validate carries.
VERSIONS = ("1.30.0", kubernetes_validate.utils.latest_version())
EXTENSION_KINDS = {"InferencePool", "HTTPRoute", "PodMonitor"}

pytestmark = pytest.mark.timeout(120)


def render(directory=K8S) -> list[dict]:
    """`kubectl kustomize`, or without kubectl the listed resources and generators by hand."""
    kubectl = shutil.which("kubectl")
    if kubectl is not None:
        result = subprocess.run([kubectl, "kustomize", str(directory)], capture_output=True,
                                text=True, timeout=60)
        assert result.returncode == 0, result.stderr
        return [doc for doc in yaml.safe_load_all(result.stdout) if doc]
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    docs = [doc for name in kustomization["resources"]
            for doc in yaml.safe_load_all((directory / name).read_text()) if doc]
    for kind, key in (("ConfigMap", "configMapGenerator"), ("Secret", "secretGenerator")):
        for generator in kustomization.get(key, []):
            data = {}
            for entry in generator.get("files", []):
                name, _, path = entry.rpartition("=")
                data[name or path] = (directory / path).read_text()
            docs.append({"apiVersion": "v1", "kind": kind,
                         "metadata": {"name": generator["name"]}, "data": data})
    for doc in docs:
        doc["metadata"].setdefault("namespace", kustomization.get("namespace"))
    return docs


@pytest.fixture(scope="module")
def objects() -> list[dict]:
    return render()


def one(objects, kind: str, name: str) -> dict:
    (found,) = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    return found


def generated(objects, kind: str, prefix: str) -> dict:
    """A generated ConfigMap or Secret (kustomize appends a content hash to its name)."""
    (found,) = [o for o in objects if o["kind"] == kind
                and o["metadata"]["name"].startswith(prefix)]
    return found


def args_of(container: dict) -> dict[str, str]:
    return dict(arg.removeprefix("--").partition("=")[::2] for arg in container["args"])


def test_renders_everything_the_issue_lists(objects):
    kinds = {o["kind"] for o in objects}
    assert {"Deployment", "Service", "PodDisruptionBudget", "ConfigMap", "Secret",
            "InferencePool", "HTTPRoute"} <= kinds


@pytest.mark.parametrize("version", VERSIONS)
def test_builtin_objects_pass_the_kubernetes_schemas(objects, version):
    for obj in objects:
        if obj["kind"] not in EXTENSION_KINDS:
            kubernetes_validate.validate(obj, version, strict=True)


def test_the_validator_is_strict(objects):
    """A misspelt field must fail, or the test above proves nothing."""
    deployment = copy.deepcopy(one(objects, "Deployment", "tokstream"))
    deployment["spec"]["template"]["spec"]["containers"][0]["readinessprobe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, VERSIONS[-1], strict=True)


# inference.networking.k8s.io/v1 InferencePool, by the field names and limits of the
# extension's API reference (the CRD itself is not vendored here).
PORT = {"type": "object", "additionalProperties": False, "required": ["number"],
        "properties": {"number": {"type": "integer", "minimum": 1, "maximum": 65535}}}
INFERENCE_POOL = {
    "type": "object", "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "inference.networking.k8s.io/v1"},
        "kind": {"const": "InferencePool"},
        "spec": {
            "type": "object", "additionalProperties": False,
            "required": ["selector", "targetPorts"],
            "properties": {
                "selector": {"type": "object", "additionalProperties": False,
                             "required": ["matchLabels"],
                             "properties": {"matchLabels": {
                                 "type": "object", "minProperties": 1,
                                 "additionalProperties": {"type": "string"}}}},
                "targetPorts": {"type": "array", "minItems": 1, "maxItems": 8, "items": PORT},
                "appProtocol": {"enum": ["http", "kubernetes.io/h2c"]},
                "endpointPickerRef": {
                    "type": "object", "additionalProperties": False, "required": ["name"],
                    "properties": {"group": {"type": "string"}, "kind": {"type": "string"},
                                   "name": {"type": "string", "minLength": 1},
                                   "port": PORT,
                                   "failureMode": {"enum": ["FailOpen", "FailClose"]}}},
            },
        },
    },
}


def test_inference_pool_fields(objects):
    pool = one(objects, "InferencePool", "tokstream")
    jsonschema.validate(pool, INFERENCE_POOL)
    ref = pool["spec"]["endpointPickerRef"]
    # A Service reference (the default kind) needs its port.
    assert ref.get("kind", "Service") != "Service" or "port" in ref


def test_pool_picker_and_route_point_at_each_other(objects):
    deployment = one(objects, "Deployment", "tokstream")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    http_port = {p["name"]: p["containerPort"] for p in container["ports"]}["http"]

    pool = one(objects, "InferencePool", "tokstream")
    assert pool["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert [p["number"] for p in pool["spec"]["targetPorts"]] == [http_port]

    for kind in ("Service", "PodDisruptionBudget"):
        selector = one(objects, kind, "tokstream")["spec"]["selector"]
        selector = selector.get("matchLabels", selector)
        assert selector.items() <= pod_labels.items(), kind

    ref = pool["spec"]["endpointPickerRef"]
    picker_service = one(objects, "Service", ref["name"])
    assert ref["port"]["number"] in [p["port"] for p in picker_service["spec"]["ports"]]
    picker = one(objects, "Deployment", ref["name"])
    assert picker_service["spec"]["selector"].items() <= (
        picker["spec"]["template"]["metadata"]["labels"].items())
    (epp,) = picker["spec"]["template"]["spec"]["containers"]
    args = args_of(epp)
    assert args["pool-name"] == pool["metadata"]["name"]
    assert args["pool-namespace"] == pool["metadata"]["namespace"]
    assert int(args["grpc-port"]) == ref["port"]["number"]

    route = one(objects, "HTTPRoute", "tokstream")
    backends = [b for rule in route["spec"]["rules"] for b in rule["backendRefs"]]
    assert {"group": "inference.networking.k8s.io", "kind": "InferencePool",
            "name": "tokstream"} in backends


def test_picker_reads_series_tokstream_exports(objects):
    (epp,) = one(objects, "Deployment", "tokstream-endpoint-picker")[
        "spec"]["template"]["spec"]["containers"]
    args = args_of(epp)
    exported = exported_series()
    for flag in ("total-queued-requests-metric", "total-running-requests-metric",
                 "kv-cache-usage-percentage-metric", "cache-info-metric"):
        assert args[flag] in exported, f"--{flag}={args[flag]} is not on /metrics"
    config = yaml.safe_load(generated(objects, "ConfigMap", "tokstream-endpoint-picker")[
        "data"]["endpoint-picker-config.yaml"])
    declared = {plugin.get("name", plugin["type"]) for plugin in config["plugins"]}
    for profile in config["schedulingProfiles"]:
        for plugin in profile["plugins"]:
            assert plugin["pluginRef"] in declared


def test_replica_drains_and_is_probed(objects):
    spec = one(objects, "Deployment", "tokstream")["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    assert container["livenessProbe"]["httpGet"]["path"] == "/health/live"
    assert container["startupProbe"]["httpGet"]["path"] == "/health/live"
    assert container["readinessProbe"]["httpGet"]["path"] == "/health/ready"
    pre_stop_s = int(container["lifecycle"]["preStop"]["exec"]["command"][-1])
    drain_s = float(args_of(container)["shutdown-timeout"])
    # Kubernetes kills the pod at the grace period, whatever is still streaming.
    assert spec["terminationGracePeriodSeconds"] > pre_stop_s + drain_s
    assert {"cpu", "memory"} <= container["resources"]["requests"].keys()
    assert "memory" in container["resources"]["limits"]
    assert spec["securityContext"]["runAsNonRoot"] is True


def test_monitoring_renders_and_validates():
    objects = render(K8S / "monitoring")
    assert {o["kind"] for o in objects} == {"Secret", "PodMonitor"}
    for obj in objects:
        if obj["kind"] not in EXTENSION_KINDS:
            kubernetes_validate.validate(obj, VERSIONS[-1], strict=True)


@pytest.mark.startup
def test_serve_starts_with_the_deployments_arguments(objects):
    """The container's own flags, profile and tenants file, on dummy:tiny and loopback."""
    (container,) = one(objects, "Deployment", "tokstream")["spec"]["template"]["spec"][
        "containers"]
    mounts = {"/etc/tokstream/profiles/": K8S, "/etc/tokstream/keys/tenants.toml":
              K8S / "tenants.example.toml"}
    args = []
    for arg in container["args"]:
        for mount, local in mounts.items():
            arg = arg.replace(mount, f"{local}/" if mount.endswith("/") else str(local))
        args.append(arg)
    # Later flags win: a tiny model, loopback and a free port instead of 0.0.0.0:8000.
    with ServerProcess(*args, "--model", "dummy:tiny", "--host", "127.0.0.1") as server:
        assert httpx.get(server.url + "/health/live", timeout=10).status_code == 200
        assert httpx.get(server.url + "/health/ready", timeout=10).status_code == 200
        httpx.post(server.url + "/v1/messages", timeout=60, json={
            "model": "dummy:tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "x"}]},
            headers={"x-api-key": "sk-example-team-a"})
        # The picker's scrape (no key): the load series, none that names a tenant.
        public = httpx.get(server.url + "/metrics", timeout=10)
        assert public.status_code == 200
        assert "vllm:num_requests_waiting" in public.text and "vllm:kv_cache_usage_perc" in \
            public.text
        assert 'tenant="' not in public.text
        assert httpx.get(server.url + "/metrics", timeout=10, headers={
            "Authorization": "Bearer wrong"}).status_code in (401, 403)  # a wrong key: refused
        metrics = httpx.get(server.url + "/metrics", timeout=10,
                            headers={"Authorization": "Bearer sk-example-metrics"})
        assert metrics.status_code == 200
        assert "vllm:cache_config_info" in metrics.text and 'tenant="' in metrics.text
