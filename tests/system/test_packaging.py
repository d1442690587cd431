"""rankguard installed as users install it: a wheel (and an sdist) built from the checkout,
installed into a fresh virtual environment without editable mode, run from outside the
checkout.

- the wheel ships every module under the mapped folders and every deployment file, and the
  sdist builds the same wheel;
- without the trainer extra: every other module imports and torch is neither importable
  nor imported; `rankguard agent` and `rankguard supervisor` serve /healthz and /metrics
  with the package's version in their `_info` metrics; `rankguard --version`;
  `rankguard dashboards build --check` against the checked-in and the installed files;
  `rankguard deploy copy` writes every /opt/rankguard/... path docs/deploy.md names;
- with the trainer extra: every module imports and `rankguard up --steps 50` trains.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from harness import start_agent, start_supervisor
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
TORCH_PIN = "torch==2.13.0"  # the local CPU build (never let pip resolve an unpinned torch)
# Paths an installation creates: docs/deploy.md's `/opt/rankguard/deploy` (rankguard deploy
# copy) and `/opt/rankguard/.venv` (the virtual environment).
OPT_PATH = re.compile(r"/opt/rankguard/(deploy|\.venv)(/[^\s`'\"(){},;]*)?")


def project_version() -> str:
    """The version as pyproject.toml writes it (the one place it is written)."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]


def run(cmd: list, timeout: float = 300, **kw) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [str(c) for c in cmd], capture_output=True, text=True, timeout=timeout, **kw
    )
    assert proc.returncode == 0, (
        f"{cmd} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    )
    return proc


def copy_checkout(dest: Path) -> Path:
    """The files git knows (tracked, and untracked ones it does not ignore), so build
    output and virtual environments in the checkout cannot leak into the wheel."""
    try:
        listed = subprocess.run(
            ["git", "-C", str(REPO), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            capture_output=True, check=True,
        ).stdout.decode().split("\0")  # fmt: skip
    except (OSError, subprocess.CalledProcessError):  # not a git checkout (an unpacked sdist)
        shutil.copytree(REPO, dest, ignore=shutil.ignore_patterns(
            ".git", ".venv", "__pycache__", "build", "dist", "*.egg-info", "runs", ".*_cache",
            ".hypothesis"))  # fmt: skip
        return dest
    for rel in filter(None, listed):
        src = REPO / rel
        if src.is_file():  # deleted but still tracked: skip
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)
    return dest


def mapped_folders(src: Path) -> list[str]:
    """The checkout's top folders that are packages: each becomes rankguard.<folder>."""
    return sorted(p.parent.name for p in src.glob("*/__init__.py"))


def checkout_modules(src: Path) -> set[str]:
    """Every module under the mapped folders, as its installed name."""
    out = set()
    for top in mapped_folders(src):
        for py in (src / top).rglob("*.py"):
            parts = py.relative_to(src).with_suffix("").parts
            out.add(".".join(("rankguard", *(parts[:-1] if parts[-1] == "__init__" else parts))))
    return out


def venv_env(venv: Path, **extra) -> dict:
    """The environment of a command run from the fresh venv: nothing from the checkout or
    the test's own environment on the module path."""
    env = dict(os.environ, PYTHONPATH="", PYTHONHOME="")  # empty: ignored, also when merged
    env.update(PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}", VIRTUAL_ENV=str(venv),
               PYTHONNOUSERSITE="1", PIP_DISABLE_PIP_VERSION_CHECK="1", **extra)  # fmt: skip
    return env


# Run inside the venv: import every rankguard module found in the *installed* package (all
# but the trainer's when argv[1] == "no-trainer"), and report where they came from.
IMPORT_ALL = r"""
import importlib, importlib.util, json, pkgutil, sys
no_trainer = sys.argv[1] == "no-trainer"
import rankguard

def walk(path, prefix):
    for info in pkgutil.iter_modules(path, prefix):
        if info.name.endswith(".__main__") or (no_trainer and info.name.startswith("rankguard.trainer")):
            continue
        module = importlib.import_module(info.name)
        yield info.name, module.__file__
        if info.ispkg:
            yield from walk(module.__path__, info.name + ".")

modules = dict(walk(rankguard.__path__, "rankguard."))
print(json.dumps({"modules": modules, "torch_imported": "torch" in sys.modules,
                  "torch_importable": importlib.util.find_spec("torch") is not None}))
"""


