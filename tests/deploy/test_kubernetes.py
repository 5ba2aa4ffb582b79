"""deploy/kubernetes, checked offline: every overlay renders (tests/helpers/kustomize_render.py;
``kubectl kustomize`` agrees where kubectl exists) and validates against the Kubernetes schemas
(kubernetes-validate, strict), and the invariants of the compose file hold: one published Service (gRPC and HTTP),
each pod mounts only its own key (a worker's from cert-manager's CSI driver, naming the pod; no
Secret holds the CA's), NVLink multicast off in every
GPU container, every variable a real setting with docker-compose.yml's values, grpc probes on
the health port for the services the servers serve, a grace period that covers the drain, a
disruption budget per pool, and an autoscaler on metrics the gateway exports."""

from __future__ import annotations

import base64
import os
import re
import shutil
import socket
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from cluster.health import LIVENESS
from cluster.settings import ServerSettings, WorkerSettings, env_name, settings_fields
from cluster.shutdown import SHUTDOWN_OVERRUN_S
from cluster.tls import init_certs
from decode_worker.server import DecodeServicer
from decode_worker.settings import DecodeWorkerSettings
from engine.config import NVLINK_MULTICAST_OFF
from gateway import metrics as gateway_metrics
from gateway.server import SERVICE_NAME as GATEWAY_SERVICE
from gateway.settings import GatewaySettings
from prefill_worker.server import PrefillServicer

from tests.helpers.deploy import kubernetes_copy
from tests.helpers.kustomize_render import Unsupported, render
from tests.helpers.paths import ROOT

OVERLAYS = ("small", "large")
# The oldest release whose grpc probes are GA (1.27) and the newest kubernetes-validate ships.
KUBERNETES_VERSIONS = ("1.27", "1.37")
ROLES = ("gateway", "prefill", "decode")
SETTINGS = {"gateway": GatewaySettings, "prefill": WorkerSettings, "decode": DecodeWorkerSettings}
READINESS_SERVICE = {"gateway": GATEWAY_SERVICE, "prefill": PrefillServicer.service_name,
                     "decode": DecodeServicer.service_name}
# Set on Kubernetes and not in docker-compose.yml, and why: the kubelet's grpc probes speak no
# TLS (the plaintext health port); a worker advertises its pod IP (POD_IP, from the downward API).
KUBERNETES_ONLY = {"TANDEM_HEALTH_PORT", "TANDEM_ADVERTISE", "POD_IP"}
# compose's tp2 workers share one host's two GPUs (0.45 each); a TP=2 pod has two of its own.
COMPOSE_TP2_ONLY = {"TANDEM_GPU_MEMORY_UTILIZATION"}
# Taken from the operator's environment in compose, from a Secret here.
FROM_SECRETS = {"TANDEM_REDIS_PASSWORD": ("redis", "password"),
                "TANDEM_API_KEYS": ("gateway-api-keys", "TANDEM_API_KEYS")}
POD_IP = "10.1.2.3"
POD_NAME = "decode-5d4f8b7c9-x2x7k"
# Set in both, differently: compose's one instance per service has a fixed worker id, a pod's is its name.
FROM_POD = {"TANDEM_WORKER_ID": "metadata.name"}


@pytest.fixture(scope="module")
def ca_dir(tmp_path_factory) -> Path:
    """A TLS directory of `tandem certs init`: ca.pem, ca-key.pem and each role's pair."""
    directory = tmp_path_factory.mktemp("ca")
    init_certs(str(directory), ["tandem.example.com"])
    return directory


@pytest.fixture(scope="module")
def deploy_dir(tmp_path_factory, ca_dir) -> Path:
    """A copy of deploy/kubernetes whose secrets/ holds what an operator puts there, and the
    CA's key besides (which must reach no Secret)."""
    return kubernetes_copy(tmp_path_factory.mktemp("deploy") / "kubernetes", ca_dir)


@pytest.fixture(scope="module")
def rendered(deploy_dir) -> dict[str, list[dict]]:
    """Overlay name -> the objects it renders."""
    return {name: render(deploy_dir / "overlays" / name) for name in OVERLAYS}


