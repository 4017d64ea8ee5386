"""The deployment files: the compose stack (Debian's docker-compose validates it) and every
Kubernetes overlay (kubectl kustomize renders it, kubernetes-validate checks it offline)."""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import subprocess
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import kubernetes_validate
import pytest
import yaml

from service.settings import Settings

ROOT = Path(__file__).resolve().parents[1]
COMPOSE_ENV = {"RABBITMQ_USER": "gateway", "RABBITMQ_PASSWORD": "s3cret-pw", "GRAFANA_ADMIN_PASSWORD": "pw"}
CRD_REQUIRED = {  # no schemas ship for these: check what the cluster would reject
    "ScaledObject": ["scaleTargetRef", "triggers"],
    "TriggerAuthentication": ["secretTargetRef"],
    "ServiceMonitor": ["selector", "endpoints"],
    "PodMonitor": ["selector", "podMetricsEndpoints"],
    "RabbitmqCluster": ["replicas", "rabbitmq", "affinity"],
    "User": ["rabbitmqClusterReference", "importCredentialsSecret"],
    "Permission": ["rabbitmqClusterReference", "vhost", "userReference", "permissions"],
}


def compose(*files: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    args = ["docker-compose", *(a for f in files for a in ("-f", f)), "config"]
    return subprocess.run(args, cwd=ROOT, env={**os.environ, **(env or COMPOSE_ENV)}, capture_output=True, text=True)


@pytest.mark.parametrize(
    "files", [("docker-compose.yml",), ("docker-compose.yml", "docker-compose.gpu.yml")], ids=["cpu", "gpu"]
)
def test_compose_stack_is_valid_and_starts_in_order(files: tuple[str, ...]) -> None:
    result = compose(*files)
    assert result.returncode == 0, result.stderr
    config = yaml.safe_load(result.stdout)
    services = config["services"]
    assert {"models", "triton", "rabbitmq", "gateway", "worker", "prometheus", "grafana"} <= set(services)
    for name in ("gateway", "worker"):
        assert services[name]["depends_on"] == {
            "triton": {"condition": "service_healthy"},
            "rabbitmq": {"condition": "service_healthy"},
        }
        assert services[name]["environment"]["GATEWAY_BROKER_URL"] == "amqp://gateway:s3cret-pw@rabbitmq:5672/"
    assert services["triton"]["depends_on"] == {"models": {"condition": "service_completed_successfully"}}
    for name, service in services.items():
        if name not in ("models", "queue-policies"):  # one-shot services
            assert "healthcheck" in service, name
    assert "queues policies --apply http://gateway:s3cret-pw@rabbitmq:15672" in services["queue-policies"]["command"]
    devices = services["triton"].get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", [])
    gpu = "docker-compose.gpu.yml" in files
    assert [d["driver"] for d in devices] == (["nvidia"] if gpu else [])
    assert ("--triton-kind gpu" in services["models"]["command"]) is gpu


def test_compose_refuses_to_start_without_credentials() -> None:
    result = compose(
        "docker-compose.yml", env={"GRAFANA_ADMIN_PASSWORD": "pw", "RABBITMQ_USER": "", "PATH": os.environ["PATH"]}
    )
    assert result.returncode != 0
    assert "RABBITMQ" in result.stderr
    for path in ("docker-compose.yml", "docker-compose.gpu.yml", ".env.example"):
        assert "guest" not in (ROOT / path).read_text()


def test_the_host_stack_runs_the_image_locked_down_against_the_hosts_services() -> None:
    """docker-compose.host.yml: the gateway and a worker on the host's network (how scripts/image-test
    runs them), locked down as in production, with no default broker credentials."""
    refused = compose("docker-compose.host.yml", env={"PATH": os.environ["PATH"]})
    assert refused.returncode != 0
    assert "GATEWAY_BROKER_URL" in refused.stderr
    url = "amqp://gateway:s3cret-pw@127.0.0.1:5672/"
    result = compose("docker-compose.host.yml", env={"PATH": os.environ["PATH"], "GATEWAY_BROKER_URL": url})
    assert result.returncode == 0, result.stderr
    services = yaml.safe_load(result.stdout)["services"]
    assert set(services) == {"gateway", "worker"}
    for service in services.values():
        assert service["network_mode"] == "host"
        assert service["read_only"] is True
        assert service["cap_drop"] == ["ALL"]
        assert service["tmpfs"] == ["/tmp"]
        assert service["environment"]["GATEWAY_BROKER_URL"] == url
    assert services["worker"]["healthcheck"]["test"][:3] == ["CMD", "gateway", "alive"]


def render(overlay: str, tmp_path: Path) -> list[dict[str, Any]]:
    """kubectl kustomize on a copy of k8s/ with generated credentials (never committed)."""
    tree = tmp_path / "k8s"
    shutil.copytree(ROOT / "k8s", tree)
    example = (tree / "base" / "credentials.env.example").read_text()
    password = secrets.token_urlsafe(24)
    (tree / "base" / "credentials.env").write_text(example.replace("change-me-to-a-long-random-string", password))
    result = subprocess.run(["kubectl", "kustomize", str(tree / "overlays" / overlay)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def by_kind(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    return next(d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name)


def container(deployment: dict[str, Any], name: str) -> dict[str, Any]:
    return next(c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == name)


@pytest.mark.parametrize("overlay", ["cpu", "gpu"])
def test_kubernetes_overlay_renders_and_validates(overlay: str, tmp_path: Path) -> None:
    docs = render(overlay, tmp_path)
    for doc in docs:
        kind = doc["kind"]
        if kind in CRD_REQUIRED:
            assert all(key in doc["spec"] for key in CRD_REQUIRED[kind]), doc
            continue
        kubernetes_validate.validate(doc, "1.30.0", strict=True)  # raises on any schema violation
        if kind != "Namespace":
            assert doc["metadata"]["namespace"] == "inference-gateway", doc["metadata"]

    gateway = by_kind(docs, "Deployment", "gateway")
    web = container(gateway, "gateway")
    assert web["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert web["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert web["lifecycle"]["preStop"]["sleep"]["seconds"] > 0
    assert web["resources"]["requests"]
    assert web["resources"]["limits"]
    assert by_kind(docs, "HorizontalPodAutoscaler", "gateway")["spec"]["scaleTargetRef"]["name"] == "gateway"
    assert by_kind(docs, "PodDisruptionBudget", "gateway")["spec"]["minAvailable"] == 1
    trigger = by_kind(docs, "ScaledObject", "worker")["spec"]["triggers"][0]
    assert (trigger["type"], trigger["metadata"]["queueName"]) == ("rabbitmq", "gateway.work")
    worker = by_kind(docs, "Deployment", "worker")
    assert container(worker, "worker")["livenessProbe"]["exec"]["command"][:2] == ["gateway", "alive"]
    init = worker["spec"]["template"]["spec"]["initContainers"][0]
    assert init["args"][:3] == ["queues", "policies", "--apply"]

    triton = container(by_kind(docs, "Deployment", "triton"), "triton")
    assert triton["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"
    gpus = triton["resources"].get("limits", {}).get("nvidia.com/gpu")
    assert gpus == (1 if overlay == "gpu" else None)

    policies = {d["metadata"]["name"]: d for d in docs if d["kind"] == "NetworkPolicy"}
    for name, target in (
        ("triton-from-gateway-and-workers", "triton"),
        ("rabbitmq-from-gateway-and-workers", "rabbitmq"),
    ):
        policy = policies[name]
        assert policy["spec"]["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": target}
        allowed = policy["spec"]["ingress"][0]["from"][0]["podSelector"]["matchExpressions"][0]["values"]
        assert sorted(allowed) == ["gateway", "worker"]

    secret = next(d for d in docs if d["kind"] == "Secret")
    assert secret["metadata"]["name"].startswith("rabbitmq-credentials-")  # generated, hash-suffixed
    assert {"username", "password"} <= set(secret["data"])  # the topology operator's keys
    secrets = {d["metadata"]["name"] for d in docs if d["kind"] == "Secret"}
    for reference in secret_references(docs):  # every reference follows the generated name
        assert reference in secrets or reference == "gateway-webhooks", reference  # (that one is optional)
    rendered = json.dumps(docs)
    assert "guest" not in rendered
    assert not re.search(r"change-me", rendered)


def secret_references(node: Any) -> list[str]:
    """Secret names referenced anywhere in rendered documents: pods' secretKeyRef, KEDA's
    secretTargetRef, the topology operator's importCredentialsSecret."""
    found: list[str] = []
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ("secretKeyRef", "importCredentialsSecret"):
                found.append(value["name"])
            elif key == "secretTargetRef":
                found.extend(ref["name"] for ref in value)
            else:
                found.extend(secret_references(value))
    elif isinstance(node, list):
        for item in node:
            found.extend(secret_references(item))
    return found


def check_rabbitmq_trigger(trigger: dict[str, Any], queue: str) -> None:
    """A KEDA RabbitMQ trigger that counts what the workers hold: the management API (over AMQP,
    QueueLength counts only ready messages, kedacore/keda#5050, #6571), the queue's length, on the
    client Service's management port, with no credentials in the URL (KEDA's TriggerAuthentication
    gives them), on the vhost the gateway's user has."""
    assert trigger["type"] == "rabbitmq"
    meta = trigger["metadata"]
    assert meta["protocol"] == "http"
    assert meta["mode"] == "QueueLength"
    assert meta["queueName"] == queue
    assert meta.get("excludeUnacknowledged", "false") == "false"
    assert meta["vhostName"] == "/"
    host = urlsplit(meta["host"])
    assert (host.scheme, host.hostname, host.port, host.path) == ("http", "rabbitmq.inference-gateway.svc", 15672, "/")
    assert (host.username, host.password) == (None, None)
    assert int(meta["value"]) > 0
    assert trigger["authenticationRef"] == {"name": "rabbitmq"}


def documented_scaled_objects() -> list[dict[str, Any]]:
    """The ScaledObjects docs/deployment.md tells operators to add, one per model queue."""
    text = (ROOT / "docs" / "deployment.md").read_text()
    blocks = re.findall(r"```yaml\n(.*?)```", text, re.S)
    return [d for b in blocks for d in yaml.safe_load_all(b) if d and d.get("kind") == "ScaledObject"]


def test_keda_counts_unacknowledged_messages_through_the_management_api(tmp_path: Path) -> None:
    """Workers are scaled on their queue's ready and unacknowledged messages (KEDA's http mode),
    logging in as the topology operator's user with the same Secret keys, through a NetworkPolicy
    that lets KEDA reach the management port; the per-model ScaledObjects the docs give do the same."""
    docs = render("cpu", tmp_path)
    config = by_kind(docs, "ConfigMap", "gateway-config")["data"]
    scaled = by_kind(docs, "ScaledObject", "worker")["spec"]
    assert scaled["scaleTargetRef"] == {"name": "worker"}
    (trigger,) = scaled["triggers"]
    check_rabbitmq_trigger(trigger, f"{config['GATEWAY_QUEUE_PREFIX']}.work")

    user = by_kind(docs, "User", "gateway")["spec"]
    credentials = user["importCredentialsSecret"]["name"]
    auth = by_kind(docs, "TriggerAuthentication", "rabbitmq")["spec"]["secretTargetRef"]
    assert {(ref["parameter"], ref["name"], ref["key"]) for ref in auth} == {
        ("username", credentials, "username"),
        ("password", credentials, "password"),
    }
    permission = by_kind(docs, "Permission", "gateway")["spec"]
    assert permission["userReference"] == {"name": "gateway"}
    assert permission["vhost"] == trigger["metadata"]["vhostName"]
    assert permission["permissions"]["read"] == ".*"  # the management API shows queues it may read

    policy = by_kind(docs, "NetworkPolicy", "rabbitmq-from-gateway-and-workers")["spec"]["ingress"]
    keda = [
        r
        for r in policy
        if r["from"][0].get("namespaceSelector", {}).get("matchLabels") == {"kubernetes.io/metadata.name": "keda"}
    ]
    assert [p["port"] for r in keda for p in r["ports"]] == [15672]

    documented = documented_scaled_objects()
    assert documented, "docs/deployment.md gives the ScaledObject of another model's workers"
    for scaled_object in documented:
        (trigger,) = scaled_object["spec"]["triggers"]
        check_rabbitmq_trigger(trigger, "gateway.work.shop")
        assert scaled_object["spec"]["scaleTargetRef"]["name"] != "worker"  # its own Deployment


def test_rabbitmq_is_a_three_node_cluster_spread_over_machines(tmp_path: Path) -> None:
    """The RabbitMQ Cluster Operator's resource: three nodes, one per machine, pause_minority; a
    disruption budget of one node; the gateway and workers given every node's address, which the
    settings accept."""
    docs = render("cpu", tmp_path)
    cluster = by_kind(docs, "RabbitmqCluster", "rabbitmq")
    assert cluster["spec"]["replicas"] == 3
    assert "cluster_partition_handling = pause_minority" in cluster["spec"]["rabbitmq"]["additionalConfig"]
    (rule,) = cluster["spec"]["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert rule["topologyKey"] == "kubernetes.io/hostname"
    assert rule["labelSelector"]["matchLabels"] == {"app.kubernetes.io/name": "rabbitmq"}
    budget = by_kind(docs, "PodDisruptionBudget", "rabbitmq")["spec"]
    assert budget["maxUnavailable"] == 1
    assert budget["selector"]["matchLabels"] == {"app.kubernetes.io/name": "rabbitmq"}
    assert not [d for d in docs if d["kind"] == "StatefulSet"]  # the operator makes it
    for name in ("gateway", "worker"):
        env = {e["name"]: e for e in container(by_kind(docs, "Deployment", name), name)["env"]}
        url = env["GATEWAY_BROKER_URL"]["value"].replace("$(RABBITMQ_USER)", "u").replace("$(RABBITMQ_PASSWORD)", "p")
        hosts = [urlsplit(address.strip()).hostname for address in Settings(broker_url=url).broker_url.split(",")]
        assert hosts == [f"rabbitmq-server-{i}.rabbitmq-nodes" for i in range(3)]
    policy = by_kind(docs, "NetworkPolicy", "rabbitmq-from-gateway-and-workers")["spec"]["ingress"]
    peers = next(
        r
        for r in policy
        if r["from"][0].get("podSelector", {}).get("matchLabels", {}).get("app.kubernetes.io/name") == "rabbitmq"
    )
    assert {p["port"] for p in peers["ports"]} == {4369, 25672, 6000}  # clustering is not cut off
    assert next(p for p in peers["ports"] if p["port"] == 6000)["endPort"] == 6500  # stream replication
    monitor = by_kind(docs, "ServiceMonitor", "rabbitmq")["spec"]["endpoints"][0]
    assert monitor["port"] == "prometheus"  # the operator's name for 15692


def test_dockerfile_is_multi_stage_non_root_with_a_healthcheck() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    stages = re.findall(r"^FROM \S+ AS (\S+)$", dockerfile, re.M)
    assert stages[-1] == "runtime"  # the default target serves
    assert "tools" in stages  # --target tools builds models
    assert re.search(r"^USER 10001$", dockerfile, re.M)
    assert "HEALTHCHECK" in dockerfile
    assert re.search(r'^ENTRYPOINT \["gateway"\]$', dockerfile, re.M)  # exec form: SIGTERM reaches uvicorn
    assert "gateway models build" in dockerfile  # the embedded model is built at image build time
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".venv", ".venv-triton", ".git", "tests"} <= set(ignored)


def test_every_artifact_serves_and_publishes_the_grpc_port(tmp_path: Path) -> None:
    """The gateway's gRPC port (the settings' default, Triton's 8001) is exposed by the image,
    published by the compose stack, set on the host stack off a local Triton's ports, and declared by
    the Kubernetes Deployment and Service; a NetworkPolicy that admits the gateway's HTTP port admits
    its gRPC port too. Triton's own 8001 stays inside compose's network."""
    http, grpc = Settings.model_fields["port"].default, Settings.model_fields["grpc_port"].default
    assert (http, grpc) == (8000, 8001)

    dockerfile = (ROOT / "Dockerfile").read_text().split("FROM ")[-1]  # the runtime stage
    expose = re.search(r"^EXPOSE (.+)$", dockerfile, re.M)
    assert expose, "the runtime stage exposes no port"
    assert {str(http), str(grpc)} <= set(expose.group(1).split())
    assert re.search(rf"\bGATEWAY_GRPC_PORT={grpc}\b", dockerfile)

    services = yaml.safe_load(compose("docker-compose.yml").stdout)["services"]
    published = {(p["published"], p["target"]) for p in services["gateway"]["ports"]}
    assert {(http, http), (grpc, grpc)} <= published
    assert "ports" not in services["triton"]  # the host's 8001 is the gateway's

    # "" for the file's default: the suite's conftest sets GATEWAY_GRPC_PORT=0 in this environment
    env = {"GATEWAY_BROKER_URL": "amqp://u:p@127.0.0.1:5672/", "GATEWAY_GRPC_PORT": "", "GATEWAY_TRITON_URL": ""}
    host = compose("docker-compose.host.yml", env=env)
    assert host.returncode == 0, host.stderr
    gateway_env = yaml.safe_load(host.stdout)["services"]["gateway"]["environment"]
    assert gateway_env["GATEWAY_GRPC_PORT"] == str(grpc)
    triton_port = int(gateway_env["GATEWAY_TRITON_URL"].rsplit(":", 1)[1])
    assert triton_port not in (int(gateway_env["GATEWAY_PORT"]), grpc)  # one host: Triton elsewhere

    for overlay in ("cpu", "gpu"):
        docs = render(overlay, tmp_path / overlay)
        assert by_kind(docs, "ConfigMap", "gateway-config")["data"]["GATEWAY_GRPC_PORT"] == str(grpc)
        ports = {
            p["name"]: p["containerPort"] for p in container(by_kind(docs, "Deployment", "gateway"), "gateway")["ports"]
        }
        assert ports == {"http": http, "grpc": grpc}
        service = {p["name"]: p for p in by_kind(docs, "Service", "gateway")["spec"]["ports"]}
        assert service["grpc"]["targetPort"] == "grpc"
        assert service["grpc"]["appProtocol"] == "grpc"
        for policy in (d for d in docs if d["kind"] == "NetworkPolicy"):
            if not selects_gateway(policy["spec"]["podSelector"]):
                continue
            for rule in policy["spec"].get("ingress", []):
                admitted = {p.get("port") for p in rule.get("ports", [])}
                if admitted & {http, "http"}:
                    assert admitted & {grpc, "grpc"}, (policy["metadata"]["name"], rule)


def selects_gateway(selector: dict[str, Any]) -> bool:
    """Whether a NetworkPolicy's podSelector takes the gateway's pods (an empty one takes every pod)."""
    labels = {"app.kubernetes.io/name": "gateway"}
    if any(labels.get(key) != value for key, value in selector.get("matchLabels", {}).items()):
        return False
    for expression in selector.get("matchExpressions", []):
        value = labels.get(expression["key"])
        inside = value is not None and value in expression.get("values", [])
        matches = {"In": inside, "NotIn": not inside, "Exists": value is not None, "DoesNotExist": value is None}
        if not matches[expression["operator"]]:
            return False
    return True
