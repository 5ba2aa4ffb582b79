"""docker-compose.yml and the Dockerfile, checked without a Docker engine: every named volume a
service of the image mounts has its mount point made in the image, owned by the user the image
runs as (Docker would make a missing one owned by root, and the ``certs`` service could not
write its volumes); no service runs as root; the ``certs`` service's script gives each role its
own files and the gateway the host's names; and ``docker-compose config`` (Compose v1, whose
merge rules are the strictest the recipe meets) accepts the file with the GPU layout and the CPU
variant it promises."""

from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
import sys

import pytest
import yaml

from cluster.tls import ROLES
from tests.helpers.deploy import Image, compose_config, parse_image, volume_source_target
from tests.helpers.paths import ROOT

IMAGE = "tandem:latest"
WORKERS = ("prefill", "decode", "prefill-tp2", "decode-tp2", "prefill-cpu", "decode-cpu")


def compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def test_the_dockerfile_parser_reads_users_and_owned_directories():
    image = parse_image("FROM x\n# a comment\nRUN useradd --uid 7 app \\\n"
                        "    && install -d -o app -g app /a /b && install -d -m 0700 /root-owned\nUSER app\n")
    assert image == Image("app", 7, frozenset({"/a", "/b"}))


def test_every_named_volume_of_the_image_mounts_where_the_image_made_it_owned_by_its_user():
    image = parse_image((ROOT / "Dockerfile").read_text())
    assert image.user != "root" and image.uid != 0
    spec = compose()
    named = set(spec["volumes"])
    checked = 0
    for name, service in spec["services"].items():
        if service["image"] != IMAGE:
            continue
        assert "user" not in service, name  # the image's user, for whom its mount points are made
        for volume in service.get("volumes", []):
            source, target = volume_source_target(volume)
            if source in named:
                assert target in image.owned_dirs, f"{name}: {target} is not made owned by {image.user} in the Dockerfile"
                checked += 1
    assert checked >= 3 * len(ROLES)  # the certs service's three, and each server's cache and certificates


def test_no_service_runs_as_root_and_kubernetes_runs_the_same_users():
    image = parse_image((ROOT / "Dockerfile").read_text())
    services = compose()["services"]
    redis_pod = yaml.safe_load((ROOT / "deploy/kubernetes/base/redis.yaml").read_text().split("\n---\n")[0])
    redis_user = redis_pod["spec"]["template"]["spec"]["securityContext"]["runAsUser"]
    for name, service in services.items():
        if service["image"] == IMAGE:
            continue
        # another image: its entrypoint's switch to a user is skipped by a `sh -c` command
        assert str(service.get("user", "root")).partition(":")[0] not in ("root", "0"), name
    assert services["redis"]["user"] == str(redis_user)
    for role in ROLES:
        pod = yaml.safe_load((ROOT / f"deploy/kubernetes/base/{role}.yaml").read_text().split("\n---\n")[0])
        assert pod["spec"]["template"]["spec"]["securityContext"]["runAsUser"] == image.uid, role


def test_the_certs_service_gives_each_role_its_own_files_and_the_gateway_the_hosts_names(tmp_path):
    """The service's own script, run here with its paths moved under ``tmp_path`` (and ``tandem``
    as this checkout's CLI) over the mount points the image makes: each role's volume gets the CA
    certificate and that role's pair only, keys private, the gateway's certificate the names of
    TANDEM_GATEWAY_SANS, a worker's its instance; a second start keeps what the first made."""
    from cryptography import x509

    from cluster.identity import certificate_instances

    service = compose()["services"]["certs"]
    assert service["environment"]["TANDEM_GATEWAY_SANS"] == "${TANDEM_GATEWAY_SANS:-}"
    shell, flag, script = service["command"]
    assert (shell, flag) == ("sh", "-c")
    script = (script.replace("$$", "$").replace("/tmp/ca", str(tmp_path / "ca"))
              .replace("/certs", str(tmp_path / "certs")).replace("tandem ", f"{sys.executable} -m cli "))
    for role in ROLES:
        (tmp_path / "certs" / role).mkdir(parents=True)
    env = {**os.environ, "TANDEM_GATEWAY_SANS": "tandem.example.com,203.0.113.7"}
    subprocess.run(["sh", "-c", script], cwd=ROOT, env=env, check=True, timeout=120, capture_output=True)
    for role in ROLES:
        volume = tmp_path / "certs" / role
        assert {p.name for p in volume.iterdir()} == {"ca.pem", f"{role}.pem", f"{role}-key.pem"}, role
        assert stat.S_IMODE((volume / f"{role}-key.pem").stat().st_mode) == 0o600
        names = x509.load_pem_x509_certificate((volume / f"{role}.pem").read_bytes()).extensions.get_extension_for_class(
            x509.SubjectAlternativeName).value
        hosts = {"tandem.example.com", "203.0.113.7"}
        given = set(names.get_values_for_type(x509.DNSName)) | {str(ip) for ip in names.get_values_for_type(x509.IPAddress)}
        assert (hosts <= given) == (role == "gateway"), role
        # a worker's names its instance, the worker id its services register under
        assert certificate_instances((volume / f"{role}.pem").read_bytes(), role) == (
            [] if role == "gateway" else [f"{role}-0"]), role
    assert not list((tmp_path / "certs").rglob("ca-key.pem"))
    made = (tmp_path / "certs" / "gateway" / "gateway.pem").read_bytes()
    subprocess.run(["sh", "-c", script], cwd=ROOT, env=env, check=True, timeout=120, capture_output=True)
    assert (tmp_path / "certs" / "gateway" / "gateway.pem").read_bytes() == made


