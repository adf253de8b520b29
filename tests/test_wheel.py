"""A built wheel works without the source tree: it ships the templates, and its `alchemist` command generates a
fixture's module from a fresh virtual environment outside the repository."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# what setup.py and pyproject.toml need to build the wheel (copied, so the build leaves nothing in the checkout)
BUILD_INPUTS = ("pyproject.toml", "setup.py", "README.md", "alchemist", "templates")


def _run(*cmd, cwd: Path) -> str:
    """Run cmd in cwd, seeing neither the checkout (PYTHONPATH) nor a user site; its stdout."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")} | {"PYTHONNOUSERSITE": "1"}
    proc = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{cmd} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def test_wheel_ships_templates_and_generates_outside_the_repo(tmp_path):
    work = tmp_path / "work"
    work.mkdir()

    src = tmp_path / "src"
    src.mkdir()
    for name in BUILD_INPUTS:
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(REPO / name, src / name)
    dist = tmp_path / "dist"
    pip = (sys.executable, "-m", "pip")
    _run(*pip, "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index", "-w", dist, src, cwd=work)
    (wheel,) = dist.glob("alchemist-*.whl")

    names = set(zipfile.ZipFile(wheel).namelist())
    templates = {
        f"alchemist/templates/{p.relative_to(REPO / 'templates').as_posix()}"
        for p in (REPO / "templates").rglob("*.j2")
    }
    assert "alchemist/templates/model.py.j2" in templates
    assert templates <= names, f"the wheel lacks {sorted(templates - names)}"
    csrc = {f"alchemist/kernels/csrc/{p.name}" for p in (REPO / "alchemist" / "kernels" / "csrc").iterdir()}
    assert "alchemist/kernels/csrc/quantized_matmul.cpp" in csrc
    assert csrc <= names, f"the wheel lacks {sorted(csrc - names)}"

    # a fresh venv without pip: the main environment's pip installs into it, and a .pth file then lends it the
    # installed dependencies (the .pth files inside that directory, such as the editable alchemist's, stay inert)
    venv = tmp_path / "venv"
    _run(sys.executable, "-m", "venv", "--without-pip", venv, cwd=work)
    python = venv / "bin" / "python"
    _run(*pip, "--python", python, "install", "-q", "--no-deps", "--no-index", wheel, cwd=work)
    site = Path(_run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])", cwd=work).strip())
    lent = dict.fromkeys(sysconfig.get_paths()[k] for k in ("purelib", "platlib"))
    (site / "_alchemist_test_deps.pth").write_text("".join(f"{p}\n" for p in lent))

    # alchemist and its templates come from the installed wheel, not from the checkout
    where = "import alchemist, alchemist.codegen.render as r; print(alchemist.__file__); print(r.TEMPLATES_DIR)"
    found = [Path(p) for p in _run(python, "-c", where, cwd=work).split()]
    assert found == [site / "alchemist" / "__init__.py", site / "alchemist" / "templates"]

    alchemist = venv / "bin" / "alchemist"
    _run(alchemist, "fixture", "--arch", "llama", "-o", "x.gguf", cwd=work)
    _run(alchemist, "gen", "x.gguf", "-o", "out", cwd=work)  # with its static audit
    (module,) = (work / "out").glob("*.py")
    probe = "import sys, alchemist.runtime.engine as e; print(e.import_generated(sys.argv[1]).__file__)"
    assert Path(_run(python, "-c", probe, module, cwd=work).strip()) == module
    # the kernels' sources come from the wheel too, with the shared headers inlined
    sources = "from alchemist.kernels import sources; print(sources.CSRC); print(len(sources.source('silu.cpp')))"
    csrc_dir, silu_length = _run(python, "-c", sources, cwd=work).split()
    assert Path(csrc_dir) == site / "alchemist" / "kernels" / "csrc" and int(silu_length) > 4000
