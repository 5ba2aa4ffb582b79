"""What the deployment tests share: ``docker-compose config`` on the repository's file (and
overrides of it), and a copy of deploy/kubernetes with the Secrets' files an operator puts there."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from gateway.auth import hash_key
from tests.helpers.paths import ROOT


def compose_config(*args: str, env: dict[str, str] | None = None,
                   overrides: tuple[Path, ...] = ()) -> subprocess.CompletedProcess:
    """``docker-compose -f docker-compose.yml [-f OVERRIDE...] [ARGS] config`` on the
    repository's file, ``TANDEM_*`` variables of this process left out (``env``: the ones to set)."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_")}
    files = [arg for path in (ROOT / "docker-compose.yml", *overrides) for arg in ("-f", str(path))]
    return subprocess.run(["docker-compose", *files, *args, "config"],
                          capture_output=True, text=True, timeout=60, env={**clean, **(env or {})})


def kubernetes_copy(destination: Path, ca_dir: Path) -> Path:
    """A copy of deploy/kubernetes at ``destination`` whose secrets/ holds what an operator puts
    there (the certificates of ``ca_dir``, a `tandem certs init` directory, and the CA's key
    besides, which must reach no Secret; a Redis password; one API key)."""
    # Not the files a developer may have put in secrets/ for a real cluster: only the generator.
    shutil.copytree(ROOT / "deploy" / "kubernetes", destination, ignore=lambda d, names: [
        n for n in names if Path(d).name == "secrets" and n != "kustomization.yaml"])
    for pem in ca_dir.iterdir():
        shutil.copy(pem, destination / "secrets" / pem.name)
    (destination / "secrets" / "redis.env").write_text("password=s3cret\n")
    (destination / "secrets" / "api-keys.env").write_text(f"TANDEM_API_KEYS={hash_key('a-key')}:me\n")
    return destination