def import_all(venv: Path, cwd: Path, mode: str) -> dict:
    import json

    out = run([venv / "bin/python", "-c", IMPORT_ALL, mode], cwd=cwd, env=venv_env(venv))
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> dict:
    """The wheel and the sdist built from a copy of the checkout, and a wheel built from
    that sdist."""
    tmp = tmp_path_factory.mktemp("dist")
    src = copy_checkout(tmp / "src")
    # No build isolation: this environment's setuptools, no download of build requirements.
    run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
         "-w", tmp / "wheel", src], cwd=tmp)  # fmt: skip
    run([sys.executable, "-m", "build", "--sdist", "--no-isolation", "--outdir", tmp / "sdist",
         src], cwd=tmp)  # fmt: skip
    (sdist,) = (tmp / "sdist").glob("rankguard-*.tar.gz")
    run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
         "-w", tmp / "from-sdist", sdist], cwd=tmp)  # fmt: skip
    (wheel,) = (tmp / "wheel").glob("rankguard-*.whl")
    (wheel_from_sdist,) = (tmp / "from-sdist").glob("rankguard-*.whl")
    return {"src": src, "wheel": wheel, "sdist": sdist, "wheel_from_sdist": wheel_from_sdist,
            "tmp": tmp}  # fmt: skip


@pytest.fixture(scope="module")
def venv(dist, tmp_path_factory):
    """A fresh venv (no system site-packages) with the wheel, without extras; the import
    walk runs here, before any test can add the trainer extra. Removed afterwards (with
    torch it is about 1 GB, and pytest keeps its last three temporary trees)."""
    tmp = tmp_path_factory.mktemp("venv")
    env_dir = tmp / "venv"
    run([sys.executable, "-m", "venv", env_dir], cwd=tmp)
    run([env_dir / "bin/pip", "install", "-q", dist["wheel"]], cwd=tmp, env=venv_env(env_dir))
    walked = import_all(env_dir, tmp, "no-trainer")
    yield {"dir": env_dir, "tmp": tmp, "rankguard": env_dir / "bin/rankguard",
           "no_trainer": walked, "env": venv_env(env_dir)}  # fmt: skip
    shutil.rmtree(env_dir, ignore_errors=True)


def rankguard(venv: dict, *args, timeout: float = 120) -> subprocess.CompletedProcess:
    return run([venv["rankguard"], *args], cwd=venv["tmp"], env=venv["env"], timeout=timeout)


def test_the_wheel_ships_every_module_and_deploy_file(dist):
    names = set(zipfile.ZipFile(dist["wheel"]).namelist())
    src = dist["src"]
    assert {
        "agent",
        "cli",
        "contract",
        "dashboards",
        "deploy",
        "service",
        "supervisor",
        "trainer",
    } <= set(mapped_folders(src))
    missing = sorted(
        f"rankguard/{py.relative_to(src).as_posix()}"
        for top in mapped_folders(src)
        for py in (src / top).rglob("*.py")
        if f"rankguard/{py.relative_to(src).as_posix()}" not in names
    )
    assert not missing, f"modules the wheel lacks: {missing}"
    deploy = [p for p in (src / "deploy").rglob("*") if p.is_file() and p.suffix != ".py"]
    assert len(deploy) >= 16
    lacking = sorted(
        rel
        for p in deploy
        if (rel := f"rankguard/deploy/{p.relative_to(src / 'deploy').as_posix()}") not in names
    )
    assert not lacking, f"deployment files the wheel lacks: {lacking}"
    # Nothing from outside the mapped folders (tests, benchmarks, build output).
    strays = sorted(n for n in names if not n.startswith(("rankguard/", "rankguard-")))
    assert not strays, strays
    assert not any("__pycache__" in n or n.endswith(".pyc") for n in names)


def test_the_sdist_builds_the_same_wheel(dist):
    def listing(wheel):
        return sorted(zipfile.ZipFile(wheel).namelist())

    assert listing(dist["wheel_from_sdist"]) == listing(dist["wheel"])


def test_without_the_trainer_extra_every_other_module_imports_and_torch_stays_out(dist, venv):
    walked = venv["no_trainer"]
    site = str(venv["dir"])
    expected = {m for m in checkout_modules(dist["src"]) if not m.startswith("rankguard.trainer")}
    expected = {m for m in expected if not m.endswith(".__main__")}
    assert set(walked["modules"]) == expected
    outside = {m: f for m, f in walked["modules"].items() if not f.startswith(site)}
    assert not outside, f"imported from outside the venv: {outside}"
    assert not walked["torch_importable"] and not walked["torch_imported"]


def _info_versions(url: str, metric: str) -> list[str]:
    import urllib.request

    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    return [
        s.labels["version"]
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == metric and s.value == 1
    ]


