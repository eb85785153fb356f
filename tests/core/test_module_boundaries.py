"""No module of the package imports another module's private names: what modules share is public API."""

import ast
import re
from pathlib import Path

import shared_prefix_logps

PACKAGE = Path(shared_prefix_logps.__file__).parent


def _private_imports(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom):
            module = node.module or ""
            inside = node.level > 0 or module.startswith("shared_prefix_logps")
            for alias in node.names:
                if inside and alias.name.startswith("_") and not alias.name.startswith("__"):
                    found.append(f"{path.relative_to(PACKAGE)}:{node.lineno} imports {alias.name} from {module or '.'}")
    return found


def test_no_module_imports_another_modules_private_names():
    found = [hit for path in sorted(PACKAGE.rglob("*.py")) for hit in _private_imports(path)]
    assert not found, "\n".join(found)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports, from every import statement (those inside functions too): ``from
    .x import y`` counts ``x.y`` when ``y`` is a module, else ``x``; importing a module does not count as importing its
    parent packages (Python runs those first, but they only gather the public names)."""
    paths = {_module_name(path): path for path in PACKAGE.rglob("*.py")}
    graph = {}
    for module, path in paths.items():
        package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parent = package[: len(package) - node.level + 1]
                    base = ".".join(parent + ([node.module] if node.module else []))
                for alias in node.names:
                    full = f"{base}.{alias.name}"
                    targets.add(full if full in paths else base)
            elif isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
        graph[module] = {target for target in targets if target in paths and target != module}
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            for target in edges:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(graph[target]))))
                    break
                if target in on_stack:
                    low[node] = min(low[node], index[target])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def test_no_import_circle():
    circles = _circles(import_graph())
    assert not circles, "import circles:\n" + "\n".join(" <-> ".join(circle) for circle in circles)


def test_the_circle_finder_finds_a_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _circles(graph) == [["a", "b", "c"]]
    assert _circles({"a": {"b"}, "b": set()}) == []


ARCHITECTURE = PACKAGE.parent / "ARCHITECTURE.md"

#: The package's parts outside the core: tools built on it, which ARCHITECTURE.md's layering leaves out.
OUTSIDE_CORE = ("bench", "plan", "integrations", "losses", "cli")


def documented_floors(text: str) -> dict[str, int]:
    """ARCHITECTURE.md's layering list as floors: each numbered line's backticked names (``kernels/`` a package,
    ``api`` a module) mapped to the line's number."""
    section = text.split("Layering of the core, bottom to top", 1)[1].split("\n\nTests mirror", 1)[0]
    floors = {}
    for match in re.finditer(r"^(\d+)\. (.*)$", section, flags=re.MULTILINE):
        for name in re.findall(r"`([^`]+)`", match.group(2).split(":", 1)[0]):
            floors[name.rstrip("/")] = int(match.group(1))
    return floors


def floor_of(module: str, floors: dict[str, int]) -> int | None:
    """The floor of ``module`` (``shared_prefix_logps.engine.walk``): its first part below the package, or the package
    itself; None for the parts outside the core."""
    parts = module.split(".")[1:]
    name = parts[0] if parts else "shared_prefix_logps"
    return floors.get(name)


def upward_imports(graph: dict[str, set[str]], floors: dict[str, int]) -> list[str]:
    """Every import from a core module to one on a higher floor, or to a part outside the core."""
    found = []
    for module, targets in sorted(graph.items()):
        floor = floor_of(module, floors)
        if floor is None:
            continue
        for target in sorted(targets):
            target_floor = floor_of(target, floors)
            if target_floor is None or target_floor > floor:
                found.append(f"{module} (floor {floor}) imports {target} (floor {target_floor})")
    return found


def test_every_core_module_is_on_a_documented_floor():
    floors = documented_floors(ARCHITECTURE.read_text())
    assert len(set(floors.values())) >= 8, floors
    unplaced = sorted(
        {module.split(".")[1] for module in import_graph() if "." in module}
        - set(floors)
        - set(OUTSIDE_CORE)
        - {"__main__"}
    )
    assert not unplaced, f"modules of the package on no floor of ARCHITECTURE.md's layering: {unplaced}"


def test_no_import_runs_up_the_floors():
    found = upward_imports(import_graph(), documented_floors(ARCHITECTURE.read_text()))
    assert not found, "imports against ARCHITECTURE.md's layering:\n" + "\n".join(found)


def test_the_floor_check_finds_an_import_up():
    """The check itself: an import from a lower floor to a higher one, and from the core to a tool, are reported."""
    floors = {"model": 7, "engine": 9, "forward": 5}
    graph = {
        "shared_prefix_logps.model.head_check": {"shared_prefix_logps.engine.call_planner"},
        "shared_prefix_logps.engine.walk": {"shared_prefix_logps.forward.context", "shared_prefix_logps.bench.x"},
        "shared_prefix_logps.bench.x": {"shared_prefix_logps.engine.walk"},
    }
    found = upward_imports(graph, floors)
    assert found == [
        "shared_prefix_logps.engine.walk (floor 9) imports shared_prefix_logps.bench.x (floor None)",
        "shared_prefix_logps.model.head_check (floor 7) imports shared_prefix_logps.engine.call_planner (floor 9)",
    ]


def test_one_cli_module_that_no_module_imports():
    """The command line is one module (``cli.py``): subcommands keep their options and runs in ``command.py`` modules,
    and no module imports the command line."""
    cli_modules = sorted(str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("cli.py"))
    assert cli_modules == ["cli.py"], cli_modules
    importers = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""] + [alias.name for alias in node.names]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            if any(name == "cli" or name.endswith(".cli") for name in names):
                importers.append(str(path.relative_to(PACKAGE)))
    assert not importers, importers


#: The most positional arguments a function of the engine takes, or a call inside it passes: more travel as keywords
#: or together (the entry point's ``CallSettings``, a call's ``CallOutputs``), so that no long argument list has to
#: agree in order between a caller and a callee.
MOST_POSITIONAL = 5


def long_positional_lists(source: str, name: str) -> list[str]:
    """``name:line`` of each definition with more than :data:`MOST_POSITIONAL` positional parameters (``self`` and
    ``cls`` not counted) and each call passing more than that many positional arguments, in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            params = [a.arg for a in node.args.posonlyargs + node.args.args if a.arg not in ("self", "cls")]
            if len(params) > MOST_POSITIONAL:
                found.append(f"{name}:{node.lineno} def {node.name} ({len(params)} positional)")
        elif isinstance(node, ast.Call) and len(node.args) > MOST_POSITIONAL:
            found.append(f"{name}:{node.lineno} call of {ast.unparse(node.func)} ({len(node.args)} positional)")
    return found


def test_engine_calls_take_at_most_five_positional_arguments():
    found = []
    for path in sorted((PACKAGE / "engine").glob("*.py")):
        found += long_positional_lists(path.read_text(), str(path.relative_to(PACKAGE)))
    assert not found, "\n".join(found)


def test_the_positional_check_finds_long_lists():
    source = "def f(a, b, c, d, e, g, *, h): pass\nclass C:\n    def m(self, a, b, c, d, e): f(1, 2, 3, 4, 5, 6)\n"
    assert long_positional_lists(source, "x.py") == ["x.py:1 def f (6 positional)", "x.py:3 call of f (6 positional)"]
