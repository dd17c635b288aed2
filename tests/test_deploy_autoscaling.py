"""Token-based autoscaling (issue 32 item 3), rendered with kustomize and checked:
deploy/k8s-autoscaling is deploy/k8s plus an autoscaling/v2 HPA (Kubernetes schemas, strict) on
output tokens/s and KV usage per pod, its token target taken from the capacity a
`tokstream loadtest --sweep` measured; prometheus-adapter's rules expose exactly the metrics the
HPA names, from series tokstream exports; deploy/k8s/monitoring's PodMonitors (replicas and the
endpoint picker) and PrometheusRule pass the Prometheus Operator's CRD schemas, and the rule
groups are deploy/prometheus's own."""

from __future__ import annotations

import copy
import json
import math
import re

import jsonschema
import kubernetes_validate
import pytest
import yaml

from helpers.metrics_series import exported_series
from helpers.serving import ROOT
from test_deploy_k8s import K8S, VERSIONS, one, render

AUTOSCALING = ROOT / "deploy" / "k8s-autoscaling"
OPERATOR = ROOT / "tests" / "data" / "prometheus-operator-v0.93.0"
HEADROOM = 0.7
"""Scale before a replica is full: a new one takes minutes to load (README)."""

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def objects() -> list[dict]:
    return render(AUTOSCALING)


@pytest.fixture(scope="module")
def monitoring() -> list[dict]:
    return render(K8S / "monitoring")


def hpa_of(objects) -> dict:
    return one(objects, "HorizontalPodAutoscaler", "tokstream")


def test_overlay_is_the_base_plus_the_hpa(objects):
    base = render(K8S)
    assert sorted((o["kind"], o["metadata"]["name"]) for o in objects) == sorted(
        [(o["kind"], o["metadata"]["name"]) for o in base]
        + [("HorizontalPodAutoscaler", "tokstream")])
    # The HPA owns the replica count; a fixed one would be reset by every apply.
    assert "replicas" in one(base, "Deployment", "tokstream")["spec"]
    assert "replicas" not in one(objects, "Deployment", "tokstream")["spec"]
    assert hpa_of(objects)["metadata"]["namespace"] == "tokstream"


@pytest.mark.parametrize("version", VERSIONS)
def test_hpa_passes_the_kubernetes_schema(objects, version):
    kubernetes_validate.validate(hpa_of(objects), version, strict=True)


