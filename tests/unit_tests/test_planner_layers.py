"""The planner's stages import only the stages before them, and nothing of the trainer.

Read from the source (every `import`, also those inside functions), so a late import cannot
hide a layering violation.  The order is the pipeline of `torchtitan/autoparallel/README.md`.
"""

import ast
from pathlib import Path

import torchtitan.autoparallel as ap

PACKAGE = Path(ap.__file__).parent
# leaves first; a stage may import any stage listed before it
STAGES = [
    "errors",
    "child_process",
    "graph",
    "ops",
    "trace",
    "policies",
    "strategies",
    "cost",
    "solve",
    "plan",
    "execute",
    "api",
    "mesh_search",
]
# the only modules of `torchtitan` outside the planner it may use: leaves that know torch only
# (the routed-experts op and its expert-parallel kernels: model code and the planner share them),
# and one that knows only the standard library (a forked child dies with its parent)
SHARED_LEAVES = {
    "torchtitan.torch_private",
    "torchtitan.exact_init",
    "torchtitan.recompute_ops",
    "torchtitan.ops.routed_experts",
    "torchtitan.distributed.expert_parallel",
    "torchtitan.tools.local_processes",
}


def _stage_of(path: Path) -> str:
    rel = path.relative_to(PACKAGE)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def _imports(path: Path) -> list[str]:
    """Absolute names of the modules `path` imports (relative imports resolved)."""
    package = ".".join(("torchtitan", "autoparallel", *path.relative_to(PACKAGE).parts[:-1]))
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            out += [base] if node.module else [f"{base}.{a.name}" for a in node.names]
    return out


def _violations() -> list[str]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "__init__.py" and path.parent == PACKAGE:
            continue  # the package's public re-exports
        stage = _stage_of(path)
        rank = STAGES.index(stage)
        for name in _imports(path):
            if not name.startswith("torchtitan"):
                continue
            if name.startswith("torchtitan.autoparallel."):
                other = name.split(".")[2]
                if other != stage and STAGES.index(other) > rank:
                    found.append(f"{path.relative_to(PACKAGE)} imports {name} (a later stage)")
            elif name not in SHARED_LEAVES:
                found.append(f"{path.relative_to(PACKAGE)} imports {name} (outside the planner)")
    return found


def test_every_module_belongs_to_a_known_stage():
    unknown = {_stage_of(p) for p in PACKAGE.rglob("*.py") if p.name != "__init__.py"}
    assert unknown <= set(STAGES), sorted(unknown - set(STAGES))


def test_stages_import_only_earlier_stages_and_no_trainer_module():
    assert _violations() == []


def test_the_check_sees_a_late_import_of_a_later_stage(tmp_path, monkeypatch):
    """The walk finds imports inside functions and resolves `..` (so the check can fail)."""
    fake = PACKAGE / "graph" / "nodes.py"
    source = fake.read_text() + "\n\ndef _late():\n    from ..execute import lower  # noqa\n"
    monkeypatch.setattr(Path, "read_text", lambda self: source if self == fake else _read(self))
    assert any("graph/nodes.py imports torchtitan.autoparallel.execute" in v for v in _violations())


_read = Path.read_text
