"""No import circles among the project's modules (developers' guide), counting the imports made inside functions:
a circle hidden by a lazy import is still a circle (the two modules cannot be understood, tested or moved apart).
Imports under `if TYPE_CHECKING:` run for type checkers only and are left out."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking_block(node: ast.AST) -> bool:
    test = getattr(node, "test", None) if isinstance(node, ast.If) else None
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imported_names(tree: ast.AST, package: str):
    """Every module name an import statement anywhere in `tree` names (`from a import b`: a and a.b)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if _is_type_checking_block(node):
            stack.extend(node.orelse)
            continue
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:   # relative: from the importing module's package
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            yield base
            yield from (f"{base}.{alias.name}" for alias in node.names)
        stack.extend(ast.iter_child_nodes(node))


def import_graph(package_dir: Path = ROOT / "modules") -> dict[str, set[str]]:
    """module -> the project modules it imports, anywhere in its code."""
    files = {_module_name(path, package_dir.parent): path for path in package_dir.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for imported in _imported_names(ast.parse(path.read_text(encoding="utf-8")), package):
            while imported and imported not in files:   # `from a.b import func`: the module a.b
                imported = imported.rpartition(".")[0]
            if imported and imported != name:
                targets.add(imported)
        graph[name] = targets
    return graph


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index, low, on_stack, stack, circles, counter = {}, {}, set(), [], [], 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
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
                    circles.append(sorted(component))
    return circles


def test_the_modules_import_each_other_without_circles():
    assert import_circles(import_graph()) == []


def test_a_circle_through_an_import_inside_a_function_is_found(tmp_path):
    """The check itself: a lazy import closing a circle counts; one under TYPE_CHECKING does not."""
    package = tmp_path / "modules"
    (package / "util").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "util" / "__init__.py").write_text("")
    (package / "util" / "parts.py").write_text("def build():\n    from modules.util.whole import make\n    return make\n")
    (package / "util" / "whole.py").write_text("from modules.util import parts\n\ndef make():\n    return parts\n")
    (package / "util" / "typed.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                               "    from modules.util.user import User\n")
    (package / "util" / "user.py").write_text("from . import typed\n")
    graph = import_graph(package)
    assert graph["modules.util.user"] == {"modules.util", "modules.util.typed"}
    assert import_circles(graph) == [["modules.util.parts", "modules.util.whole"]]

