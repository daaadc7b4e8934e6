"""The shape of the code: one namespace, imports that flow one way without circles, one user-error base."""

from __future__ import annotations

import ast
import importlib
import inspect
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

from fedaudit.errors import UserError

ROOT = Path(__file__).resolve().parents[1]
# Where each installed package lives in the repository (pyproject.toml's package-dir mapping).
SOURCES = {"fedaudit": ROOT / "fedaudit", "fedaudit.attacks": ROOT / "attacks", "fedaudit.reports": ROOT / "reports"}
# The application modules beside them: the command line, the studies, the Python API.
LINKS = {"fedaudit.cli": ROOT / "cli.py", "fedaudit.study": ROOT / "study.py", "fedaudit.api": ROOT / "api.py"}
# The layers above the training core: the attacks, the reports, and the application modules that call all three
# (the command line, the studies, and the Python API the command line is a layer over).
CORE_EXCLUDED = ("fedaudit.attacks", "fedaudit.reports", "fedaudit.cli", "fedaudit.study", "fedaudit.api")


def module_files() -> dict[str, Path]:
    """Every fedaudit module by its installed name, from the repository's files."""
    modules: dict[str, Path] = dict(LINKS)
    for package, folder in SOURCES.items():
        for path in sorted(folder.rglob("*.py")):
            if path.is_symlink():
                continue
            parts = path.relative_to(folder).with_suffix("").parts
            name = ".".join((package, *parts)).removesuffix(".__init__")
            if package == "fedaudit" and parts[0] in ("attacks", "reports"):
                continue
            modules[name] = path
    return modules


MODULES = module_files()


def imports_of(name: str, path: Path) -> set[str]:
    """The fedaudit modules ``name`` imports anywhere in its file (module level and inside functions)."""
    found: set[str] = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(
                    package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else [])
                )
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    # A parent package is imported before any of its modules anyway; an edge to it is no circle of ours.
    ancestors = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)}
    return {module for module in found if module in MODULES and module != name and module not in ancestors}


GRAPH = {name: imports_of(name, path) for name, path in MODULES.items()}


def test_every_package_directory_is_installed() -> None:
    packages = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    on_disk = {name for name, path in MODULES.items() if path.name == "__init__.py"}
    assert set(packages) == on_disk


def test_application_modules_are_links_to_the_top_level_files() -> None:
    for name, target in LINKS.items():
        link = ROOT / "fedaudit" / target.name
        assert link.is_symlink() and link.resolve() == target, name


