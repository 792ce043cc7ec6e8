"""The package's imports run one way (config -> profile -> problem -> plan -> runtime -> metrics, the
commands on top): every import statement in heterps_ray/, at module level or inside a function, is
read with `ast` and must reach a part on a lower layer than its own."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "heterps_ray"

# Each part of heterps_ray (a sub-package, or a module at the top) and its layer: a part imports only
# parts on lower layers (the shared modules of layer 0 also import one another).
LAYERS: dict[str, int] = {
    **dict.fromkeys(
        ("errors", "paths", "devices", "config", "chaos", "reusable", "cluster", "host_cpu"), 0
    ),
    **dict.fromkeys(("ps", "models", "metrics"), 1),
    "data": 2,
    **dict.fromkeys(("profiling_host", "costmodel"), 3),  # the profiler's actor: below profiler and runtime
    **dict.fromkeys(("profiling", "scheduling", "runtime"), 4),
    **dict.fromkeys(("serving", "deploy", "experiments"), 5),
    "closedloop": 6,
    "cli": 7,
    "__main__": 8,
}
SHARED = 0


def _part(module: str) -> str | None:
    """The part of heterps_ray that `module` (a dotted name) belongs to; None outside the package."""
    names = module.split(".")
    if names[0] != "heterps_ray" or len(names) < 2:
        return None
    return names[1]


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import of heterps_ray in the file, wherever it stands."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
        elif isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
    return found


def _upward_imports() -> list[str]:
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE)
        own = relative.parts[0] if len(relative.parts) > 1 else relative.stem
        if own == "__init__":
            continue
        assert own in LAYERS, f"{relative}: a new part of heterps_ray; give it a layer in LAYERS"
        for line, module in _imports(path):
            part = _part(module)
            if part is None or part == own:
                continue
            assert part in LAYERS, f"{relative}:{line} imports {module}: a part with no layer in LAYERS"
            mine, theirs = LAYERS[own], LAYERS[part]
            if theirs < mine or theirs == mine == SHARED:
                continue
            wrong.append(f"heterps_ray/{relative}:{line} imports {module} (layer {theirs} from {mine})")
    return wrong


def test_imports_point_down_the_layers():
    assert _upward_imports() == []


def test_the_profiler_imports_nothing_of_the_closed_loop_and_the_runtime_nothing_of_the_profiler():
    """The two arrows that once ran the wrong way, named: profiling/ -> closedloop/ (the profile
    command) and runtime/ -> profiling/ (the warm workers' profiling duty)."""
    for own, forbidden in (("profiling", "closedloop"), ("runtime", "profiling")):
        for path in sorted((PACKAGE / own).rglob("*.py")):
            for line, module in _imports(path):
                assert _part(module) != forbidden, f"{path.relative_to(PACKAGE)}:{line} imports {module}"
