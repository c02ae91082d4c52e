"""The package layout of issue 14: the core never imports benchmark or test code.

Written by the restructure script (docs/architecture.md, "Modules"). Static: every import of
every module outside pploader/bench and pploader/testing (``if TYPE_CHECKING:`` blocks aside);
dynamic: ``pploader --help`` and a plan import neither package.
"""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "pploader"
HARNESSES = PKG.parent / "benchmarks"  # the experiment harnesses: not in the wheel
TOOLING = ("pploader.bench", "pploader.testing")


def _imports(path: Path, top_level_only: bool = False, root: Path = PKG.parent) -> list[str]:
    """Modules ``path`` imports (``if TYPE_CHECKING:`` blocks aside; with ``top_level_only``,
    also imports inside functions, i.e. lazy ones); ``root``: the repository."""
    module = ".".join(path.relative_to(root).with_suffix("").parts)
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    package = package.removesuffix(".__init__")
    tree = ast.parse(path.read_text())
    skip = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
            and getattr(node.test, "id", getattr(node.test, "attr", None))
            == "TYPE_CHECKING" for n in ast.walk(node)}
    if top_level_only:
        skip |= {id(n) for node in ast.walk(tree)
                 if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                 for n in ast.walk(node)}
    found = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            found.append(mod)
            found += [f"{mod}.{a.name}" for a in node.names]
    return found


def test_core_never_imports_bench_or_testing() -> None:
    """Only the CLI may reach them, and only lazily: bench/ for ``pploader bench``, testing/
    when PPLOADER_FAULT is set (the dynamic test below checks the default path)."""
    bad = []
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG).parts
        if rel[0] in ("bench", "testing"):
            continue
        lazy_ok = rel in (("cli.py",), ("cli_args.py",))  # the CLI, for `pploader bench` only
        bad += [f"{path.relative_to(PKG.parent)} imports {m}"
                for m in _imports(path, top_level_only=lazy_ok) if m.startswith(TOOLING)]
    assert not bad, "\n".join(bad)


def test_every_read_goes_through_the_backend_registry() -> None:
    """Issue 14: a new read backend serves every path only if nothing outside io/ makes a
    backend class itself: the core opens readers with ``open_backend`` (bench/ measures the
    classes directly and may)."""
    backends = {"Reader", "DeviceLoader", "BufferedBackend"}
    bad = []
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG).parts
        if rel[0] in ("io", "bench"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                name = getattr(node.func, "id", getattr(node.func, "attr", None))
                if name in backends:
                    bad.append(f"{path.relative_to(PKG.parent)}:{node.lineno} calls {name}(...)")
    assert not bad, "\n".join(bad)


def test_every_folder_is_a_documented_package() -> None:
    for folder in sorted(p for p in PKG.iterdir() if p.is_dir() and any(p.glob("*.py"))):
        init = folder / "__init__.py"
        assert init.exists(), f"{folder} has no __init__.py"
        assert ast.get_docstring(ast.parse(init.read_text())), f"{init} has no docstring"


def test_help_and_plan_import_no_tooling(tmp_path: Path) -> None:
    code = (
        "import sys, contextlib, io\n"
        "from pploader.cli import main\n"
        "out = io.StringIO()\n"
        "with contextlib.redirect_stdout(out):\n"
        "    try:\n"
        "        main(['--help'])\n"
        "    except SystemExit:\n"
        "        pass\n"
        "assert 'bench' in out.getvalue(), out.getvalue()\n"
        "import pploader, pploader.stage\n"
        "print(sorted(m for m in sys.modules if m.startswith(%r)))\n" % (TOOLING,))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]", proc.stdout


def test_bench_listed_the_same_without_importing_it() -> None:
    from pploader.cli import build_parser
    assert build_parser(bench=False).format_help() == build_parser().format_help()


#: the modules that implement a command (besides the public API, the CLI may import these)
COMMAND_MODULES = ("pploader.cli_args", "pploader.errors", "pploader.tiny", "pploader.pickled",
                   "pploader.planning.files", "pploader.bench.command", "pploader.testing.faults",
                   "pploader.outputs", "pploader.cli_signals")


