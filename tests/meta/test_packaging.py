"""The built wheel, installed without network into throwaway venvs (README "Quickstart").

One venv sees every dependency (the project venv's site-packages through a .pth file) and runs
``ibex-context up``/``seed``/``assemble``/``status``/``down`` from a temp dir outside the checkout:
the installed package finds its supervisord config as package data and keeps its state in
IBEX_RUN_DIR. A second venv sees only the base dependencies: the client library imports, and a
stack command says which extra it needs in one line.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path

import pytest

from ibex_context.ops.stack import free_port
from tests.meta.layout import PACKAGE_DIRS

SRC = Path(__file__).resolve().parents[2]
DEPS = Path(sysconfig.get_paths()["purelib"])  # the project venv's site-packages
PY_VER = f"python{sys.version_info.major}.{sys.version_info.minor}"
# uv, which `make install` puts in the project venv, builds and installs the wheel with a fraction of
# pip's CPU (pip spends most of its second importing itself); pip where there is no uv.
UV = shutil.which("uv", path=str(Path(sys.executable).parent))
STACK_TIMEOUT_S = 120
# Retrieval limits a loaded 2-core test machine meets on a cold stack (defaults are 5-45 ms), so the
# assembly below is judged on what it found, not on the box's load.
SLOW_BOX_ENV = {"IBEX_DIRECTIVE_TIMEOUT_MS": "2000", "IBEX_HOT_TIMEOUT_MS": "2000", "IBEX_COLD_TIMEOUT_MS": "2000",
                "IBEX_CONTEXT_TIMEOUT": "3000", "IBEX_CONTEXT_DEADLINE_MS": "3000"}
REQUIRED_DATA = ["ibex_context/ops/supervisord.conf", "ibex_context/pipeline/budget/catalog.json",
                 "ibex_context/memory/data/demo.jsonl"]
# What only the bench or the tests use lives in bench/ and tests/helpers.py, never in the wheel.
BENCH_ONLY_MODULES = ["ibex_context/worker/transport.py"]
BENCH_ONLY_DEFINITIONS = ["class TransportWorkerServer", "def transport_response",
                          "def rank_hydrated_hits", "def recency_score"]


def _run(args: list[str | Path], *, cwd: Path, env: dict[str, str],
         timeout_s: float = STACK_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout_s, check=False)


def _source_copy(dest: Path) -> Path:
    """What the wheel is built from: pyproject, README, the package's root files and the folders its
    package-dir table maps.

    Built from a copy so the test never writes build/ into the checkout others work in.
    """
    dest.mkdir()
    for name in ("pyproject.toml", "README.md", "supervisord.conf"):
        shutil.copy2(SRC / name, dest / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in ("__init__.py", "py.typed"):  # the package's own files: the checkout is the package
        shutil.copy2(SRC / name, dest / name)
    for folder in PACKAGE_DIRS.values():
        if folder != SRC:
            shutil.copytree(folder, dest / folder.relative_to(SRC), symlinks=True, ignore=ignore)
    return dest


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("wheel")
    src = _source_copy(base / "src")
    build = [UV, "build", "--wheel", "--no-build-isolation", "--offline", "--quiet", "--python", sys.executable,
             "-o", base / "dist", src] if UV else \
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
         "--disable-pip-version-check", "-w", base / "dist", src]
    out = _run(build, cwd=base, env=_clean_env(), timeout_s=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    (built,) = (base / "dist").glob("ibex_context-*.whl")
    return built


def _clean_env(**extra: str) -> dict[str, str]:
    """No IBEX_* settings and no PYTHONPATH from the caller: only what a test passes counts."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("IBEX_") and k != "PYTHONPATH"}
    env.update(extra)
    return env


def _venv(where: Path, wheel: Path, deps_dir: Path) -> Path:
    """A venv with the wheel installed (no network, no deps) and ``deps_dir`` on its path; its bin/."""
    done = _run([sys.executable, "-m", "venv", "--without-pip", where], cwd=where.parent, env=_clean_env())
    assert done.returncode == 0, done.stderr
    (where / "lib" / PY_VER / "site-packages" / "ibex-deps.pth").write_text(f"{deps_dir}\n")
    python = where / "bin" / "python"
    # Bytecode compiled at install, as pip does: the stack's processes import the package from here.
    install = [UV, "pip", "install", "--python", python, "--no-deps", "--offline", "--compile-bytecode", "--quiet",
               wheel] if UV else \
        [sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--no-index",
         "--disable-pip-version-check", wheel]
    done = _run(install, cwd=where.parent, env=_clean_env())
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return where / "bin"


