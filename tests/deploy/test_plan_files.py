"""What `tandem plan` writes deploys the layout it chose: the Compose override is accepted by
``docker-compose config`` with each planned worker on its own GPUs at its TP size and the base
file's workers left out, and the kustomize overlay renders and validates against the Kubernetes
schemas (strict) with the pools' replicas, TP sizes and GPUs."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from cli.plan_files import UNPLANNED_PROFILE, compose_override, kubernetes_overlay
from cli.planner import Layout
from cluster.tls import init_certs
from tests.helpers.deploy import compose_config, kubernetes_copy, parse_image, volume_source_target
from tests.helpers.kustomize_render import render
from tests.helpers.paths import ROOT

KUBERNETES_VERSIONS = ("1.27", "1.37")
needs_compose = pytest.mark.skipif(shutil.which("docker-compose") is None, reason="docker-compose not installed")
LAYOUTS = [Layout(3, 1, 1, 1), Layout(0, 0, 2, 2), Layout(1, 2, 2, 1), Layout(2, 1, 3, 2)]


@pytest.fixture(scope="module")
def kubernetes_dir(tmp_path_factory) -> Path:
    ca = tmp_path_factory.mktemp("ca")
    init_certs(str(ca), ["tandem.example.com"])
    return kubernetes_copy(tmp_path_factory.mktemp("deploy") / "kubernetes", ca)


def planned_services(override: Path) -> dict[str, dict]:
    out = compose_config(env={"TANDEM_REDIS_PASSWORD": "s3cret"}, overrides=(override,))
    assert out.returncode == 0, out.stderr
    return yaml.safe_load(out.stdout)["services"]


def gpus_of(service: dict) -> list[str]:
    [device] = service["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
    return device["device_ids"]


def check_compose(services: dict[str, dict], layout: Layout) -> None:
    """Each planned worker a service on GPUs of its own, consecutive, all of the host's used once;
    the base workers under a profile nobody starts; everything else as the base file has it."""
    base = yaml.safe_load(compose_config(env={"TANDEM_REDIS_PASSWORD": "s3cret"}).stdout)["services"]
    for role in ("prefill", "decode"):
        assert services[role]["profiles"] == [UNPLANNED_PROFILE]
    planned = {name: s for name, s in services.items() if name not in base}
    expected = [f"prefill-{i}" for i in range(layout.prefill_workers)] + \
        [f"decode-{i}" for i in range(layout.decode_workers)]
    assert sorted(planned) == sorted(expected)
    used = []
    for name, service in planned.items():
        role = name.rpartition("-")[0]
        tp = layout.prefill_tp if role == "prefill" else layout.decode_tp
        gpus = gpus_of(service)
        assert len(gpus) == tp and [int(g) for g in gpus] == list(range(int(gpus[0]), int(gpus[0]) + tp)), name
        used += gpus
        assert service["environment"].pop("TANDEM_TENSOR_PARALLEL_SIZE") == str(tp)
        assert service["environment"].pop("TANDEM_WORKER_ID") == name  # the instance its certificate names
        assert "profiles" not in service
        volumes = [volume_source_target(v) for v in service["volumes"]]
        assert (f"certs-{name}", "/certs") in volumes and (f"certs-{role}", "/certs") not in volumes, name
        same = {k: v for k, v in base[role].items() if k not in ("deploy", "profiles", "volumes")}
        same["environment"] = {k: v for k, v in same["environment"].items() if k != "TANDEM_WORKER_ID"}
        assert {k: v for k, v in service.items() if k not in ("deploy", "volumes")} == same, name
    assert sorted(used, key=int) == [str(g) for g in range(layout.gpus)]


def check_overlay(objects: list[dict], layout: Layout) -> None:
    """Strictly valid objects, the pools' replicas, TP sizes and GPUs as planned."""
    for version in KUBERNETES_VERSIONS:
        for obj in objects:
            assert kubernetes_validate.validate(obj, version, strict=True) == version, obj["metadata"]["name"]
    deployments = {o["metadata"]["name"]: o for o in objects if o["kind"] == "Deployment"}
    assert {name: d["spec"]["replicas"] for name, d in deployments.items()} == {
        "redis": 1, "gateway": 2, "prefill": layout.prefill_workers, "decode": layout.decode_workers}
    for role, tp in (("prefill", layout.prefill_tp or 1), ("decode", layout.decode_tp)):
        [c] = deployments[role]["spec"]["template"]["spec"]["containers"]
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert env.get("TANDEM_TENSOR_PARALLEL_SIZE", "1") == str(tp), role
        assert c["resources"]["limits"]["nvidia.com/gpu"] == tp, role
    assert {o["metadata"].get("namespace") for o in objects if o["kind"] != "Namespace"} == {"tandem"}


