"""Per-client environments, built under the work dir and reused while their inputs match.

Clients whose libraries clash (paho 1.6 vs 2.x, amqtt) get separate virtualenvs; Node
clients share one npm prefix; the Debian clients come from apt-get; the Qpid Proton C
examples are compiled here at run time (never copied into the repository). Each build
lives in a directory named by a hash of its inputs, so a second run costs nothing.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

PIP_TIMEOUT = 300
# What pip / npm / apt print when the registry simply does not have the package.
MISSING = (
    "No matching distribution found",
    "npm ERR! code E404",
    "npm ERR! code ETARGET",
    "Unable to locate package",
)
LIBDIR = Path("/usr/lib/x86_64-linux-gnu")


@dataclass(frozen=True)
class Spec:
    """What an environment needs: a kind and its pinned inputs."""

    name: str
    kind: str  # "project" | "venv" | "npm" | "apt" | "qpid-c"
    requirements: tuple[str, ...] = ()


@dataclass
class Prepared:
    """How to run a driver in the environment, or why it could not be built."""

    command: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    error: str | None = None
    unavailable: bool = False  # the registry does not have it: cells are "unsupported"


def prepare(spec: Spec, repo: Path, workdir: Path) -> Prepared:
    """Build (or reuse) one environment; errors come back in `Prepared.error`."""
    project_python = [str(repo / ".venv/bin/python")]
    try:
        if spec.kind == "project":
            return Prepared(project_python)
        if spec.kind == "venv":
            return _venv(spec, workdir)
        if spec.kind == "npm":
            return _npm(spec, workdir)
        if spec.kind == "apt":
            _apt(spec.requirements)
            return Prepared(project_python)
        if spec.kind == "qpid-c":
            return Prepared(project_python, {"QPID_C_BIN": str(_qpid_c(workdir))})
        return Prepared(error=f"unknown environment kind {spec.kind}")
    except Exception as exc:  # every failure is reported in the matrix
        text = str(exc)
        return Prepared(error=f"{spec.name}: {text}", unavailable=any(m in text for m in MISSING))


def _key(*parts: str) -> str:
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:12]


def _run(argv: list[str], timeout: float = PIP_TIMEOUT) -> None:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[:4])}...: {(done.stderr or done.stdout)[-600:]}")


def _venv(spec: Spec, workdir: Path) -> Prepared:
    path = workdir / "envs" / f"{spec.name}-{_key(sys.version, *spec.requirements)}"
    python = path / "bin/python"
    if not (path / ".ok").exists():
        shutil.rmtree(path, ignore_errors=True)
        _run([sys.executable, "-m", "venv", str(path)])
        _run([str(python), "-m", "pip", "install", "-q", *spec.requirements])
        (path / ".ok").touch()
    return Prepared([str(python)])


def _npm(spec: Spec, workdir: Path) -> Prepared:
    if shutil.which("node") is None or shutil.which("npm") is None:
        _apt(("nodejs", "npm"))
    path = workdir / "envs" / f"{spec.name}-{_key(*spec.requirements)}"
    if not (path / ".ok").exists():
        shutil.rmtree(path, ignore_errors=True)
        path.mkdir(parents=True)
        _run(
            ["npm", "install", "--no-audit", "--no-fund", "--prefix", str(path), *spec.requirements]
        )
        (path / ".ok").touch()
    return Prepared(["node"], {"NODE_PATH": str(path / "node_modules")})


def _apt(packages: tuple[str, ...]) -> None:
    """Install the Debian packages that are missing (dpkg decides, not PATH)."""
    missing = [
        p
        for p in packages
        if subprocess.run(["dpkg", "-s", p], capture_output=True).returncode != 0
    ]
    if missing:
        _run(["apt-get", "install", "-y", "--no-install-recommends", *missing], timeout=600)


def _qpid_c(workdir: Path) -> Path:
    """Compile Debian's Qpid Proton C `send.c` / `receive.c` examples into the work dir."""
    _apt(("libqpid-proton11-dev", "libqpid-proton11-dev-examples"))
    sources = {}
    for package in ("libqpid-proton11-dev", "libqpid-proton11-dev-examples"):
        listing = subprocess.run(["dpkg", "-L", package], capture_output=True, text=True).stdout
        for line in listing.splitlines():
            if line.endswith(
                ("/c/send.c", "/c/receive.c", "/examples/send.c", "/examples/receive.c")
            ):
                sources[Path(line).stem] = Path(line)
    if set(sources) != {"send", "receive"}:
        raise RuntimeError("send.c / receive.c not found in the Debian packages")
    digest = _key(*(p.read_text() for p in sources.values()))
    out = workdir / "envs" / f"qpid-c-{digest}"
    if not (out / ".ok").exists():
        out.mkdir(parents=True, exist_ok=True)
        libs = [
            "-lqpid-proton",
            str(LIBDIR / "libqpid-proton-proactor.so.1"),
            str(LIBDIR / "libqpid-proton-core.so.10"),
        ]
        for stem, src in sources.items():
            _run(["gcc", "-O1", "-I", str(src.parent), "-o", str(out / stem), str(src), *libs])
        (out / ".ok").touch()
    return out


def _shared_lib(name: str) -> str:
    """The versioned .so of a library whose unversioned -dev symlink Debian does not ship."""
    found = sorted(LIBDIR.glob(f"lib{name}.so.*"), key=lambda p: len(p.name))
    if not found:
        raise RuntimeError(f"lib{name}.so not found under {LIBDIR}")
    return str(found[0])
