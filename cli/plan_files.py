"""The files that deploy a planned layout (:mod:`cli.planner`): a Compose override for one GPU host
and a kustomize overlay for Kubernetes.

**Compose.** docker-compose.yml runs one ``prefill`` and one ``decode`` service, each pinned to
its GPUs (``device_ids``). Replicas of one service would all get the same GPUs, and Compose merges
an override's ``devices`` into the base file's list instead of replacing it (Compose v1 appends),
so the override gives each planned worker a service of its own (``prefill-0``, ``decode-0``,
...): the base file's service as it resolves (its anchors expanded), with its GPUs — consecutive
ones, as :func:`cli.launcher.gpu_placement` lays workers out — and its TP size, registering as
its service name (``TANDEM_WORKER_ID``) with a certificate naming it in a volume of its own
(``certs-prefill-0``, ...: the gateway routes only to a registry entry whose address presents its
instance's certificate, :mod:`cluster.identity`), issued by the ``certs`` service, which the
override replaces to issue them; it puts the base ``prefill`` and ``decode`` services under a
profile nobody starts. The override is therefore a copy of those services: regenerate it after
changing them. The image has certificate mount points for ``MAX_WORKERS_PER_ROLE`` workers per role.

**Kubernetes.** The overlay lists the base and the Secrets, sets the pools' replica counts (a
pool of 0 keeps its Deployment, scaled to none), and patches a pool's TP size and GPU count where
it is not 1, as ``components/tp2`` does for both pools at 2.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path

import yaml

from cli.launcher import gpu_placement
from cli.planner import Layout

UNPLANNED_PROFILE = "unplanned"  # the profile the base file's workers are put under
MAX_WORKERS_PER_ROLE = 8  # the Dockerfile's /certs/{role}-{i} mount points
GATEWAY_REPLICAS = 2  # as overlays/small


class _Dumper(yaml.SafeDumper):
    """Writes every mapping out (no ``&id001`` anchors for the objects the base file shares)."""

    def ignore_aliases(self, data) -> bool:
        return True


def planned_workers(layout: Layout) -> list[tuple[str, str, int]]:
    """``(service name, role, tensor-parallel size)`` of each worker of ``layout``, prefill
    workers first."""
    return [(f"prefill-{i}", "prefill", layout.prefill_tp) for i in range(layout.prefill_workers)] + \
        [(f"decode-{i}", "decode", layout.decode_tp) for i in range(layout.decode_workers)]


def compose_override(layout: Layout, compose_file: str | Path, comment: str) -> str:
    """The override of ``compose_file`` that runs ``layout`` on one host of ``layout.gpus`` GPUs
    (module docstring); ``comment`` heads it (one ``#`` line per line).

    Raises:
        OSError: ``compose_file`` cannot be read.
        KeyError: it has no ``prefill``, ``decode`` or ``certs`` service.
        ValueError: more than ``MAX_WORKERS_PER_ROLE`` workers of a role.
    """
    services = yaml.safe_load(Path(compose_file).read_text())["services"]
    workers = planned_workers(layout)
    if max(layout.prefill_workers, layout.decode_workers) > MAX_WORKERS_PER_ROLE:
        raise ValueError(f"a Compose host runs at most {MAX_WORKERS_PER_ROLE} workers of a role (the image's "
                         f"certificate mount points), the layout has {layout.label}")
    first_gpu = gpu_placement([(name, tp) for name, _, tp in workers], layout.gpus)
    planned = {role: {"profiles": [UNPLANNED_PROFILE]} for role in ("prefill", "decode")}
    for name, role, tp in workers:
        service = copy.deepcopy(services[role])
        service.pop("profiles", None)
        gpus = [str(g) for g in range(first_gpu[name], first_gpu[name] + tp)]
        service["deploy"] = {"resources": {"reservations": {"devices": [
            {"driver": "nvidia", "device_ids": gpus, "capabilities": ["gpu"]}]}}}
        service["environment"] = {**service["environment"], "TANDEM_TENSOR_PARALLEL_SIZE": str(tp),
                                  "TANDEM_WORKER_ID": name}
        service["volumes"] = [f"certs-{name}:/certs:ro" if v == f"certs-{role}:/certs:ro" else v
                              for v in service["volumes"]]
        planned[name] = service
    certs = copy.deepcopy(services["certs"])
    certs["command"] = ["sh", "-c", "test -f /certs/gateway/ca.pem || (tandem certs init /tmp/ca && cp -p "
                        "/tmp/ca/ca.pem /tmp/ca/gateway.pem /tmp/ca/gateway-key.pem /certs/gateway/"
                        + "".join(f" && tandem certs issue /tmp/ca {role} {name} --out /certs/{name}"
                                  for name, role, _ in workers) + ")"]
    certs["volumes"] = ["certs-gateway:/certs/gateway", *(f"certs-{name}:/certs/{name}" for name, _, _ in workers)]
    planned["certs"] = certs
    note = (f"{comment}\n\nThe planned workers are {Path(compose_file).name}'s prefill and decode services as they "
            f"were when this was\nwritten: write it again after changing them.")
    return _comment(note) + yaml.dump({"services": planned, "volumes": {f"certs-{name}": {} for name, _, _ in workers}},
                                      Dumper=_Dumper, sort_keys=False)


def kubernetes_overlay(layout: Layout, overlay_dir: str | Path, kubernetes_dir: str | Path,
                       comment: str) -> dict[str, str]:
    """The files of a kustomize overlay in ``overlay_dir`` over ``kubernetes_dir``'s ``base`` and
    ``secrets`` (module docstring): file name → text; ``comment`` heads the kustomization."""
    base = Path(os.path.relpath(Path(kubernetes_dir).resolve(), Path(overlay_dir).resolve()))
    files, patches = {}, []
    for role, tp in (("prefill", layout.prefill_tp), ("decode", layout.decode_tp)):
        if tp > 1 and (layout.prefill_workers if role == "prefill" else layout.decode_workers):
            patches.append({"path": f"{role}-tp.yaml"})
            files[f"{role}-tp.yaml"] = yaml.dump(_tp_patch(role, tp), Dumper=_Dumper, sort_keys=False)
    kustomization = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization", "namespace": "tandem",
        "resources": [(base / "base").as_posix(), (base / "secrets").as_posix()],
        **({"patches": patches} if patches else {}),
        "replicas": [{"name": "gateway", "count": GATEWAY_REPLICAS},
                     {"name": "prefill", "count": layout.prefill_workers},
                     {"name": "decode", "count": layout.decode_workers}],
    }
    files["kustomization.yaml"] = _comment(comment) + yaml.dump(kustomization, Dumper=_Dumper, sort_keys=False)
    return files


def _comment(text: str) -> str:
    """``text`` as YAML comment lines."""
    return "".join(f"# {line}\n" if line else "#\n" for line in text.splitlines())


def _tp_patch(role: str, tp: int) -> dict:
    """A strategic-merge patch giving ``role``'s Deployment ``tp`` ranks and as many GPUs."""
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": role},
            "spec": {"template": {"spec": {"containers": [{
                "name": role, "env": [{"name": "TANDEM_TENSOR_PARALLEL_SIZE", "value": str(tp)}],
                "resources": {"limits": {"nvidia.com/gpu": tp}}}]}}}}
