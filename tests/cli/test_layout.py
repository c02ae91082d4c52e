"""The package layout of issue 14: the core never imports benchmark or test code.

Written by the restructure script (docs/architecture.md, "Modules"). Static: every import of
every module outside pploader/bench and pploader/testing (``if TYPE_CHECKING:`` blocks aside);
dynamic: ``pploader --help`` and a plan import neither package.
"""
from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path
from typing import Optional

import pytest

PKG = Path(__file__).resolve().parents[2] / "pploader"
HARNESSES = PKG.parent / "benchmarks"  # the experiment harnesses: not in the wheel
TOOLING = ("pploader.bench", "pploader.testing")


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    """ids of the nodes inside ``if TYPE_CHECKING:`` blocks (imports there never run)."""
    return {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
            and getattr(node.test, "id", getattr(node.test, "attr", None))
            == "TYPE_CHECKING" for n in ast.walk(node)}


def _imports(path: Path, top_level_only: bool = False, root: Path = PKG.parent) -> list[str]:
    """Modules ``path`` imports (``if TYPE_CHECKING:`` blocks aside; with ``top_level_only``,
    also imports inside functions, i.e. lazy ones); ``root``: the repository."""
    module = ".".join(path.relative_to(root).with_suffix("").parts)
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    package = package.removesuffix(".__init__")
    tree = ast.parse(path.read_text())
    skip = _type_checking_nodes(tree)
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


DOC = PKG.parent / "docs" / "architecture.md"
#: the leaf modules every folder may import (the doc's table says so)
LEAVES = {"errors", "arguments", "report"}


def _allowed_imports(text: str) -> dict[str, Optional[list[str]]]:
    """folder -> the folders and top-level modules it may import, in the order of the rows of
    docs/architecture.md, "Folders: the phases of a load" (None: ``anything``, tooling)."""
    section = text.split("## Folders: the phases of a load", 1)[1].split("\n## ", 1)[0]
    allowed: dict[str, Optional[list[str]]] = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        folder = re.fullmatch(r"`(\w+)/`", cells[1]) if len(cells) == 4 else None
        if folder:
            assert folder[1] not in allowed, f"{folder[1]}/ has two rows"
            allowed[folder[1]] = None if cells[3] == "anything" else \
                re.findall(r"`(\w+)`", cells[3])
    assert allowed, f"no folder table found in {DOC}"
    return allowed