# ------------------------------------------------------------------ docker-compose config
needs_compose = pytest.mark.skipif(shutil.which("docker-compose") is None, reason="docker-compose not installed")


@needs_compose
def test_compose_file_is_valid_and_workers_have_no_host_ports():
    refused = compose_config()
    assert refused.returncode != 0 and "TANDEM_REDIS_PASSWORD" in refused.stderr  # no Redis without one
    out = compose_config(env={"TANDEM_REDIS_PASSWORD": "s3cret"})
    assert out.returncode == 0, out.stderr

    services = yaml.safe_load(out.stdout)["services"]
    assert set(services) == {"redis", "certs", "gateway", *WORKERS}
    # a two-GPU host: each worker on its own GPU; the tp2 profile's workers on both, at TP=2
    placement = {"prefill": (["0"], None), "decode": (["1"], None), "prefill-tp2": (["0", "1"], "2"),
                 "decode-tp2": (["0", "1"], "2")}
    for worker, (gpus, tp) in placement.items():
        assert "ports" not in services[worker] and "container_name" not in services[worker]
        [device] = services[worker]["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and device["device_ids"] == gpus
        assert services[worker]["environment"].get("TANDEM_TENSOR_PARALLEL_SIZE") == tp
        assert services[worker].get("profiles") == (["tp2"] if tp else None)

    def host_and_target(port) -> tuple[str, int]:  # a long-syntax dict or "[host:]published:target[/tcp]"
        if isinstance(port, dict):
            return port.get("host_ip", ""), int(port["target"])
        parts = port.split("/")[0].split(":")
        return (parts[0] if len(parts) == 3 else ""), int(parts[-1])

    published = dict(host_and_target(p)[::-1] for p in services["gateway"]["ports"])
    # gRPC and the OpenAI-compatible HTTP API on every interface, metrics on loopback
    assert published == {50051: "", 8000: "", 9400: "127.0.0.1"}
    for name in ("gateway", *WORKERS):
        env_of = services[name]["environment"]
        assert env_of["TANDEM_REDIS_PASSWORD"] == "s3cret" and env_of["TANDEM_TLS_DIR"] == "/certs"
        # each role sees its own certificate volume only, read-only
        volumes = [v for v in services[name]["volumes"] if volume_source_target(v)[0].startswith("certs")]
        role = re.sub(r"-(tp2|cpu)$", "", name)
        # a worker registers as the instance its certificate names (the certs service's)
        assert env_of.get("TANDEM_WORKER_ID") == (None if role == "gateway" else f"{role}-0"), name
        assert [volume_source_target(v) for v in volumes] == [(f"certs-{role}", "/certs")], volumes
        assert all(v.get("read_only") if isinstance(v, dict) else str(v).endswith(":ro") for v in volumes), volumes
    assert services["redis"]["environment"]["REDISCLI_AUTH"] == "s3cret"
    assert services["certs"]["environment"]["TANDEM_GATEWAY_SANS"] == ""


@needs_compose
def test_the_gateway_certificate_names_reach_the_certs_service():
    out = compose_config(env={"TANDEM_REDIS_PASSWORD": "s3cret", "TANDEM_GATEWAY_SANS": "gw.example.com,203.0.113.7"})
    assert out.returncode == 0, out.stderr
    assert yaml.safe_load(out.stdout)["services"]["certs"]["environment"]["TANDEM_GATEWAY_SANS"] == \
        "gw.example.com,203.0.113.7"


@needs_compose
@pytest.mark.parametrize("threads", [None, "3"])
def test_the_cpu_profile_runs_the_same_workers_without_gpus_on_a_set_thread_count(threads):
    env = {"TANDEM_REDIS_PASSWORD": "s3cret", **({"TANDEM_THREADS_PER_WORKER": threads} if threads else {})}
    out = compose_config("--profile", "cpu", env=env)
    assert out.returncode == 0, out.stderr
    services = yaml.safe_load(out.stdout)["services"]
    for role in ("prefill", "decode"):
        gpu, cpu = services[role], services[f"{role}-cpu"]
        assert cpu.get("profiles") == ["cpu"]
        assert "resources" not in cpu.get("deploy", {}), cpu["deploy"]  # no GPU reservation, no nvidia driver
        assert cpu["environment"].pop("OMP_NUM_THREADS") == (threads or "1")  # PyTorch's threads per worker
        assert cpu["environment"]["TANDEM_DTYPE"] == "auto"  # float32 on the CPU, bfloat16 on a GPU
        assert "OMP_NUM_THREADS" not in gpu["environment"]
        same = ("image", "command", "environment", "volumes", "depends_on", "expose", "healthcheck", "ipc")
        assert {k: cpu.get(k) for k in same} == {k: gpu.get(k) for k in same}, role