def test_the_installed_agent_and_supervisor_serve_and_report_the_version(venv):
    tmp, version = venv["tmp"] / "daemons", project_version()
    tmp.mkdir()
    kw = {"command": [str(venv["rankguard"])], "cwd": venv["tmp"], "env": venv["env"]}
    agent = start_agent(tmp, "pkg-node", **kw)  # waits for /healthz {"ok": true}
    try:
        sup = start_supervisor(tmp, [agent.url], **kw)
        try:
            assert _info_versions(agent.url, "rankguard_agent_info") == [version]
            assert _info_versions(sup.url, "rankguard_supervisor_info") == [version]
        finally:
            assert sup.stop() == 0, sup.log.read_text()[-3000:]
    finally:
        assert agent.stop() == 0, agent.log.read_text()[-3000:]
    assert rankguard(venv, "--version").stdout.strip() == f"rankguard {version}"


def test_the_installed_dashboards_and_rules_are_the_generator_output(venv):
    installed = Path(rankguard(venv, "deploy", "path").stdout.strip())
    assert installed.is_relative_to(venv["dir"]) and (installed / "agent.toml").is_file()
    rankguard(venv, "dashboards", "build", "--check", "--out", REPO / "deploy")
    rankguard(venv, "dashboards", "build", "--check", "--out", installed)


def test_deploy_copy_writes_every_path_the_deploy_doc_names(venv):
    dest = venv["tmp"] / "opt-deploy"
    out = rankguard(venv, "deploy", "copy", dest).stdout.splitlines()
    copied = sorted(p for p in dest.rglob("*") if p.is_file())
    assert len(out) == len(copied) >= 16
    scripts = [p for p in copied if p.read_bytes().startswith(b"#!")]
    assert {p.name for p in scripts} >= {"prolog.sh", "epilog.sh", "rankguard-train.sbatch"}
    assert all(os.access(p, os.X_OK) for p in scripts)
    root = {"deploy": dest, ".venv": venv["dir"]}
    named = []  # (where, path) for each /opt/rankguard/{deploy,.venv}/... path
    for where, text in [("docs/deploy.md", (REPO / "docs/deploy.md").read_text())] + [
        (p.name, p.read_text()) for p in copied
    ]:
        named += [(where, m.group(0), root[m.group(1)], m.group(2) or "") for m in OPT_PATH.finditer(text)]  # fmt: skip
    from_doc = [n for n in named if n[0] == "docs/deploy.md"]
    assert len(from_doc) >= 10, "docs/deploy.md names fewer installed paths than expected"
    absent = sorted({f"{where}: {path}" for where, path, base, rel in named
                     if not (base / rel.lstrip("/")).exists()})  # fmt: skip
    assert not absent, f"paths named but not installed: {absent}"
    # A destination that cannot be written: exit 2 and a message.
    bad = subprocess.run([str(venv["rankguard"]), "deploy", "copy", str(dest / "agent.toml" / "x")],
                         capture_output=True, text=True, env=venv["env"], timeout=60)  # fmt: skip
    assert bad.returncode == 2 and "cannot write" in bad.stderr


def test_with_the_trainer_extra_everything_imports_and_up_trains(dist, venv):
    """Last: it adds the trainer extra (and torch) to the module's venv."""
    env_dir, tmp = venv["dir"], venv["tmp"]
    run([env_dir / "bin/pip", "install", "-q", f"{dist['wheel']}[trainer]", TORCH_PIN],
        cwd=tmp, env=venv["env"], timeout=600)  # fmt: skip
    walked = import_all(env_dir, tmp, "all")
    expected = {m for m in checkout_modules(dist["src"]) if not m.endswith(".__main__")}
    assert set(walked["modules"]) == expected
    assert all(f.startswith(str(env_dir)) for f in walked["modules"].values())
    # torch installed now, and still the agent's and supervisor's code paths leave it alone.
    probe = ("import sys, rankguard.cli.main, rankguard.agent.daemon, rankguard.supervisor.daemon;"
             " print('torch' in sys.modules)")  # fmt: skip
    assert (
        run([env_dir / "bin/python", "-c", probe], cwd=tmp, env=venv["env"]).stdout.strip()
        == "False"
    )
    proc = run([venv["rankguard"], "up", "--steps", "50", "--ckpt-every", "25", "--run-dir",
                tmp / "up"], cwd=tmp, env={**venv["env"], "OMP_NUM_THREADS": "1"}, timeout=420)  # fmt: skip
    assert "training completed: step 50" in proc.stdout, proc.stdout[-3000:]
