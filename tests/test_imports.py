"""House rule: no import cycles in qlab (a lower layer never imports a higher one, not
even inside a function). Walks every module's imports with ast, including imports
inside functions, and fails on the first cycle it finds."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"qlab": ROOT / "qlab", "qlab.kernels": ROOT / "kernels"}


def _modules() -> dict[str, Path]:
    mods = {}
    for prefix, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            mods[".".join([prefix, *parts])] = path
    return mods


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """qlab modules that `name` imports anywhere in its body (a package's __init__ counts
    as the package; `from pkg import sub` counts as the submodule when one exists)."""
    is_pkg = path.name == "__init__.py"
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative import
                anchor = name.split(".")[: len(name.split(".")) - node.level + int(is_pkg)]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base
                       for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in known:  # `import qlab.formats.nf4` -> deepest known module
                t = t.rpartition(".")[0]
            if t and t != name:
                out.add(t)
    return out


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1 = on the stack, 2 = done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    known = set(mods)
    return {m: _imports(m, p, known) for m, p in mods.items()}


def test_no_import_cycle():
    cycle = _find_cycle(_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_walk_sees_imports_inside_functions(tmp_path):
    # the detector must see a deferred import, the form the old scales<->quantize cycle took
    path = tmp_path / "scales.py"
    path.write_text("def f():\n    from qlab.quantize import fake_quantize\n")
    assert _imports("qlab.scales", path, {"qlab.quantize", "qlab.scales"}) == {"qlab.quantize"}
    assert _find_cycle({"a": {"b"}, "b": {"a"}}) == ["a", "b", "a"]


def test_subpackages_load_on_first_use():
    # a fresh interpreter: `import qlab` alone, then the DESIGN.md spellings
    import subprocess
    import sys

    code = (
        "import sys, qlab\n"
        "assert 'qlab.ptq' not in sys.modules and 'qlab.gguf' not in sys.modules\n"
        "assert qlab.ptq.hadamard(12).shape == (12, 12)\n"
        "assert callable(qlab.qat.fake_quantize_ste) and callable(qlab.gguf.load)\n"
        "assert callable(qlab.lm.minilm.load) and callable(qlab.lm.quality.compare)\n"
        "try:\n    qlab.no_such_thing\nexcept AttributeError:\n    pass\n"
        "else:\n    raise SystemExit('no AttributeError')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
