"""No module of the package imports another module's private names: what modules share is public API."""

import ast
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