def _assert_imports_from(bin_dir: Path, venv: Path, cwd: Path) -> None:
    out = _run([bin_dir / "python", "-c", "import ibex_context; print(ibex_context.__file__)"], cwd=cwd,
               env=_clean_env())
    assert out.returncode == 0, out.stderr
    assert Path(out.stdout.strip()).is_relative_to(venv), out.stdout  # the wheel, never the checkout


def _wheel_metadata(wheel: Path) -> str:
    with zipfile.ZipFile(wheel) as zf:
        return zf.read(next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))).decode()


def test_wheel_holds_one_namespace_and_its_data(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        assert b"[supervisord]" in zf.read("ibex_context/ops/supervisord.conf")  # the file, not a link
    dist_info = "-".join(wheel.name.split("-")[:2]) + ".dist-info"
    assert {n.split("/", 1)[0] for n in names} == {"ibex_context", dist_info}
    for data in REQUIRED_DATA:
        assert data in names, data
    assert not [n for n in names if re.match(r"(ibex_context/)?(tests|bench)/", n)]
    assert not set(BENCH_ONLY_MODULES) & set(names)
    with zipfile.ZipFile(wheel) as zf:
        sources = {n: zf.read(n).decode("utf-8") for n in names if n.endswith(".py")}
    found = [f"{n}: {d}" for n, text in sources.items() for d in BENCH_ONLY_DEFINITIONS if d + "(" in text]
    assert not found, found
    imports = [n for n, text in sources.items() if re.search(r"^\s*(from|import) (bench|tests)\b", text, re.M)]
    assert not imports, f"product modules importing the bench or the tests: {imports}"
    meta = _wheel_metadata(wheel)
    base = [r for r in re.findall(r"^Requires-Dist: (.+)$", meta, re.M) if "extra ==" not in r]
    assert sorted(re.split(r"[<>=!~; ]", r)[0] for r in base) == sorted(
        ["pyzmq", "msgpack", "ormsgpack", "numpy", "pydantic", "pydantic-settings", "bpe-openai"])
    assert "Provides-Extra: server" in meta


# -------------------------------------------------------------------------- the full stack


@pytest.fixture
def stack_env(tmp_path: Path) -> Iterator[dict[str, str]]:
    front, back, memory = free_port(), free_port(), free_port()
    yield _clean_env(
        IBEX_RUN_DIR=str(tmp_path / "state"), IBEX_WORKERS="1", IBEX_METRICS_PORT="0",
        IBEX_REDIS_PORT=str(free_port()), IBEX_MEMORY_PORT=str(memory),
        IBEX_MEMORY_URL=f"http://127.0.0.1:{memory}",
        IBEX_BROKER_FRONTEND=f"tcp://127.0.0.1:{front}", IBEX_BROKER_BACKEND=f"tcp://127.0.0.1:{back}",
        IBEX_BROKER_ENDPOINTS=f"tcp://127.0.0.1:{front}", **SLOW_BOX_ENV)


def _logs(env: dict[str, str]) -> str:
    logs = Path(env["IBEX_RUN_DIR"]) / "logs"
    return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-1500:]}" for p in sorted(logs.glob("*")))


