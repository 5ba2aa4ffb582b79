"""What the deployment tests share: ``docker-compose config`` on the repository's file (and
overrides of it), what the Dockerfile says about the image's user and directories, a compose
volume's source and target, and a copy of deploy/kubernetes with the Secrets' files an operator
puts there."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
from dataclasses import dataclass
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


@dataclass(frozen=True)
class Image:
    """What the Dockerfile says about the image's user and directories.

    Attributes:
        user: the last ``USER``: who the image runs as.
        uid: that user's ``useradd --uid``.
        owned_dirs: directories an ``install -d -o USER`` makes, owned by the user.
    """

    user: str
    uid: int
    owned_dirs: frozenset[str]


def instructions(dockerfile: str) -> list[tuple[str, str]]:
    """``(INSTRUCTION, arguments)`` of a Dockerfile: comments dropped, continuation lines joined."""
    joined, current = [], ""
    for line in dockerfile.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            current += line[:-1] + " "
            continue
        joined.append(current + line)
        current = ""
    return [(word.upper(), rest.strip()) for word, _, rest in (line.partition(" ") for line in joined)]


def shell_commands(run: str) -> list[list[str]]:
    """A ``RUN`` line's commands (split at ``&&`` and ``;``), each as its words."""
    commands, words = [], []
    for word in shlex.split(run):
        if word in ("&&", ";"):
            commands.append(words)
            words = []
        else:
            words.append(word)
    return [c for c in commands + [words] if c]


def parse_image(dockerfile: str) -> Image:
    """The image's user, its uid, and the directories made owned by it (module docstring)."""
    steps = instructions(dockerfile)
    [user] = [args for word, args in steps if word == "USER"][-1:]
    uid, owned = None, set()
    for word, args in steps:
        if word != "RUN":
            continue
        for command in shell_commands(args):
            if command[0] == "useradd" and command[-1] == user:
                uid = int(command[command.index("--uid") + 1])
            if command[0] == "install" and "-d" in command:
                owner = command[command.index("-o") + 1] if "-o" in command else "root"
                paths = [w for i, w in enumerate(command[1:], 1) if w.startswith("/") and command[i - 1] != "-m"]
                if owner == user:
                    owned.update(paths)
    assert uid is not None, f"no `useradd --uid N {user}` in the Dockerfile"
    return Image(user, uid, frozenset(owned))


def volume_source_target(volume) -> tuple[str, str]:
    """A service's volume as (source, target): the long syntax or ``source:target[:mode]``."""
    if isinstance(volume, dict):
        return volume.get("source", ""), volume["target"]
    source, _, rest = str(volume).partition(":")
    return source, rest.partition(":")[0]
