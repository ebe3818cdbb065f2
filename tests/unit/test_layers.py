"""The tree's layers, read from the source: three sibling services on one platform.

- a service (`coordinator`, `sampler_svc`, `trainer_svc`) imports only itself, the shared package
  `rlcommon` and `protos`, never another service;
- `rlcommon` imports only itself and `protos`; `protos` imports nothing of the repository;
- inside `rlcommon`, the rooms (`config/`, `bus/`, `models/`) import only what they stand on (`ROOMS`);
- no import circle among the repository's modules (every import counts: module level, inside functions and
  under TYPE_CHECKING).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SERVICES = ("coordinator", "sampler_svc", "trainer_svc")
PACKAGES = (*SERVICES, "rlcommon", "protos", "launcher", "experiments", "benchmarks")
ALLOWED = {
    **{service: {service, "rlcommon", "protos"} for service in SERVICES},
    "rlcommon": {"rlcommon", "protos"},
    "protos": {"protos"},
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def repository_modules() -> dict[str, Path]:
    return {
        module_name(path): path
        for package in PACKAGES
        for path in sorted((REPO / package).rglob("*.py"))
    }


def imports_of(path: Path, modules: dict[str, Path]) -> set[str]:
    """The repository modules `path` imports (a `from package import name` names the submodule when there
    is one, else the package)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in modules else node.module
                     for alias in node.names]
        else:
            continue
        for name in names:
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name:
                found.add(name)
    return found


MODULES = repository_modules()
GRAPH = {name: imports_of(path, MODULES) - {name} for name, path in MODULES.items()}


def test_the_walk_sees_the_known_edges():
    """The walker itself: edges that exist (module level and lazy) are found, so a pass means something."""
    assert "rlcommon.plan_ids" in GRAPH["trainer_svc.service"]
    assert "rlcommon.weight_store" in GRAPH["sampler_svc.engine"]
    assert "coordinator.service" in GRAPH["coordinator.__main__"]  # imported inside serve()
    assert "protos.coordinator_pb2" in GRAPH["rlcommon.rpc"]


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_no_service_imports_another(package):
    wrong = sorted(
        f"{module} imports {target}"
        for module, targets in GRAPH.items()
        if module.split(".")[0] == package
        for target in targets
        if target.split(".")[0] not in ALLOWED[package]
    )
    assert not wrong, f"{package} may import only {sorted(ALLOWED[package])}:\n" + "\n".join(wrong)


def test_no_import_circle():
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []
    circles: list[list[str]] = []

    def visit(module: str) -> None:
        state[module] = 1
        path.append(module)
        for target in sorted(GRAPH[module]):
            if state.get(target) == 1:
                circles.append(path[path.index(target):] + [target])
            elif target not in state:
                visit(target)
        path.pop()
        state[module] = 2

    for module in sorted(GRAPH):
        if module not in state:
            visit(module)
    assert not circles, "import circles:\n" + "\n".join(" -> ".join(c) for c in circles)


ROOMS = {
    "rlcommon.config": set(),
    "rlcommon.bus": {"rlcommon.config", "rlcommon.streams", "rlcommon.wire"},
    "rlcommon.models": {"rlcommon.config", "rlcommon.task"},
}
"""The platform's rooms and the only other modules (or packages) each may import: the config at the bottom (it
imports nothing of the repository), the bus on the wire format and the stream names, the models on the task
package (problems, prompt format, rewards: the warm start trains and measures on the task)."""


def _in(module: str, room: str) -> bool:
    return module == room or module.startswith(room + ".")


@pytest.mark.parametrize("room", sorted(ROOMS))
def test_each_room_of_the_platform_imports_only_what_it_stands_on(room):
    wrong = sorted(
        f"{module} imports {target}"
        for module, targets in GRAPH.items() if _in(module, room)
        for target in targets if not _in(target, room) and not any(_in(target, allowed) for allowed in ROOMS[room])
    )
    assert not wrong, f"{room} may import only itself and {sorted(ROOMS[room])}:\n" + "\n".join(wrong)


def test_the_rooms_are_packages_the_walk_sees():
    """A room split into modules is seen module by module (a pass above means something)."""
    assert {"rlcommon.bus.consumer", "rlcommon.config.loading", "rlcommon.models.builder"} <= set(GRAPH)
    assert "rlcommon.config.base" in GRAPH["rlcommon.config.sampler"]


PROTO_SPEAKERS = {"rlcommon.coordinator_api", "rlcommon.rpc"}
"""Outside coordinator/, the modules that build or read protobuf messages: the typed client and its transport."""


def test_only_the_coordinator_and_its_typed_client_import_protos():
    """Everyone else calls the coordinator through rlcommon.coordinator_api, so its imports find every speaker."""
    wrong = sorted(
        f"{module} imports {target}"
        for module, targets in GRAPH.items()
        if module.split(".")[0] not in ("coordinator", "protos") and module not in PROTO_SPEAKERS
        for target in targets
        if target.split(".")[0] == "protos" and target != "protos.codegen"
    )
    assert not wrong, "only coordinator/ and " + ", ".join(sorted(PROTO_SPEAKERS)) + " may import protos:\n" + \
        "\n".join(wrong)


STREAM_CALLS = {"stream_key", "from_config"}
"""Calls that take a stream's name: `stream_key(run_id, name)`, `StreamProducer/StreamConsumer.from_config(.., name)`."""


def test_nothing_outside_rlcommon_streams_spells_a_stream_name_or_a_key_prefix():
    """Stream names and keys come from rlcommon/streams.py (TASKS, ROLLOUTS, DEADLETTER, TOKENS, coord_key), so
    following its imports finds everyone who touches a stream."""
    wrong = []
    for module, path in MODULES.items():
        if module == "rlcommon.streams":
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("dlc:"):
                wrong.append(f"{module}:{node.lineno} spells the key prefix {node.value!r}")
            if isinstance(node, ast.JoinedStr) and node.values and isinstance(node.values[0], ast.Constant) \
                    and str(node.values[0].value).startswith("dlc:"):
                wrong.append(f"{module}:{node.lineno} builds a key from the prefix 'dlc:'")
            if isinstance(node, ast.Call):
                name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
                if name in STREAM_CALLS:
                    wrong += [f"{module}:{node.lineno} {name}(..., {arg.value!r})" for arg in node.args
                              if isinstance(arg, ast.Constant) and arg.value in ("tasks", "rollouts", "deadletter",
                                                                                "tokens")]
    assert not wrong, "use rlcommon.streams' names:\n" + "\n".join(sorted(wrong))


ROW_FIELDS = {"step", "weight_version", "tokens", "num_rollouts"}
"""Step statistics whose names are also fields of other records the page shows (a sampler's version and
rollout count, a rollout's tokens, a sync's step): the script may spell those."""


def test_the_dashboard_script_spells_no_step_statistic():
    """The page reads the statistics' names from the API (coordinator/dashboard_data.py CHARTS and HEADLINE,
    built from rlcommon/step_stats.py), so renaming a statistic there renames it on the page."""
    import re

    from rlcommon.step_stats import STATS

    script = (REPO / "coordinator/static/dashboard.js").read_text()
    spelled = sorted(name for name in set(STATS) - ROW_FIELDS
                     if re.search(r"[\"'`.]" + re.escape(name) + r"\b", script))
    assert not spelled, f"coordinator/static/dashboard.js spells step statistics {spelled}: read them from the API"