def test_installed_wheel_runs_the_stack_from_anywhere(wheel: Path, tmp_path: Path,
                                                      stack_env: dict[str, str]) -> None:
    bin_dir = _venv(tmp_path / "venv", wheel, DEPS)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    _assert_imports_from(bin_dir, tmp_path / "venv", elsewhere)
    cli = bin_dir / "ibex-context"
    up = _run([cli, "up"], cwd=elsewhere, env=stack_env)
    try:
        assert up.returncode == 0, up.stdout + up.stderr + _logs(stack_env)
        assert (Path(stack_env["IBEX_RUN_DIR"]) / "supervisord.pid").exists()
        status = _run([cli, "status"], cwd=elsewhere, env=stack_env)
        assert status.returncode == 0, status.stderr
        assert len(json.loads(status.stdout)["workers"]) == 1
        seeded = _run([cli, "seed"], cwd=elsewhere, env=stack_env)  # the stack's Redis, from the run dir
        assert seeded.returncode == 0, seeded.stdout + seeded.stderr
        asm = _run([cli, "assemble", "--org", "acme", "--agent", "support-bot", "--query", "invoice",
                    "--timeout-ms", "10000", "--json"], cwd=elsewhere, env=stack_env)
        assert asm.returncode == 0, asm.stdout + asm.stderr + _logs(stack_env)
        resp = json.loads(asm.stdout)
        assert resp["worker_id"] and not resp["degraded"], resp["degraded_reasons"]  # a worker answered
        assert resp["packed"], resp  # the seeded demo memories reached the answer
    finally:
        down = _run([cli, "down"], cwd=elsewhere, env=stack_env)
    assert down.returncode == 0, down.stdout + down.stderr
    assert "stopped" in down.stdout
    after = _run([cli, "status"], cwd=elsewhere, env=stack_env)
    assert after.returncode == 1 and "not running" in after.stderr
    assert not list(elsewhere.iterdir())  # every file the stack wrote is in IBEX_RUN_DIR


# ----------------------------------------------------------------------- client-only install


CLIENT_ONLY_SCRIPT = """
import importlib.util, sys, time
from ibex_context.client import AssembleRequest, AsyncClient, SyncClient, Unavailable, degraded_response
req = AssembleRequest(request_id="r1", org_id="acme", agent_id="bot", model="gpt-4o", query="q",
                      recent_messages=[{"role": "user", "content": "hello there"}], deadline_ns=time.time_ns() + 10**9)
resp = degraded_response(req, Unavailable("no broker"))  # the client's local fallback pipeline
assert resp.degraded and "hello there" in resp.rendered, resp
server = [m for m in ("redis", "aiohttp", "httpx", "uvloop", "supervisor", "starlette") if importlib.util.find_spec(m)]
sys.exit(f"server modules visible: {server}" if server else 0)
"""


def _base_closure(wheel: Path) -> set[str]:
    """Distributions the wheel's base requirements pull in, transitively (no extras)."""
    from packaging.requirements import Requirement

    todo = [Requirement(r) for r in re.findall(r"^Requires-Dist: (.+)$", _wheel_metadata(wheel), re.M)]
    seen: set[str] = set()
    while todo:
        req = todo.pop()
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        name = metadata.distribution(req.name).metadata["Name"]
        if name not in seen:
            seen.add(name)
            todo.extend(Requirement(r) for r in metadata.requires(name) or [])
    return seen


def _slim_deps(where: Path, wheel: Path) -> Path:
    """A directory holding only the base closure (links into the project venv's site-packages)."""
    where.mkdir()
    for name in _base_closure(wheel):
        for file in metadata.distribution(name).files or []:
            top = file.parts[0]
            if top != ".." and (DEPS / top).exists() and not (where / top).exists():
                (where / top).symlink_to(DEPS / top)
    return where


def test_client_only_install_needs_no_server(wheel: Path, tmp_path: Path) -> None:
    bin_dir = _venv(tmp_path / "venv", wheel, _slim_deps(tmp_path / "deps", wheel))
    _assert_imports_from(bin_dir, tmp_path / "venv", tmp_path)
    client = _run([bin_dir / "python", "-c", CLIENT_ONLY_SCRIPT], cwd=tmp_path, env=_clean_env())
    assert client.returncode == 0, client.stderr  # the client and its fallback work without any server module
    up = _run([bin_dir / "ibex-context", "up"], cwd=tmp_path, env=_clean_env(IBEX_RUN_DIR=str(tmp_path / "run")))
    assert up.returncode == 2 and up.stdout == ""
    assert up.stderr.count("\n") == 1 and up.stderr.startswith("ibex-context up: needs the server extra: "
                                                               "pip install 'ibex-context[server]'"), up.stderr
