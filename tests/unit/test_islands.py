"""Two islands (docs/architecture.md, "Processes"): the gateways run without the core's
dependencies, and no gateway depends on another.

- A fresh interpreter imports every module of every gateway (and the gateway CLI); neither
  `core`, `torch` nor `transformers` may be loaded by that.
- The import graph, read from the source: a gateway's modules import only their own package,
  gateways.common and the shared packages from this project; gateways.common imports no
  gateway; the packages both islands share (envflags, logclip, oteltrace, servegc, servestop)
  import the standard library and each other only, and oteltrace OpenTelemetry too.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GATEWAYS = ("lmi", "openai", "triton", "ws")
HEAVY = ("core", "torch", "transformers")
#: Top-level packages both islands install; standard library only.
SHARED = ("envflags", "logclip", "oteltrace", "servegc", "servestop")
#: What a shared package may import besides the standard library: oteltrace is OpenTelemetry set up
#: the same way for both islands, which both install opentelemetry for it.
SHARED_THIRD_PARTY = {"oteltrace": {"opentelemetry"}}


def _modules(package: str) -> list[str]:
    """Every module below a top-level package directory, by dotted name."""
    out = []
    for path in sorted((ROOT / package).rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        out.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return out


def _imports(module: str) -> set[str]:
    """The modules `module` imports (absolute names; `from a import b` gives a and a.b)."""
    path = ROOT / Path(*module.split("."))
    path = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def _owner(name: str) -> str | None:
    """The island part a module name belongs to: "core", "shared" (SHARED), "gateways.common",
    "gateways.<name>", "gateways" (the package and its CLI), or None (not this project)."""
    parts = name.split(".")
    if parts[0] == "core":
        return "core"
    if parts[0] in SHARED:
        return "shared"
    if parts[0] != "gateways":
        return None
    if len(parts) > 1 and (parts[1] == "common" or parts[1] in GATEWAYS):
        return f"gateways.{parts[1]}"
    return "gateways"


def test_a_fresh_interpreter_imports_every_gateway_without_the_core():
    modules = _modules("gateways")
    assert {f"gateways.{g}" for g in GATEWAYS} <= set(modules)
    code = (
        "import importlib, json, sys\n"
        f"for name in {modules!r}:\n"
        "    importlib.import_module(name)\n"
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    loaded = json.loads(out.stdout)
    heavy = [m for m in loaded if m.split(".")[0] in HEAVY]
    assert heavy == []


@pytest.mark.parametrize("module", _modules("gateways"))
def test_gateway_imports_stay_on_their_island(module):
    owner = _owner(module)
    allowed = {owner, "gateways.common", "shared"}
    if owner == "gateways":  # the package and the CLI, which picks a gateway by name at run time
        allowed = {"gateways", "gateways.common", "shared"}
    project = {name for name in _imports(module) if _owner(name) is not None}
    strays = sorted(name for name in project if _owner(name) not in allowed)
    assert strays == [], f"{module} imports {strays}"


def test_every_shared_package_is_installed():
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert set(SHARED) <= set(setuptools["packages"])


@pytest.mark.parametrize("module", [m for package in SHARED for m in _modules(package)])
def test_the_shared_packages_import_the_standard_library_only(module):
    top = {name.split(".")[0] for name in _imports(module)}
    allowed = SHARED_THIRD_PARTY.get(module.split(".")[0], set())
    assert sorted(top - sys.stdlib_module_names - set(SHARED) - allowed) == []


@pytest.mark.parametrize("module", _modules("core"))
def test_the_core_imports_no_gateway(module):
    assert [name for name in _imports(module) if name.split(".")[0] == "gateways"] == []