def _unit(module: str) -> str:
    """The folder (``planning``) or top-level module (``stage``) of a pploader module."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _unit_graph(skip: tuple[str, ...] = ("bench", "testing", "__init__", "__main__", "cli",
                                          "cli_args")) -> dict[str, set[str]]:
    """unit -> units it imports at run time (lazy imports included, TYPE_CHECKING aside; the
    package itself, ``from pploader import X``, re-exports everything and stands outside)."""
    graph: dict[str, set[str]] = {}
    for module, deps in _module_graph(PKG).items():
        me = _unit(module) if module != "pploader" else "__init__"
        if me not in skip:
            graph.setdefault(me, set()).update({_unit(d) for d in deps} - {me, ""})
    return graph


def test_folders_import_only_down_the_data_flow() -> None:
    """Each folder imports only what its row of the doc's table allows (plus the leaves), and
    the table runs down the data flow: a row names only folders of the rows above it."""
    allowed = _allowed_imports(DOC.read_text())
    folders = sorted(p.name for p in PKG.iterdir() if (p / "__init__.py").exists())
    assert sorted(allowed) == folders, f"{DOC.name}'s folder table lists {sorted(allowed)}, " \
        f"the package has {folders}: one row per folder"
    above: list[str] = []
    for folder, may in allowed.items():
        stray = [m for m in may or () if m in allowed and m not in above]
        assert not stray, f"{folder}/ may import {stray}, not above it in the table"
        unknown = [m for m in may or () if m not in allowed and not (PKG / f"{m}.py").exists()]
        assert not unknown, f"{folder}/'s row names {unknown}: no such folder or module"
        above.append(folder)
    graph = _unit_graph(skip=())
    bad = [f"{folder}/ imports {dep} (its row allows {may})" for folder, may in allowed.items()
           if may is not None for dep in sorted(graph.get(folder, set()) - set(may) - LEAVES)]
    assert not bad, bad
    # and the rule sees real imports (a broken walker would pass anything)
    assert "planning" in graph["io"] and "families" in graph["planning"]
    assert "storage" in graph["planning"] and "planning" in graph["distributed"]


def test_the_folder_table_is_read_from_the_doc() -> None:
    """The reader above on a synthetic table: rows, ``anything``, a duplicate refused."""
    text = ("## Folders: the phases of a load\n\n| phase | folder | owns | may import |\n"
            "|---|---|---|---|\n| what | `a/` | x | nothing |\n| plan | `b/` | y | `a`, `c` |\n"
            "| tooling | `t/` | z | anything |\n\n## Next\n| r | `d/` | w | `a` |\n")
    assert _allowed_imports(text) == {"a": [], "b": ["a", "c"], "t": None}
    with pytest.raises(AssertionError, match="two rows"):
        _allowed_imports(text.replace("`b/`", "`a/`"))


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


def _module_graph(pkg: Path) -> dict[str, set[str]]:
    """module -> the modules of ``pkg`` it imports, lazily or not (``if TYPE_CHECKING:`` blocks
    aside): ``from a import b`` is an import of module ``a.b`` when that is a module, else of
    ``a``; a package is its ``__init__``."""
    paths = {}
    for path in sorted(pkg.rglob("*.py")):
        parts = path.relative_to(pkg.parent).with_suffix("").parts
        paths[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph: dict[str, set[str]] = {}
    for module, path in paths.items():
        package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
        tree = ast.parse(path.read_text())
        skip = _type_checking_nodes(tree)
        deps = graph[module] = set()
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            if isinstance(node, ast.Import):
                deps.update(a.name for a in node.names if a.name in paths)
            elif isinstance(node, ast.ImportFrom):
                base = package.split(".")[: len(package.split(".")) - node.level + 1] \
                    if node.level else []
                target = ".".join(base + ([node.module] if node.module else []))
                for alias in node.names:
                    sub = f"{target}.{alias.name}"
                    deps.update([sub] if sub in paths else [target] if target in paths else [])
        deps.discard(module)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan, iterative): every
    group of modules that import one another round a loop."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, deps = work[-1]
            dep = next((d for d in deps if d in graph), None)
            if dep is not None:
                if dep not in index:
                    index[dep] = low[dep] = len(index)
                    stack.append(dep)
                    on_stack.add(dep)
                    work.append((dep, iter(sorted(graph[dep]))))
                elif dep in on_stack:
                    low[node] = min(low[node], index[dep])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    top = stack.pop()
                    on_stack.discard(top)
                    group.append(top)
                    if top == node:
                        break
                if len(group) > 1:
                    found.append(sorted(group))
    return sorted(found)


def _same_folder_graph(graph: dict[str, set[str]], packages: set[str]) -> dict[str, set[str]]:
    """Only the imports between modules of one folder (a package's ``__init__`` and every
    module below it, subfolders included: io/transfer/ is io's), or between top-level modules
    (the package's ``__init__`` among them)."""
    def folder(module: str) -> str:
        parts = module.split(".")
        return ".".join(parts[:2]) if len(parts) > 2 or module in packages else parts[0]
    return {m: {d for d in deps if folder(d) == folder(m)} for m, deps in graph.items()}


def test_no_import_cycle_between_modules() -> None:
    """Inside each folder, and between the top-level modules, no module imports another that
    imports it back, directly or round a loop (lazy imports count: only ``if TYPE_CHECKING:``
    is exempt). A piece both sides need moves down into a module both import."""
    graph = _module_graph(PKG)
    packages = {m for m in graph if (PKG.parent / m.replace(".", "/") / "__init__.py").exists()}
    graph = _same_folder_graph(graph, packages)
    cycles = _cycles(graph)
    assert not cycles, "import cycles (each group imports itself round a loop):\n" + "\n".join(
        " <-> ".join(c) + ": " + "; ".join(f"{m} -> {d}" for m in c for d in sorted(graph[m])
                                            if d in c) for c in cycles)
    # the walker sees real edges inside folders (a broken one would pass anything)
    assert "pploader.planning.index" in graph["pploader.planning.checkpoint"]
    assert "pploader.planning.rank_plan" in graph["pploader.planning.plan"]
    assert "pploader.stage" in graph["pploader.job"]


def test_the_whole_package_imports_without_a_cycle() -> None:
    """Across folders too, with the families' discovery (``families/__init__`` imports every
    family module by name) as edges: two threads importing pploader's modules at once (a
    loader's background thread beside the caller) can wait on each other's module locks only
    round such a loop."""
    graph = _module_graph(PKG)
    graph["pploader.families"] |= {m for m in graph if m.startswith("pploader.families.")}
    assert not _cycles(graph)


def test_the_cycle_finder_finds_cycles(tmp_path: Path) -> None:
    """The finder above on synthetic graphs and a synthetic package: a loop of three and a
    two-module loop are found, a chain is not, a ``TYPE_CHECKING`` import is no edge and a lazy
    one is."""
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"f"}, "f": {"e"}}) \
        == [["a", "b", "c"], ["e", "f"]]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": set(), "d": {"a", "c"}}) == []
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    for name, text in {
        "__init__.py": "from .top import VALUE\n",
        "top.py": "VALUE = 1\n",
        "sub/__init__.py": "",
        "sub/low.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                      "    from .high import High\n",
        "sub/high.py": "from . import low\nfrom .. import top\n",
        "sub/lazy.py": "def f():\n    from .eager import g\n",
        "sub/eager.py": "from pkg.sub.lazy import f\n",
    }.items():
        (pkg / name).write_text(text)
    graph = _module_graph(pkg)
    assert graph["pkg.sub.high"] == {"pkg.sub.low", "pkg.top"} and graph["pkg.sub.low"] == set()
    assert graph["pkg"] == {"pkg.top"}
    inside = _same_folder_graph(graph, {"pkg", "pkg.sub"})
    assert inside["pkg.sub.high"] == {"pkg.sub.low"}
    assert _cycles(inside) == [["pkg.sub.eager", "pkg.sub.lazy"]]


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