def test_cli_imports_only_the_public_api_and_command_modules() -> None:
    """Issue 14: ``cli.py`` uses what an embedder uses (``pploader.<public name>``) plus the
    command modules above, lazy imports and ``TYPE_CHECKING`` blocks included."""
    import pploader
    public = {f"pploader.{name}" for name in pploader.__all__}
    path = PKG / "cli.py"
    tree = ast.parse(path.read_text())
    found = []
    for node in ast.walk(tree):  # every import, TYPE_CHECKING blocks and lazy ones included
        if isinstance(node, ast.ImportFrom) and node.level:
            base = "pploader" + (f".{node.module}" if node.module else "")
            found += [base] if node.module else [f"{base}.{a.name}" for a in node.names]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("pploader"):
            found.append(node.module)  # type: ignore[arg-type]
        elif isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.startswith("pploader")]
    assert found, "no pploader import found in cli.py (the test reads the wrong file?)"
    bad = [m for m in found if m not in public and not m.startswith(COMMAND_MODULES)]
    assert not bad, f"cli.py imports internals: {sorted(set(bad))}"


#: test folders that are not a pploader subpackage: the top-level modules (cli.py, job.py,
#: stage.py, the public API), the device suite, the vLLM and SGLang suites and the harnesses
#: of benchmarks/
TEST_FOLDERS_BEYOND_THE_PACKAGE = {"cli", "gpu", "vllm", "sglang", "benchmarks"}


def test_tests_are_grouped_like_the_package() -> None:
    """tests/ mirrors the package (docs/architecture.md, "Tests"): no test file at tests/ itself,
    every test folder is a pploader subpackage (or one of the few above)."""
    tests = PKG.parent / "tests"
    assert not sorted(p.name for p in tests.glob("test_*.py")), "test files at tests/ root"
    folders = {p.parent.name for p in tests.glob("*/test_*.py")}
    packages = {p.name for p in PKG.iterdir() if (p / "__init__.py").exists()}
    assert folders - packages <= TEST_FOLDERS_BEYOND_THE_PACKAGE, folders - packages
    assert {"planning", "io", "bind", "distributed", "cache", "families", "integrations"} <= folders


#: folder (or top-level module) -> the folders and top-level modules it must never import,
#: lazily or not (issue 27): the arrows of the data flow run one way
FORBIDDEN_IMPORTS: dict[str, set[str]] = {
    "families": {"planning", "io", "bind", "distributed", "cache", "integrations", "stage",
                 "job"},
    "planning": {"io", "bind", "distributed", "cache", "integrations", "stage", "job"},
    "io": {"bind", "cache", "integrations", "stage", "job"},
    "cache": {"distributed", "io", "bind", "integrations", "stage", "job"},
    "distributed": {"io", "bind", "cache", "integrations", "stage", "job"},
    "bind": {"integrations", "stage", "job"},
}


def _unit(module: str) -> str:
    """The folder (``planning``) or top-level module (``stage``) of a pploader module."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _unit_graph(skip: tuple[str, ...] = ("bench", "testing", "__init__", "__main__", "cli",
                                          "cli_args")) -> dict[str, set[str]]:
    """unit -> units it imports at run time (lazy imports included, TYPE_CHECKING aside)."""
    graph: dict[str, set[str]] = {}
    for path in sorted(PKG.rglob("*.py")):
        me = _unit(".".join(path.relative_to(PKG.parent).with_suffix("").parts))
        if me in skip:
            continue
        deps = {_unit(m) for m in _imports(path) if m.startswith("pploader.")}
        graph.setdefault(me, set()).update(deps - {me, "", "errors", "report"})
    return graph


def test_folders_import_only_down_the_data_flow() -> None:
    graph = _unit_graph()
    bad = [f"{unit} imports {dep}" for unit, banned in FORBIDDEN_IMPORTS.items()
           for dep in sorted(graph.get(unit, set()) & banned)]
    assert not bad, bad
    # and the rule sees real imports (a broken walker would pass anything)
    assert "planning" in graph["io"] and "families" in graph["planning"]


def test_no_import_cycle_between_folders() -> None:
    """Folders and top-level modules alike, the CLI and bench/ included (only the package's
    ``__init__`` / ``__main__``, which re-export or run everything, stand outside)."""
    graph = _unit_graph(skip=("__init__", "__main__"))
    seen: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(unit: str, path: list[str]) -> None:
        seen[unit] = 1
        for dep in sorted(graph.get(unit, ())):
            if seen.get(dep) == 1:
                raise AssertionError("import cycle: " + " -> ".join(path + [dep]))
            if dep not in seen:
                visit(dep, path + [dep])
        seen[unit] = 2
    for unit in sorted(graph):
        if unit not in seen:
            visit(unit, [unit])


def _folder(module: str) -> str:
    """``pploader.planning`` for ``pploader.planning.plan``; ``pploader`` for top-level
    modules (``pploader.cli``) and for the package itself."""
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 2 else parts[0]


def test_no_private_name_imported_across_folders() -> None:
    """A module never imports another folder's ``_private`` names (they are not that folder's
    interface); inside one folder, modules may share them. benchmarks/ is a folder of its own:
    its harnesses use only pploader's public names."""
    bad = []
    for path in sorted(PKG.rglob("*.py")) + sorted(HARNESSES.rglob("*.py")):
        module = ".".join(path.relative_to(PKG.parent).with_suffix("").parts)
        package = module.removesuffix(".__init__") if path.name == "__init__.py" \
            else module.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom):
                continue
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if not target.startswith(("pploader", "benchmarks")):
                continue
            private = [a.name for a in node.names
                       if a.name.startswith("_") and not a.name.startswith("__")]
            if private and _folder(module) != _folder(target):
                bad.append(f"{module} imports {', '.join(private)} from {target}")
    assert not bad, bad