def test_hpa_targets_the_deployment_and_keeps_the_budget(objects):
    spec = hpa_of(objects)["spec"]
    deployment = one(objects, "Deployment", spec["scaleTargetRef"]["name"])
    assert spec["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                      "name": deployment["metadata"]["name"]}
    pdb = one(objects, "PodDisruptionBudget", "tokstream")
    assert spec["minReplicas"] > pdb["spec"]["maxUnavailable"]
    assert spec["maxReplicas"] > spec["minReplicas"]
    # Scale down slower than a replica drains: it holds open streams for the grace period.
    grace_s = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert spec["behavior"]["scaleDown"]["stabilizationWindowSeconds"] >= grace_s


def test_token_target_comes_from_the_measured_capacity(objects):
    hpa = hpa_of(objects)
    annotations = hpa["metadata"]["annotations"]
    capacity = json.loads((ROOT / annotations["tokstream/capacity-source"]).read_text())
    assert capacity["kind"] == "capacity" and capacity["capacity"]["source"] == "sweep"
    tokens_per_s = capacity["capacity"]["output_tokens_per_s"]
    assert float(annotations["tokstream/capacity-output-tokens-per-s"]) == pytest.approx(
        tokens_per_s, abs=0.01)
    targets = {m["pods"]["metric"]["name"]: m["pods"]["target"] for m in hpa["spec"]["metrics"]}
    tokens = targets["tokstream_generation_tokens_per_second"]
    assert tokens["type"] == "AverageValue"
    assert float(tokens["averageValue"]) == math.floor(HEADROOM * tokens_per_s)
    kv = targets["tokstream_kv_cache_usage"]
    assert kv == {"type": "AverageValue", "averageValue": f"{round(HEADROOM * 1000)}m"}


def test_every_hpa_metric_is_served_by_an_adapter_rule_on_an_exported_series(objects):
    rules = yaml.safe_load((AUTOSCALING / "prometheus-adapter-rules.yaml").read_text())["rules"]
    served = {rule["name"]["as"]: rule for rule in rules}
    exported = exported_series()
    names = [m["pods"]["metric"]["name"] for m in hpa_of(objects)["spec"]["metrics"]]
    assert all(m["type"] == "Pods" for m in hpa_of(objects)["spec"]["metrics"])
    assert sorted(names) == sorted(served), "an HPA metric without a rule, or a rule unused"
    for name, rule in served.items():
        series = re.match(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\{", rule["seriesQuery"]).group(1)
        assert series in exported, f"{name}: {series} is not on /metrics"
        assert re.fullmatch(rule["name"]["matches"], series)
        # Per pod: the adapter maps the PodMonitor's namespace and pod labels to resources.
        assert rule["resources"]["overrides"] == {"namespace": {"resource": "namespace"},
                                                  "pod": {"resource": "pod"}}
        assert "<<.Series>>{<<.LabelMatchers>>}" in rule["metricsQuery"]
        assert "by (<<.GroupBy>>)" in rule["metricsQuery"]
    # A counter is scaled on as a rate, a gauge as it is.
    assert "rate(" in served["tokstream_generation_tokens_per_second"]["metricsQuery"]
    assert "rate(" not in served["tokstream_kv_cache_usage"]["metricsQuery"]


def strict(schema):
    """An OpenAPI v3 CRD schema with unknown fields refused (kubectl --validate=strict)."""
    schema = copy.deepcopy(schema)

    def walk(node):
        if isinstance(node, dict):
            if ("properties" in node and "additionalProperties" not in node
                    and not node.get("x-kubernetes-preserve-unknown-fields")):
                node["additionalProperties"] = False
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(schema)
    return schema


def crd_schema(name: str) -> jsonschema.Draft7Validator:
    # Not checked as a JSON Schema document: its patterns are Go regexps (one has a `(?i)`
    # Python refuses there), used only on fields these objects leave out.
    return jsonschema.Draft7Validator(
        strict(json.loads((OPERATOR / f"{name}.schema.json").read_text())))


def test_monitoring_objects_pass_the_operators_crd_schemas(monitoring):
    schemas = {"PodMonitor": crd_schema("podmonitors"),
               "PrometheusRule": crd_schema("prometheusrules")}
    kinds = sorted(o["kind"] for o in monitoring)
    assert kinds == ["PodMonitor", "PodMonitor", "PrometheusRule"]
    for obj in monitoring:
        schemas[obj["kind"]].validate(obj)


def test_the_crd_check_is_strict(monitoring):
    monitor = copy.deepcopy(one(monitoring, "PodMonitor", "tokstream"))
    monitor["spec"]["podMetricsEndpoints"][0]["intervall"] = "15s"
    with pytest.raises(jsonschema.ValidationError):
        crd_schema("podmonitors").validate(monitor)


def test_monitors_select_the_replicas_and_the_picker(monitoring):
    base = render(K8S)
    for name, port in (("tokstream", "http"), ("tokstream-endpoint-picker", "metrics")):
        monitor = one(monitoring, "PodMonitor", name)
        pods = one(base, "Deployment", name)["spec"]["template"]
        assert monitor["spec"]["selector"]["matchLabels"].items() <= pods["metadata"][
            "labels"].items()
        (container,) = pods["spec"]["containers"]
        assert port in {p["name"] for p in container["ports"]}
        assert [e["port"] for e in monitor["spec"]["podMetricsEndpoints"]] == [port]


def test_prometheus_rule_is_deploy_prometheus_rules(monitoring):
    """One set of rules: the Operator's object carries deploy/prometheus/tokstream-rules.yml's
    groups exactly (that file is what promtool checks and unit-tests)."""
    rules = yaml.safe_load((ROOT / "deploy" / "prometheus" / "tokstream-rules.yml").read_text())
    assert one(monitoring, "PrometheusRule", "tokstream")["spec"]["groups"] == rules["groups"]