def test_nothing_outside_the_fedaudit_namespace_is_importable(tmp_path: Path) -> None:
    probe = "import importlib.util as u; print([m for m in ('cli', 'study', 'attacks', 'reports') if u.find_spec(m)])"
    # what the installation adds, not what a test run put on PYTHONPATH (Ray adds the working directory to it)
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    done = subprocess.run(
        [sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, timeout=60, env=env
    )
    assert done.stdout.strip() == "[]", done.stderr


def test_code_imports_the_namespaced_names_only() -> None:
    for name, path in MODULES.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        bare = [
            node.module if isinstance(node, ast.ImportFrom) else node.names[0].name
            for node in ast.walk(tree)
            if isinstance(node, (ast.Import, ast.ImportFrom)) and not getattr(node, "level", 0)
            for top in [(node.module if isinstance(node, ast.ImportFrom) else node.names[0].name) or ""]
            if top.split(".")[0] in ("cli", "study", "attacks", "reports")
        ]
        assert not bare, f"{name} imports {bare}"


def dependency_order() -> list[str]:
    """Modules with every module they import before them; a cycle fails the test that calls this."""
    order: list[str] = []
    state: dict[str, str] = {}

    def visit(module: str, path: tuple[str, ...]) -> None:
        if state.get(module) == "done":
            return
        if state.get(module) == "open":
            cycle = path[path.index(module) :] + (module,)
            pytest.fail("import circle: " + " -> ".join(cycle))
        state[module] = "open"
        for dependency in sorted(GRAPH[module]):
            visit(dependency, (*path, module))
        state[module] = "done"
        order.append(module)

    for module in sorted(GRAPH):
        visit(module, ())
    return order


def test_no_import_circle_even_through_imports_inside_functions() -> None:
    assert len(dependency_order()) == len(MODULES)


def test_each_module_imports_first_in_a_fresh_interpreter_in_dependency_order() -> None:
    script = (
        "import importlib, sys\n"
        "for name in sys.argv[1:]:\n"
        "    for loaded in [m for m in sys.modules if m == 'fedaudit' or m.startswith('fedaudit.')]:\n"
        "        del sys.modules[loaded]\n"
        "    importlib.import_module(name)\n"
        "print('ok')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, *dependency_order()], capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    assert done.stdout.strip() == "ok", done.stderr[-2000:]


LAZY_API = ("fedaudit", "fedaudit.api")  # the package's __getattr__ hands out fedaudit.train and its kin


@pytest.mark.parametrize(
    "layer, forbidden",
    [
        ("fedaudit.reports", ("fedaudit.training", "fedaudit.algorithms", "fedaudit.preparation", "fedaudit.engine")),
        ("fedaudit.attacks", ("fedaudit.algorithms", "fedaudit.engine", "fedaudit.reports", "fedaudit.study")),
        ("core", ("fedaudit.attacks", "fedaudit.reports", "fedaudit.cli", "fedaudit.study", "fedaudit.api")),
    ],
)
def test_data_flows_one_way(layer: str, forbidden: tuple[str, ...]) -> None:
    """Training core -> run directory -> attacks -> reports; only cli.py, study.py and api.py call all three (the
    package's own lazy ``fedaudit.train`` and its kin name fedaudit.api inside a function: the one edge up)."""
    if layer == "core":
        members = [m for m in MODULES if not m.startswith(CORE_EXCLUDED)]
    else:
        members = [m for m in MODULES if m == layer or m.startswith(layer + ".")]
    for module in members:
        bad = sorted(d for d in GRAPH[module] if d.startswith(forbidden) and (module, d) != LAZY_API)
        assert not bad, f"{module} imports {bad}"


def test_attacks_reach_training_only_through_its_public_entry_points() -> None:
    for module in (m for m in MODULES if m.startswith("fedaudit.attacks")):
        tree = ast.parse(MODULES[module].read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module in ("fedaudit.training", "fedaudit.preparation"):
                private = [alias.name for alias in node.names if alias.name.startswith("_")]
                assert not private, f"{module} imports {private} from {node.module}"


def test_every_error_class_is_a_user_error() -> None:
    """A new error class must not become a traceback: the CLI catches UserError only."""
    errors = []
    for name in MODULES:
        module = importlib.import_module(name)
        errors += [
            cls
            for _, cls in inspect.getmembers(module, inspect.isclass)
            if cls.__module__ == name and cls.__name__.endswith("Error")
        ]
    assert len(errors) >= 11
    assert [cls for cls in errors if not issubclass(cls, UserError)] == []


# Where an algorithm's name may still be compared with or used as a key, and how often: nowhere. The algorithm
# modules (each with its torch-free configuration section, ``<name>_settings``) and the registry own every fact about
# an algorithm; everything else asks them.
NAMED_OUTSIDE: dict[str, int] = {}


def algorithm_name_uses(source: str, names: frozenset[str]) -> list[int]:
    """The lines where ``source`` compares something with an algorithm's name (``==``, ``!=``, ``in``, also inside
    a tuple, list or set) or keys a dict literal by two or more algorithm names."""

    def names_one(node: ast.AST) -> bool:
        if isinstance(node, ast.Constant):
            return isinstance(node.value, str) and node.value in names
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            return any(names_one(element) for element in node.elts)
        return isinstance(node, ast.Starred) and names_one(node.value)

    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare) and any(names_one(n) for n in (node.left, *node.comparators)):
            lines.append(node.lineno)
        elif isinstance(node, ast.Dict) and sum(k is not None and names_one(k) for k in node.keys) >= 2:
            lines.append(node.lineno)
    return sorted(lines)


def test_algorithm_names_are_compared_only_where_the_algorithm_s_facts_live() -> None:
    from fedaudit.registry import ALGORITHMS

    names = frozenset(ALGORITHMS)
    found = {}
    for name, path in MODULES.items():
        if name.startswith("fedaudit.algorithms") or name == "fedaudit.registry":
            continue
        lines = algorithm_name_uses(path.read_text(encoding="utf-8"), names)
        if lines:
            found[name] = lines
    assert {name: len(lines) for name, lines in found.items()} == NAMED_OUTSIDE, found


def template_name_uses(text: str, names: frozenset[str]) -> list[str]:
    """The Jinja tags (``{% ... %}``, ``{{ ... }}``) of a report template that name an algorithm in quotes (its
    registry name or its literature label): a template must ask the run's facts instead."""
    tags = re.findall(r"{%.*?%}|{{.*?}}", text, flags=re.DOTALL)
    quoted = [re.findall(r"[\"']([^\"']+)[\"']", tag) for tag in tags]
    return [tag for tag, words in zip(tags, quoted) if any(word in names for word in words)]


def test_report_templates_ask_the_runs_facts_not_algorithm_names() -> None:
    from fedaudit.registry import ALGORITHMS

    names = frozenset(
        {*ALGORITHMS, *(e.label for e in ALGORITHMS.values()), *(e.dp_label for e in ALGORITHMS.values())}
    )
    for template in sorted((ROOT / "reports" / "templates").iterdir()):
        assert template_name_uses(template.read_text(encoding="utf-8"), names) == [], template.name
    assert template_name_uses('{% if "FedLAP" in r.run.setup.algorithm %}x{% endif %}', names)
    assert template_name_uses("{{ 'lap' if r.run.algorithm == 'fedlap' else '' }}", names)


@pytest.mark.parametrize(
    "planted",
    [
        'if config.federated.algorithm == "fedlap":\n    pass\n',
        'wire = "synthetic" if algorithm in ("fedgm", "feddm") else "updates"\n',
        'ok = name not in {*BASE, "scaffold"}\n',
        'COLOURS = {"fedavg": "#000", "fedprox": "#111"}\n',
        'x = "fedssyn" != algorithm\n',
    ],
)
def test_the_name_check_sees_a_planted_comparison(planted: str) -> None:
    from fedaudit.registry import ALGORITHMS

    assert algorithm_name_uses(planted, frozenset(ALGORITHMS)) == [1]
    assert algorithm_name_uses('label = "fedavg"\nhelp = "see fedlap"\n', frozenset(ALGORITHMS)) == []


def test_no_class_over_300_lines_and_no_function_over_80() -> None:
    """Sizes a reader can hold: a longer class or function is split by concern before it lands."""
    long = []
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            limit = {ast.ClassDef: 300, ast.FunctionDef: 80, ast.AsyncFunctionDef: 80}.get(type(node))
            if limit is not None and node.end_lineno - node.lineno + 1 > limit:
                long.append(f"{name}.{node.name}: {node.end_lineno - node.lineno + 1} lines")
    assert long == []