def test_the_package_never_imports_the_harnesses() -> None:
    """benchmarks/ may import pploader (pploader.bench included), never the reverse: the wheel
    holds no harness, so an import of one would fail for every user."""
    assert (HARNESSES / "__init__.py").exists() and sorted(HARNESSES.glob("*.py"))
    bad = [f"{path.relative_to(PKG.parent)} imports {m}" for path in sorted(PKG.rglob("*.py"))
           for m in _imports(path) if m == "benchmarks" or m.startswith("benchmarks.")]
    assert not bad, bad
    # the walker sees harness imports (a broken one would pass anything)
    assert any(m.startswith("pploader.bench.") for m in _imports(HARNESSES / "gpu_field.py"))


def _module_cycle(folder: Path, root: Path = PKG.parent) -> list[str]:
    """The first import cycle between the modules of ``folder`` (lazy imports included,
    ``TYPE_CHECKING`` aside), or []."""
    prefix = ".".join(folder.relative_to(root).parts)
    names = {f"{prefix}.{p.stem}" for p in folder.glob("*.py")}
    graph = {}
    for path in sorted(folder.glob("*.py")):
        me = f"{prefix}.{path.stem}"
        graph[me] = {m for m in _imports(path, root=root) if m in names} - {me}
    seen: dict[str, int] = {}

    def visit(unit: str, path: list[str]) -> list[str]:
        seen[unit] = 1
        for dep in sorted(graph.get(unit, ())):
            if seen.get(dep) == 1:
                return path + [dep]
            if dep not in seen:
                found = visit(dep, path + [dep])
                if found:
                    return found
        seen[unit] = 2
        return []
    for unit in sorted(graph):
        if unit not in seen:
            found = visit(unit, [unit])
            if found:
                return found
    return []


def test_no_import_cycle_between_the_benchmark_modules(tmp_path: Path) -> None:
    """Neither ``pploader bench``'s modules nor the harnesses import each other in a circle
    (``bench/command`` <-> ``bench/dcp`` and ``bench/cuda`` <-> ``bench/pp2`` were two)."""
    for folder in (PKG / "bench", HARNESSES):
        assert not _module_cycle(folder), " -> ".join(_module_cycle(folder))
    # and the check finds a cycle added back, lazy or not
    copy = tmp_path / "pploader" / "bench"
    copy.mkdir(parents=True)
    (copy / "a.py").write_text("from .b import x\n")
    (copy / "b.py").write_text("def f():\n    from .a import y\n")
    assert _module_cycle(copy, tmp_path) == ["pploader.bench.a", "pploader.bench.b",
                                             "pploader.bench.a"]


#: what users launch; development scripts live in .ci/ (the GPU test runner) or benchmarks/
LAUNCH_SCRIPTS = {"demo.sh", "test.sh", "_venv.sh", "torchrun.sh", "mpirun.sh", "slurm.sbatch",
                  "slurm-per-rank.sbatch", "slurm-stage-files.sbatch"}


def test_launch_holds_what_users_launch() -> None:
    launch = PKG.parent / "launch"
    assert {p.name for p in launch.iterdir() if p.is_file()} == LAUNCH_SCRIPTS
    assert (PKG.parent / ".ci" / "gpu_check.sh").exists()
