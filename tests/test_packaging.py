"""What an installed package needs: the chat page and the C++ sources as package data, found
through the package (not the checkout), and a kernels package that imports nothing from the
engine."""

from __future__ import annotations

import ast
import fnmatch
import os
import re
import subprocess
import sys
import tomllib
from importlib import resources
from pathlib import Path

from streamengine.kernels import cpu_build

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_chat_page_is_found_through_the_package():
    page = resources.files("streamengine.web")
    assert page.joinpath("index.html").is_file()


def test_server_serves_the_packaged_page():
    from streamengine.server import app

    assert app.WEB_DIR == Path(str(resources.files("streamengine.web").joinpath("index.html"))).parent


def test_index_references_files_of_the_package():
    page = resources.files("streamengine.web")
    html = page.joinpath("index.html").read_text()
    # Local references: src="/static/app.js", href="/static/style.css"; data: and http(s) URLs are not files.
    names = re.findall(r'(?:src|href)="/static/([^"]+)"', html)
    assert names, "index.html references no /static/ files"
    for name in names:
        assert page.joinpath(name).is_file(), f"index.html references /static/{name}, not in streamengine.web"
        assert _is_package_data("streamengine.web", name), f"{name} is not package data"


def _is_package_data(package: str, name: str) -> bool:
    patterns = PYPROJECT["tool"]["setuptools"]["package-data"][package]
    return any(fnmatch.fnmatch(name, pattern) for pattern in patterns)


def _package_dir(package: str) -> Path:
    return ROOT / PYPROJECT["tool"]["setuptools"]["package-dir"][package]


def test_every_python_package_is_listed():
    """pyproject.toml lists packages by hand (package-dir maps two of them): a new subpackage
    must be added there, or an installed engine lacks it."""
    listed = set(PYPROJECT["tool"]["setuptools"]["packages"])
    for package, folder in PYPROJECT["tool"]["setuptools"]["package-dir"].items():
        for init in (ROOT / folder).rglob("__init__.py"):
            relative = init.parent.relative_to(ROOT / folder).parts
            name = ".".join((package, *relative))
            assert name in listed, f"{name} is missing from [tool.setuptools] packages"


def test_every_page_file_is_package_data():
    for path in _package_dir("streamengine.web").iterdir():
        if path.is_file() and path.suffix != ".py":
            assert _is_package_data("streamengine.web", path.name), f"web/{path.name} would not be installed"


def test_cpp_sources_are_package_data_with_headers_only_included():
    assert cpu_build.SOURCES == Path(str(resources.files("streamengine.kernels").joinpath("csrc")))
    files = sorted(p for p in cpu_build.SOURCES.iterdir() if p.is_file())
    assert any(p.suffix == ".cpp" for p in files)
    for path in files:
        assert _is_package_data("streamengine.kernels.csrc", path.name), f"csrc/{path.name} would not be installed"
        # Each .cpp is compiled once, into one library: shared code comes in through headers.
        for name in re.findall(r'^\s*#include\s+"([^"]+)"', path.read_text(), flags=re.M):
            assert name.endswith(".h"), f"{path.name} includes {name}"
            assert (cpu_build.SOURCES / name).is_file(), f"{path.name} includes missing {name}"


def _imported_modules(source: Path) -> list[str]:
    names: list[str] = []
    for node in ast.walk(ast.parse(source.read_text())):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
    return names


def test_kernels_import_nothing_from_the_engine():
    kernels_dir = _package_dir("streamengine.kernels")
    for source in sorted(kernels_dir.rglob("*.py")):
        for name in _imported_modules(source):
            engine = name == "streamengine" or name.startswith("streamengine.")
            assert not engine or name.startswith("streamengine.kernels"), f"{source.name} imports {name}"


def test_the_checkouts_kernels_folder_never_shadows_the_hugging_face_package():
    """Run from the repository's root (python -m, a Ray worker given the driver's working
    directory), `import kernels` must still find the package transformers imports, not the
    folder installed as streamengine.kernels."""
    probe = ("import sys; sys.path.insert(0, ''); import streamengine, kernels; "
             "print(kernels.__file__); print('' in sys.path)")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONSAFEPATH"}
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    where, root_on_path = done.stdout.split()
    assert Path(where).resolve().parent != ROOT / "kernels" and root_on_path == "False"
