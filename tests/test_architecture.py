"""Every import in src/gpukit points down the layer list of docs/architecture.md.

The list is read from the page (its ```text block under "## Layers"), so the page and the code
cannot drift apart. Lazy imports inside functions and ``TYPE_CHECKING`` imports count too; the
package's face (``gpukit/__init__.py``, ``__main__.py``) re-exports from every layer and is exempt.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "gpukit"
EXEMPT = {"__init__", "__main__"}


def _layers() -> dict[str, int]:
    """Layer name (package or module, without ``/`` or ``.py``) -> row, 0 at the top."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    block = re.search(r"^## Layers\n.*?^```text\n(.*?)^```", text, re.M | re.S)
    assert block, "docs/architecture.md has no ```text block under '## Layers'"
    rows: dict[str, int] = {}
    for row, line in enumerate(block.group(1).splitlines()):
        for word in line.split():
            if not re.fullmatch(r"[\w]+(/|\.py)", word):
                break
            rows[word.removesuffix("/").removesuffix(".py")] = row
    return rows


def _layer_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "gpukit" and len(parts) > 1 else None


def _imports(path: Path) -> list[tuple[int, str]]:
    """``(line, module)`` for every gpukit import in ``path``."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "gpukit":  # `from gpukit import memory`: the submodule's layer
                out += [(node.lineno, f"gpukit.{alias.name}") for alias in node.names]
            else:
                out.append((node.lineno, node.module))
        elif isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
    return [(line, module) for line, module in out if module.startswith("gpukit.")]


def test_every_layer_of_the_package_is_on_the_list() -> None:
    rows = _layers()
    present = {p.stem for p in PACKAGE.glob("*.py")} | {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    missing = sorted(present - EXEMPT - set(rows))
    assert not missing, f"docs/architecture.md's layer list lacks {missing}"
    assert not sorted(set(rows) - present), "the layer list names layers that do not exist"


def test_imports_point_down_the_layers() -> None:
    rows = _layers()
    upward = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        source = parts[0]
        if source in EXEMPT:
            continue
        for line, module in _imports(path):
            target = _layer_of(module)
            if target is None or target == source or target == "__version__":
                continue
            if rows[target] <= rows[source]:
                upward.append(f"{path.relative_to(ROOT)}:{line} imports {module} ({target} is not below {source})")
    assert not upward, "\n".join(upward)


def test_the_check_sees_an_import_that_runs_up(tmp_path: Path) -> None:
    rows = _layers()
    assert rows["cli"] < rows["session"] < rows["launch"] < rows["devices"] < rows["_util"] < rows["errors"]
    assert rows["launch"] < rows["strategies"] < rows["checkpoint"] < rows["worker"] < rows["monitor"]
    bad = tmp_path / "x.py"
    bad.write_text("def f():\n    from gpukit.session import Session\n")
    assert _imports(bad) == [(2, "gpukit.session")]


ENV_NAMES = PACKAGE / "_util" / "envvars.py"


def _env_name_literals(path: Path) -> list[tuple[int, str]]:
    """``(line, name)`` for every string constant in ``path`` that is exactly a ``GPUKIT_*`` name."""
    return [(node.lineno, node.value) for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Constant) and isinstance(node.value, str)
            and re.fullmatch(r"GPUKIT_[A-Z0-9_]+", node.value)]


def test_each_gpukit_variable_is_named_once() -> None:
    """``_util/envvars.py`` names every ``GPUKIT_*`` variable, once; code elsewhere uses its constants."""
    names = [name for _, name in _env_name_literals(ENV_NAMES)]
    assert len(names) == len(set(names)), f"named twice in {ENV_NAMES.name}: {sorted(n for n in names if names.count(n) > 1)}"
    elsewhere = [f"{path.relative_to(ROOT)}:{line} spells {name}"
                 for path in sorted(PACKAGE.rglob("*.py")) if path != ENV_NAMES
                 for line, name in _env_name_literals(path)]
    assert not elsewhere, "use the constant of gpukit._util.envvars instead:\n" + "\n".join(elsewhere)


def test_the_name_check_sees_a_second_spelling(tmp_path: Path) -> None:
    bad = tmp_path / "x.py"
    bad.write_text('import os\nos.environ.get("GPUKIT_RUN_DIR")\nprint("GPUKIT_RUN_DIR is a directory")\n')
    assert _env_name_literals(bad) == [(2, "GPUKIT_RUN_DIR")]