def objects(rendered, overlay: str, kind: str) -> dict[str, dict]:
    return {o["metadata"]["name"]: o for o in rendered[overlay] if o["kind"] == kind}


def container(rendered, overlay: str, role: str) -> dict:
    [only] = objects(rendered, overlay, "Deployment")[role]["spec"]["template"]["spec"]["containers"]
    return only


def env_of(c: dict) -> dict[str, dict]:
    return {e["name"]: e for e in c.get("env", [])}


def secret_data(rendered, overlay: str, name: str) -> dict[str, bytes]:
    return {k: base64.b64decode(v) for k, v in objects(rendered, overlay, "Secret")[name]["data"].items()}


def tandem_containers(rendered, overlay: str):
    for name, deployment in objects(rendered, overlay, "Deployment").items():
        for c in deployment["spec"]["template"]["spec"]["containers"]:
            if c["image"].startswith("tandem:"):
                yield name, deployment, c


@pytest.fixture
def no_network(monkeypatch):
    """Any connection attempt (or name lookup) fails the test."""
    def refuse(*args, **kwargs):
        raise AssertionError(f"network access during the test: {args}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)


# ------------------------------------------------------------------ rendering and schemas
@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_object_validates_against_the_kubernetes_schemas_offline(rendered, overlay, version, no_network):
    kinds = sorted(o["kind"] for o in rendered[overlay])
    expected = ["Deployment"] * 4 + ["Namespace"] + ["PodDisruptionBudget"] * 3 + ["Secret"] * 3 + ["Service"] * 2
    assert kinds == sorted(expected + (["HorizontalPodAutoscaler"] if overlay == "large" else []))
    for obj in rendered[overlay]:
        # strict: an unknown field fails; a kind with no schema raises SchemaNotFoundError
        assert kubernetes_validate.validate(obj, version, strict=True) == version, obj["metadata"]["name"]
    assert {o["metadata"].get("namespace") for o in rendered[overlay] if o["kind"] != "Namespace"} == {"tandem"}


def test_strict_validation_refuses_a_misspelt_field(rendered):
    gateway = yaml.safe_load(yaml.safe_dump(objects(rendered, "small", "Deployment")["gateway"]))
    gateway["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["grpc"]["servce"] = "x"
    with pytest.raises(kubernetes_validate.ValidationError, match="servce"):
        kubernetes_validate.validate(gateway, KUBERNETES_VERSIONS[0], strict=True)


def test_the_renderer_refuses_what_it_does_not_implement(tmp_path):
    (tmp_path / "kustomization.yaml").write_text(
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\nimages:\n  - name: tandem\n")
    with pytest.raises(Unsupported, match="images"):
        render(tmp_path)


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl not installed")
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_kubectl_kustomize_renders_the_same_objects(rendered, deploy_dir, overlay):
    out = subprocess.run(["kubectl", "kustomize", str(deploy_dir / "overlays" / overlay)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr

    def normal(o):  # the order of named items aside (kustomize puts a patch's new ones first)
        if isinstance(o, dict):
            if o.get("kind") == "Secret":  # its base64 as bytes (kubectl wraps long lines)
                o = {**o, "data": {k: base64.b64decode(v) for k, v in o["data"].items()}}
            return {k: normal(v) for k, v in o.items()}
        if isinstance(o, list):
            items = [normal(v) for v in o]
            named = all(isinstance(i, dict) and "name" in i for i in items)
            return sorted(items, key=lambda i: i["name"]) if named else items
        return o

    def keyed(objs):
        return {(o["kind"], o["metadata"].get("namespace"), o["metadata"]["name"]): normal(o) for o in objs if o}

    assert keyed(yaml.safe_load_all(out.stdout)) == keyed(rendered[overlay])


# ---------------------------------------------------------------------- the invariants
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_only_the_gateway_service_is_published_on_its_grpc_and_http_ports(rendered, overlay):
    services = objects(rendered, overlay, "Service")
    published = {name for name, s in services.items() if s["spec"].get("type", "ClusterIP") != "ClusterIP"}
    assert published == {"gateway"}
    assert services["gateway"]["spec"]["type"] == "LoadBalancer"
    ports = {p["name"]: p["containerPort"] for p in container(rendered, overlay, "gateway")["ports"]}
    assert sorted((port["port"], ports[port["targetPort"]]) for port in services["gateway"]["spec"]["ports"]) == \
        [(8000, 8000), (50051, 50051)]
    for name, deployment in objects(rendered, overlay, "Deployment").items():
        pod = deployment["spec"]["template"]["spec"]
        assert not (pod.get("hostNetwork") or pod.get("hostIPC") or pod.get("hostPID")), name
        assert all("hostPort" not in p for c in pod["containers"] for p in c.get("ports", [])), name
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        selecting = [s for s, svc in services.items() if svc["spec"]["selector"].items() <= labels.items()]
        assert selecting == ([name] if name in ("gateway", "redis") else []), name  # workers: no Service


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_each_pod_mounts_only_its_own_key_and_no_secret_holds_the_ca_key(rendered, overlay, ca_dir):
    """The gateway's key from its Secret; each worker pod's from cert-manager's CSI driver, a
    certificate naming the pod (the worker id it registers as: cluster.identity)."""
    ca_key = (ca_dir / "ca-key.pem").read_bytes()
    for secret in objects(rendered, overlay, "Secret"):
        assert all(ca_key not in value for value in secret_data(rendered, overlay, secret).values()), secret
    for role in ROLES:
        pod = objects(rendered, overlay, "Deployment")[role]["spec"]["template"]["spec"]
        cert_volumes = {v["name"]: v for v in pod["volumes"] if "secret" in v or "csi" in v}
        [volume] = cert_volumes.values()
        env = env_of(pod["containers"][0])
        if role == "gateway":
            assert volume["secret"]["secretName"] == "certs-gateway"
            certs = secret_data(rendered, overlay, "certs-gateway")
            assert set(certs) == {"ca.pem", "gateway.pem", "gateway-key.pem"}
            assert certs["gateway-key.pem"] == (ca_dir / "gateway-key.pem").read_bytes()
            assert "TANDEM_WORKER_ID" not in env
        else:
            csi = volume["csi"]
            assert (csi["driver"], csi["readOnly"]) == ("csi.cert-manager.io", True)
            attributes = {k.removeprefix("csi.cert-manager.io/"): v for k, v in csi["volumeAttributes"].items()}
            assert attributes["uri-sans"] == f"spiffe://tandem/{role}/${{POD_NAME}}"
            assert set(attributes["dns-names"].split(",")) == {"tandem-cluster", f"tandem-{role}", role}
            assert {"server auth", "client auth"} <= set(attributes["key-usages"].split(","))
            assert (attributes["certificate-file"], attributes["privatekey-file"], attributes["ca-file"]) == (
                f"{role}.pem", f"{role}-key.pem", "ca.pem")  # cluster.tls.TlsFiles' names
            assert (attributes["issuer-kind"], attributes["issuer-name"]) == ("ClusterIssuer", "tandem-ca")
            assert attributes["fs-group"] == str(pod["securityContext"]["fsGroup"])
            # the worker id is the pod's name, which the CSI driver's ${POD_NAME} is
            assert env["TANDEM_WORKER_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
        [mount] = [m for m in pod["containers"][0]["volumeMounts"] if m["name"] in cert_volumes]
        assert (mount["mountPath"], mount.get("readOnly")) == ("/certs", True)
        assert env["TANDEM_TLS_DIR"]["value"] == "/certs"
        secret_refs = [e["valueFrom"]["secretKeyRef"]["name"] for e in pod["containers"][0]["env"]
                       if "secretKeyRef" in e.get("valueFrom", {})]
        assert set(secret_refs) == ({"redis", "gateway-api-keys"} if role == "gateway" else {"redis"})


@pytest.mark.parametrize("overlay,gpus", [("small", 1), ("large", 2)])
def test_nvlink_multicast_is_off_in_every_gpu_container_and_tp_follows_the_gpus(rendered, overlay, gpus):
    gpu_containers = {}
    for deployment in objects(rendered, overlay, "Deployment").values():
        pod = deployment["spec"]["template"]["spec"]
        for c in pod.get("initContainers", []) + pod["containers"]:
            if "nvidia.com/gpu" in c.get("resources", {}).get("limits", {}):
                gpu_containers[c["name"]] = c
    assert set(gpu_containers) == {"prefill", "decode"}
    for name, c in gpu_containers.items():
        env = {k: e.get("value") for k, e in env_of(c).items()}
        assert NVLINK_MULTICAST_OFF.items() <= env.items(), name
        assert c["resources"]["limits"]["nvidia.com/gpu"] == gpus
        assert env.get("TANDEM_TENSOR_PARALLEL_SIZE", "1") == str(gpus)
    replicas = {n: d["spec"].get("replicas") for n, d in objects(rendered, overlay, "Deployment").items()}
    assert replicas == ({"redis": 1, "gateway": 2, "prefill": 1, "decode": 1} if overlay == "small"
                        else {"redis": 1, "gateway": 3, "prefill": 4, "decode": None})  # the autoscaler's


def resolved_env(c: dict, secrets: dict[str, dict[str, bytes]]) -> dict[str, str]:
    """A container's variables as the kubelet sets them: Secrets read, the pod IP filled in,
    ``$(NAME)`` replaced by an earlier variable's value."""
    env: dict[str, str] = {}
    for e in c["env"]:
        source = e.get("valueFrom", {})
        if "secretKeyRef" in source:
            value = secrets[source["secretKeyRef"]["name"]][source["secretKeyRef"]["key"]].decode()
        elif "fieldRef" in source:
            value = {"status.podIP": POD_IP, "metadata.name": POD_NAME}[source["fieldRef"]["fieldPath"]]
        else:
            value = re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], e["value"])
        env[e["name"]] = value
    return env


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_variable_is_a_real_setting_and_its_value_is_accepted(rendered, overlay, ca_dir, monkeypatch):
    secrets = {name: secret_data(rendered, overlay, name) for name in objects(rendered, overlay, "Secret")}
    for role, _, c in tandem_containers(rendered, overlay):
        cls: type[ServerSettings] = SETTINGS[role]
        names = {env_name(cls, name) for name in settings_fields(cls)}
        env = resolved_env(c, secrets)
        assert set(env) - names <= set(NVLINK_MULTICAST_OFF) | {"POD_IP"}, role
        for key in [k for k in os.environ if k.startswith("TANDEM_")]:
            monkeypatch.delenv(key)
        for key, value in {**env, "TANDEM_TLS_DIR": str(ca_dir)}.items():  # /certs exists only in the pod
            monkeypatch.setenv(key, value)
        settings = cls()  # refuses a value it does not accept, naming the setting
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert (int(settings.listen.rpartition(":")[2]), settings.metrics_port, settings.health_port) == \
            (ports["grpc"], ports["metrics"], ports["health"]), role
        if role != "gateway":
            assert settings.advertise == f"{POD_IP}:{ports['grpc']}"  # the registry gets the pod's address


def compose_services() -> dict[str, dict]:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]


def compose_value(raw: str) -> str:
    """A compose value with ``${VAR:-default}`` as its default (``${VAR:?...}``: required, kept)."""
    return re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", str(raw))


@pytest.mark.parametrize("overlay,suffix", [("small", ""), ("large", "-tp2")])
def test_settings_image_and_commands_mirror_docker_compose(rendered, overlay, suffix):
    services = compose_services()
    for role in ROLES:
        service = services[role if role == "gateway" else role + suffix]
        c = container(rendered, overlay, role)
        assert (c["image"], c["args"], "command" in c) == (service["image"], service["command"], False), role
        ours, theirs = env_of(c), {k: str(v) for k, v in service["environment"].items()}
        expected_extra = KUBERNETES_ONLY if role != "gateway" else {"TANDEM_HEALTH_PORT"}
        assert set(ours) - set(theirs) == expected_extra, role
        assert set(theirs) - set(ours) == (COMPOSE_TP2_ONLY if suffix and role != "gateway" else set()), role
        for name in set(ours) & set(theirs):
            if name in FROM_SECRETS:
                assert "${" in theirs[name] and ours[name]["valueFrom"]["secretKeyRef"] == dict(
                    zip(("name", "key"), FROM_SECRETS[name])), name
            elif name in FROM_POD:
                assert ours[name]["valueFrom"]["fieldRef"]["fieldPath"] == FROM_POD[name], name
            else:
                assert ours[name].get("value") == compose_value(theirs[name]), (role, name)
        assert {int(p) for p in service.get("expose", [])} <= {p["containerPort"] for p in c["ports"]}, role
    redis = container(rendered, overlay, "redis")
    assert (redis["image"], redis["args"]) == (services["redis"]["image"],
                                               [a.replace("$$", "$") for a in services["redis"]["command"]])
    assert env_of(redis)["REDISCLI_AUTH"]["valueFrom"]["secretKeyRef"] == {"name": "redis", "key": "password"}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_grpc_probes_ask_the_health_port_for_what_the_servers_serve(rendered, overlay):
    for role, _, c in tandem_containers(rendered, overlay):
        health_port = int(env_of(c)["TANDEM_HEALTH_PORT"]["value"])
        probes = {kind: c[kind]["grpc"] for kind in ("startupProbe", "livenessProbe", "readinessProbe")}
        assert {p["port"] for p in probes.values()} == {health_port}, role
        assert (probes["startupProbe"]["service"], probes["livenessProbe"]["service"]) == (LIVENESS, LIVENESS)
        assert probes["readinessProbe"]["service"] == READINESS_SERVICE[role]
        assert c["startupProbe"]["periodSeconds"] * c["startupProbe"]["failureThreshold"] >= \
            (300 if role != "gateway" else 60)  # compose's start_period: a worker loads its model first
    for service in objects(rendered, overlay, "Service").values():  # the probe port is never exposed
        assert all(p["targetPort"] != "health" for p in service["spec"]["ports"])


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_grace_period_covers_prestop_drain_and_shutdown(rendered, overlay):
    for role, deployment, c in tandem_containers(rendered, overlay):
        pre_stop = c.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", [])
        sleep_s = float(pre_stop[1]) if pre_stop[:1] == ["sleep"] else 0.0
        assert (sleep_s > 0) == (role == "gateway")  # the gateway waits to leave the Service's endpoints
        drain_s = float(env_of(c)["TANDEM_DRAIN_TIMEOUT_S"]["value"])
        grace_s = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        assert grace_s >= sleep_s + drain_s + SHUTDOWN_OVERRUN_S, role


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_pool_has_a_disruption_budget(rendered, overlay):
    budgets = objects(rendered, overlay, "PodDisruptionBudget")
    for role in ROLES:
        labels = objects(rendered, overlay, "Deployment")[role]["spec"]["template"]["metadata"]["labels"]
        matching = [n for n, b in budgets.items() if b["spec"]["selector"]["matchLabels"].items() <= labels.items()]
        assert matching == [role]
        assert budgets[role]["spec"]["maxUnavailable"] == 1


def test_the_autoscaler_scales_the_decode_pool_on_metrics_the_gateway_exports(rendered):
    [hpa] = objects(rendered, "large", "HorizontalPodAutoscaler").values()
    assert hpa["apiVersion"] == "autoscaling/v2"
    target = objects(rendered, "large", "Deployment")[hpa["spec"]["scaleTargetRef"]["name"]]
    assert target["metadata"]["name"] == "decode"
    assert "replicas" not in target["spec"]  # re-applying the overlay must not reset what it scaled
    exported = {m._name for m in vars(gateway_metrics).values() if hasattr(m, "_name")}
    names = {m["external"]["metric"]["name"] for m in hpa["spec"]["metrics"] if m["type"] == "External"}
    assert names == {"tandem_gateway_requests_in_flight", "tandem_gateway_requests_waiting"}
    assert names <= exported
    assert not objects(rendered, "small", "HorizontalPodAutoscaler")