@needs_compose
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: layout.label)
def test_a_compose_override_runs_each_planned_worker_on_its_gpus(tmp_path, layout):
    override = tmp_path / "plan.yml"
    override.write_text(compose_override(layout, ROOT / "docker-compose.yml", "a plan\n\nits command"))
    assert override.read_text().startswith("# a plan\n#\n# its command\n")
    check_compose(planned_services(override), layout)


def test_the_override_issues_each_planned_worker_a_certificate_naming_it_in_a_volume_of_its_own(tmp_path):
    """The override's certs script, run here with its paths under ``tmp_path`` (as
    tests/deploy/test_compose.py runs the base file's): every planned worker's volume holds the CA
    certificate and a certificate naming the worker's service name, at a mount point the image
    makes owned by its user."""
    from cluster.identity import certificate_instances

    layout = Layout(2, 1, 3, 2)
    override = yaml.safe_load(compose_override(layout, ROOT / "docker-compose.yml", "a plan"))
    certs = override["services"]["certs"]
    owned = parse_image((ROOT / "Dockerfile").read_text()).owned_dirs
    script = (certs["command"][2].replace("/tmp/ca", str(tmp_path / "ca")).replace("/certs", str(tmp_path / "certs"))
              .replace("tandem ", f"{sys.executable} -m cli "))
    for volume in certs["volumes"]:
        name, target = volume.split(":")
        assert target in owned, target
        (tmp_path / target.lstrip("/")).mkdir(parents=True)
    subprocess.run(["sh", "-c", script], cwd=ROOT, check=True, timeout=120, capture_output=True)
    workers = [f"prefill-{i}" for i in range(2)] + [f"decode-{i}" for i in range(3)]
    assert set(override["volumes"]) == {f"certs-{w}" for w in workers}
    for worker in workers:
        role = worker.rpartition("-")[0]
        files = tmp_path / "certs" / worker
        assert {p.name for p in files.iterdir()} == {"ca.pem", f"{role}.pem", f"{role}-key.pem"}
        assert certificate_instances((files / f"{role}.pem").read_bytes(), role) == [worker]
        assert override["services"][worker]["environment"]["TANDEM_WORKER_ID"] == worker
        assert f"certs-{worker}:/certs:ro" in override["services"][worker]["volumes"]
    with pytest.raises(ValueError, match="at most 8 workers"):
        compose_override(Layout(0, 0, 9, 1), ROOT / "docker-compose.yml", "too many")


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: layout.label)
def test_a_kubernetes_overlay_scales_the_pools_and_sets_their_tp(kubernetes_dir, layout):
    overlay = kubernetes_dir / "overlays" / f"plan-{layout.prefill_workers}-{layout.decode_workers}"
    overlay.mkdir()
    for name, text in kubernetes_overlay(layout, overlay, kubernetes_dir, "a plan").items():
        (overlay / name).write_text(text)
    check_overlay(render(overlay), layout)


@needs_compose
def test_tandem_plan_prints_the_candidates_and_writes_files_that_deploy_its_choice(tmp_path, kubernetes_dir):
    override, overlay = tmp_path / "plan.yml", tmp_path / "overlay"
    out = subprocess.run([sys.executable, "-m", "cli", "plan", "--gpus", "4", "--workload", "interference",
                          "--ttft", "0.5", "--tpot", "0.02", "--compose-override", str(override),
                          "--kubernetes-overlay", str(overlay), "--kubernetes-dir", str(kubernetes_dir)],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    rows = [line for line in out.stdout.splitlines() if " TP" in line and "│" in line]
    assert len(rows) == 6  # every layout of 4 GPUs (tests/cli/test_planner.py lists them)
    [chosen] = [row for row in rows if "* " in row]
    assert rows[0] == chosen
    label = chosen.split("│")[1].strip().removeprefix("* ")
    assert f"chosen: {label}, predicted goodput" in out.stdout
    prefills, prefill_tp, decodes, decode_tp = re.fullmatch(r"(?:(\d+)P TP(\d+) \+ )?(\d+)D TP(\d+).*", label).groups()
    layout = Layout(int(prefills or 0), int(prefill_tp or 0), int(decodes), int(decode_tp))
    assert label == layout.label
    check_compose(planned_services(override), layout)
    check_overlay(render(overlay), layout)
