"""deploy/k8s: the kustomization renders; every built-in object passes the Kubernetes OpenAPI
schemas offline (kubernetes-validate, strict: unknown fields fail); the Gateway API Inference
Extension objects carry the fields its docs define; the pieces point at each other (selectors,
ports, the picker's pool and metric names); and `tokstream serve` starts with the Deployment's
own arguments and files, answering the probes' paths."""

from __future__ import annotations

import copy
import json
import re
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
GIE_VERSION = "v1.5.0"
GIE = ROOT / "tests" / "data" / f"gie-{GIE_VERSION}"
"""The endpoint picker's flags, config schema, RBAC and parser, vendored at the pinned tag."""
# The oldest Kubernetes still commonly run (grpc probes and policy/v1 need >= 1.24) and the
# newest schema kubernetes-validate carries.
VERSIONS = ("1.30.0", kubernetes_validate.utils.latest_version())
EXTENSION_KINDS = {"InferencePool", "HTTPRoute", "PodMonitor", "PrometheusRule"}
"""Custom resources: checked against their own schemas (here and in test_deploy_autoscaling)."""

pytestmark = pytest.mark.timeout(120)


def render(directory=K8S) -> list[dict]:
    """What `kubectl apply -k` would send: `kubectl kustomize` (kustomize v5 built in)."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl not installed: the manifests are rendered by its kustomize only")
    result = subprocess.run([kubectl, "kustomize", str(directory)], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


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
    assert {"Deployment", "Service", "PodDisruptionBudget", "ConfigMap",
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


def picker_config(objects) -> dict:
    return yaml.safe_load(generated(objects, "ConfigMap", "tokstream-endpoint-picker")[
        "data"]["endpoint-picker-config.yaml"])


def picker_container(objects) -> dict:
    (epp,) = one(objects, "Deployment", "tokstream-endpoint-picker")[
        "spec"]["template"]["spec"]["containers"]
    return epp


def test_picker_image_is_the_version_the_vendored_facts_describe(objects):
    image = picker_container(objects)["image"]
    assert image == f"registry.k8s.io/gateway-api-inference-extension/epp:{GIE_VERSION}"


def test_picker_flags_are_ones_it_accepts(objects):
    """GIE v1.5.0 exits at start on an unknown flag or on one of its rejected metric flags."""
    flags = json.loads((GIE / "epp-flags.json").read_text())
    for arg in picker_container(objects)["args"]:
        name = arg.removeprefix("--").partition("=")[0]
        assert name in flags["flags"], f"{arg}: not a v1.5.0 flag"
        assert name not in flags["rejected"], f"{arg}: v1.5.0 refuses to start with it"
        assert name not in flags["deprecated"], f"{arg}: deprecated, set it in the config"


def test_picker_config_follows_the_upstream_schema(objects):
    schema = json.loads((GIE / "endpoint-picker-config.schema.json").read_text())
    config = picker_config(objects)
    jsonschema.validate(config, schema)
    declared = {}
    for plugin in config["plugins"]:
        assert plugin["type"] in schema["pluginTypes"], plugin["type"]
        declared[plugin.get("name", plugin["type"])] = plugin
        if plugin["type"] in schema["pluginParameters"]:
            jsonschema.validate(plugin.get("parameters") or {},
                                schema["pluginParameters"][plugin["type"]])
    refs = [p["pluginRef"] for profile in config["schedulingProfiles"]
            for p in profile["plugins"]]
    refs += [ref for source in config.get("dataLayer", {}).get("sources", [])
             for ref in [source["pluginRef"], *(e["pluginRef"] for e in source["extractors"])]]
    for ref in refs:
        assert ref in declared, f"pluginRef {ref} names no plugin"


def test_picker_scrapes_series_tokstream_exports(objects):
    config = picker_config(objects)
    plugins = {p.get("name", p["type"]): p for p in config["plugins"]}
    (source,) = config["dataLayer"]["sources"]
    assert plugins[source["pluginRef"]]["type"] == "metrics-data-source"
    assert plugins[source["pluginRef"]]["parameters"]["path"] == "/metrics"
    (extractor,) = [plugins[e["pluginRef"]] for e in source["extractors"]]
    assert extractor["type"] == "core-metrics-extractor"
    parameters = extractor["parameters"]
    (engine,) = [e for e in parameters["engineConfigs"]
                 if e["name"] == parameters["defaultEngine"]]
    exported = exported_series()
    for key in ("queuedRequestsSpec", "runningRequestsSpec", "kvUsageSpec", "cacheInfoSpec"):
        assert engine[key] in exported, f"{key}={engine[key]} is not on /metrics"
    # Left out, it would default to vLLM's vllm:lora_requests_info, which tokstream lacks.
    assert engine["loraSpec"] in set(exported) | {""}
    # The prefix scorer reads the pool's geometry from these labels (their default names).
    assert {"block_size", "num_gpu_blocks"} <= exported[engine["cacheInfoSpec"]]


def test_picker_role_covers_what_it_watches(objects):
    wanted = json.loads((GIE / "rbac.json").read_text())
    role = one(objects, "Role", "tokstream-endpoint-picker")
    granted = {(group, resource, verb) for rule in role["rules"]
               for group in rule["apiGroups"] for resource in rule["resources"]
               for verb in rule["verbs"]}
    for watched in wanted["watched"]:
        for verb in wanted["verbs"]:
            assert (watched["apiGroup"], watched["resource"], verb) in granted, (watched, verb)
    binding = one(objects, "RoleBinding", "tokstream-endpoint-picker")
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert {"kind": "ServiceAccount", "name": "tokstream-endpoint-picker",
            "namespace": "tokstream"} in binding["subjects"]
    picker = one(objects, "Deployment", "tokstream-endpoint-picker")
    assert picker["spec"]["template"]["spec"]["serviceAccountName"] == "tokstream-endpoint-picker"


def route_backend(route: dict, path: str) -> dict | None:
    """The backend Gateway API sends `path` to: an Exact match first, then the longest
    PathPrefix (segment-wise, as the spec defines), then rule order."""
    best = None
    for order, rule in enumerate(route["spec"]["rules"]):
        for match in rule.get("matches", [{"path": {"type": "PathPrefix", "value": "/"}}]):
            kind, value = match["path"]["type"], match["path"]["value"]
            if kind == "Exact" and path == value:
                rank = (2, len(value), -order)
            elif kind == "PathPrefix" and (value.rstrip("/") == "" or path == value.rstrip("/")
                                           or path.startswith(value.rstrip("/") + "/")):
                rank = (1, len(value.rstrip("/")), -order)
            else:
                continue
            if best is None or rank > best[0]:
                (backend,) = rule["backendRefs"]
                best = (rank, backend)
    return None if best is None else best[1]


def test_route_backend_follows_gateway_api_precedence():
    """The resolver the next test relies on: longest prefix, segment boundaries."""
    route = {"spec": {"rules": [{"matches": [{"path": {"type": "PathPrefix", "value": "/v1/"}}],
                                 "backendRefs": [{"name": "short"}]},
                                {"matches": [{"path": {"type": "PathPrefix",
                                                       "value": "/v1/completions"}}],
                                 "backendRefs": [{"name": "long"}]}]}}
    assert route_backend(route, "/v1/completions")["name"] == "long"
    assert route_backend(route, "/v1/completionsX")["name"] == "short"
    assert route_backend(route, "/v1/messages")["name"] == "short"
    assert route_backend(route, "/health") is None


def test_every_api_path_reaches_a_backend_that_reads_it(objects):
    """The picker's parser answers 400 to what it cannot read (Anthropic's Messages API):
    those paths must go to the Service, the rest of the generation paths to the pool."""
    from tokstream.server.app import routes

    parser = json.loads((GIE / "openai-parser.json").read_text())
    config = picker_config(objects)
    assert config.get("parser", {}).get("pluginRef", "openai-parser") == parser["parser"]
    route = one(objects, "HTTPRoute", "tokstream")
    service = one(objects, "Service", "tokstream")
    service_port = service["spec"]["ports"][0]["port"]
    via_pool = set()
    for app_route in routes():
        if not app_route.path.startswith("/v1/") or app_route.path.startswith("/v1/state"):
            continue  # admin and health routes are not published through the Gateway
        path = app_route.path.replace("{request_id}", "x")
        backend = route_backend(route, path)
        assert backend is not None, path
        readable = "POST" in app_route.methods and path.endswith(tuple(parser["path_suffixes"]))
        if backend.get("kind") == "InferencePool":
            assert readable, f"{path} goes through the picker, whose parser refuses it"
            via_pool.add(path)
        else:
            assert backend["kind"] == "Service" and backend["name"] == "tokstream", path
            assert backend["port"] == service_port
    assert {"/v1/chat/completions", "/v1/completions"} <= via_pool
    assert route_backend(route, "/v1/messages")["kind"] == "Service"


def test_rollout_leaves_the_pool_before_it_drains(objects):
    """preStop turns readiness off (SIGUSR1) while the replica still serves, and waits until
    the kubelet's probe has failed and the picker has seen it; only then SIGTERM drains. The
    grace period covers preStop + drain + the error-event flush + a margin."""
    spec = one(objects, "Deployment", "tokstream")["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    readiness = container["readinessProbe"]
    assert readiness["httpGet"]["path"] == "/health/ready"
    pre_stop = container["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[:2] == ["sh", "-c"]
    script = pre_stop[2]
    leave = script.index("kill -USR1 1")
    sleep_s = int(re.search(r"sleep (\d+)", script[leave:]).group(1))
    # The kubelet sees the 503 within a probe period (+ its timeout) times the failures it
    # needs; the pod's Ready condition then reaches the picker's pod watch: 5 s for that.
    unready_s = (readiness["periodSeconds"] * readiness.get("failureThreshold", 3)
                 + readiness.get("timeoutSeconds", 1))
    assert sleep_s >= unready_s + 5, (sleep_s, unready_s)
    drain_s = float(args_of(container)["shutdown-timeout"])
    # server/replica/drain.py FLUSH_TIMEOUT_S; the core and ranks stopping
    flush_s, margin_s = 5, 10
    assert spec["terminationGracePeriodSeconds"] >= sleep_s + drain_s + flush_s + margin_s
    # A stream the Gateway lets run as long as its timeout is one the drain lets finish.
    route = one(objects, "HTTPRoute", "tokstream")
    for rule in route["spec"]["rules"]:
        assert float(rule["timeouts"]["request"].removesuffix("s")) == drain_s, rule
    # The picker outlives the replicas it routes to while they drain.
    picker = one(objects, "Deployment", "tokstream-endpoint-picker")["spec"]["template"]["spec"]
    assert picker["terminationGracePeriodSeconds"] >= spec["terminationGracePeriodSeconds"]


def test_replica_is_probed_and_sized(objects):
    spec = one(objects, "Deployment", "tokstream")["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    assert container["livenessProbe"]["httpGet"]["path"] == "/health/live"
    assert container["startupProbe"]["httpGet"]["path"] == "/health/live"
    resources = container["resources"]
    assert {"cpu", "memory"} <= resources["requests"].keys()
    assert "memory" in resources["limits"]
    # The CPU limit is the cgroup quota rank threads are sized from (tokstream/cpu_budget.py):
    # whole cores, equal to the request, so the threads get the cores the scheduler reserved.
    assert resources["limits"]["cpu"] == resources["requests"]["cpu"]
    assert str(resources["limits"]["cpu"]).isdigit()
    assert spec["securityContext"]["runAsNonRoot"] is True


PUBLISHED_KEYS = re.compile(r"\b[0-9a-f]{64}\b|sk-example|sk-demo")
"""What must never reach a cluster from this repository: a sha256 key hash, an example key."""


@pytest.mark.parametrize("directory", [K8S, K8S / "monitoring"], ids=["k8s", "monitoring"])
def test_no_published_key_is_deployed(directory):
    """`kubectl apply -k` ships no Secret and no key: the operator makes tokstream-keys (the
    tenants file) and tokstream-metrics-key (README); the pods wait until they exist."""
    rendered = subprocess.run(["kubectl", "kustomize", str(directory)], capture_output=True,
                              text=True, timeout=60, check=True).stdout
    assert not PUBLISHED_KEYS.search(rendered), PUBLISHED_KEYS.search(rendered)
    assert "kind: Secret" not in rendered
    example = (K8S / "tenants.example.toml").read_text()
    assert PUBLISHED_KEYS.search(example), "the checker must know what an example key looks like"


def test_replicas_need_the_operators_secret(objects):
    spec = one(objects, "Deployment", "tokstream")["spec"]["template"]["spec"]
    (keys,) = [v for v in spec["volumes"] if v["name"] == "keys"]
    assert keys["secret"]["secretName"] == "tokstream-keys"
    assert keys["secret"].get("optional", False) is False  # no Secret: the pod does not start
    (container,) = spec["containers"]
    (mount,) = [m for m in container["volumeMounts"] if m["name"] == "keys"]
    assert args_of(container)["tenants"].startswith(mount["mountPath"] + "/")


def test_monitoring_renders_and_validates():
    objects = render(K8S / "monitoring")
    assert {o["kind"] for o in objects} >= {"PodMonitor"}
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
