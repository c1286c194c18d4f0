"""Plan a deep model from a shallow copy: repeated blocks are traced three times, not N.

A container (`nn.ModuleList`, `nn.ModuleDict`, `nn.Sequential`) with a run of four or more
consecutive children of identical structure (same class, same parameter/buffer names, shapes
and dtypes, same submodule classes) is a stack of repeated blocks, like a transformer's
layers (a mixture-of-experts decoder has two runs: its dense layers, then its MoE layers).
Tracing cost grows with depth, but the plan does not need every copy: the planner traces a
copy of the model that keeps only the **first, second and last** block of each run of four
or more (and every block of a shorter run).  A run's second block stands for its interior
blocks, so the nodes it produced weigh `N - 2` in the solver's objective and memory row
(`TracedGraph.weights`); the first and last keep their own plans (their neighbours
differ).  This is the same restriction as sharing solver variables between
identical layers, with a graph that no longer grows with depth.

Every node traced inside a block is labelled `"<container>#<position>"` (a forward hook enters
`torch.fx.traceback.annotate`; AOTAutograd copies the label to the backward nodes derived
from it).  A node made outside every block from one block's tensors only (a
mixed-precision cast of a block's parameter) takes that block's label; any other node takes
the label of the node before it in graph order: glue the parent runs between blocks (a
residual add around each block), gradient accumulations, the head and loss after the last
block.  Both graphs are labelled by the same rule, so the glue after block i weighs what block
i weighs, and the head and loss belong to the last block (weight 1).  To run the plan,
`expand.expand_plan` maps the full model's graph onto it: the k-th node of full block i
reads the k-th node of the block that represents i, unlabelled nodes map in order, and every
pair must be the same op with the same output shapes — a model whose blocks differ at run
time (e.g. a forward that branches on the layer index) is reported, not silently mis-planned.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch.fx as fx
import torch.nn as nn

MIN_BLOCKS = 4  # with 3 or fewer blocks a shallow trace saves nothing
LABEL_KEY = "autoparallel_block"


@dataclass(frozen=True)
class RepeatedBlocks:
    """A container whose children form runs of structurally identical blocks; `runs` holds
    (first position, length) of each maximal run, covering every child in order (a
    mixture-of-experts decoder: a run of dense layers, then a run of MoE layers)."""

    container: str  # FQN of the container module
    keys: tuple[str, ...]  # child names in the full model, in order
    renumbers: bool  # ModuleList/Sequential renumber children; ModuleDict keeps keys
    runs: tuple[tuple[int, int], ...] = ()

    def __post_init__(self) -> None:
        if not self.runs:  # one run of every child
            object.__setattr__(self, "runs", ((0, len(self.keys)),))

    @property
    def kept(self) -> tuple[int, ...]:
        """Positions (in the full model) of the blocks the shallow copy keeps: the first,
        second and last of a run of MIN_BLOCKS or more, every block of a shorter one."""
        out: list[int] = []
        for start, n in self.runs:
            out += [start, start + 1, start + n - 1] if n >= MIN_BLOCKS else range(start, start + n)
        return tuple(out)

    def representative(self, i: int) -> int:
        """Position in the shallow copy of the block that stands for full block i."""
        kept = self.kept
        if i in kept:
            return kept.index(i)
        return kept.index(self._run_of(i)[0] + 1)  # an interior block: its run's second

    def multiplicity(self, j: int) -> int:
        """How many full blocks shallow block j stands for."""
        i = self.kept[j]
        start, n = self._run_of(i)
        return n - 2 if n >= MIN_BLOCKS and i == start + 1 else 1

    def _run_of(self, i: int) -> tuple[int, int]:
        return next((s, n) for s, n in self.runs if s <= i < s + n)

    def reduced_key(self, j: int) -> str:
        return str(j) if self.renumbers else self.keys[self.kept[j]]

    def prefix(self) -> str:
        return self.container + "."

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> RepeatedBlocks:
        runs = tuple(tuple(r) for r in d.get("runs", ()))
        return cls(d["container"], tuple(d["keys"]), bool(d["renumbers"]), runs)  # type: ignore[arg-type]


def _structure(mod: nn.Module) -> tuple:
    return (
        type(mod),
        tuple((n, tuple(p.shape), p.dtype, p.requires_grad) for n, p in mod.named_parameters()),
        tuple((n, tuple(b.shape), b.dtype) for n, b in mod.named_buffers()),
        tuple((n, type(m)) for n, m in mod.named_modules()),
    )


def _runs(children: list[nn.Module]) -> tuple[tuple[int, int], ...]:
    """(first position, length) of each maximal run of structurally identical children."""
    runs: list[tuple[int, int]] = []
    prev = None
    for i, c in enumerate(children):
        st = _structure(c)
        if runs and st == prev:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((i, 1))
        prev = st
    return tuple(runs)


def find_repeated_blocks(model: nn.Module, named: Sequence[str] = ()) -> list[RepeatedBlocks]:
    """Outermost containers (never the root) with a run of >= MIN_BLOCKS structurally
    identical children, and the containers `named` whatever their runs (a pipeline stage
    holding a few blocks of a stack: each is still a block to recompute or gather again)."""
    found: list[RepeatedBlocks] = []
    for name, mod in model.named_modules():
        if not name or any(name.startswith(b.prefix()) for b in found):
            continue
        if not isinstance(mod, (nn.ModuleList, nn.ModuleDict, nn.Sequential)):
            continue
        children = list(mod.named_children())
        runs = _runs([c for _n, c in children])
        if not runs or (max(n for _s, n in runs) < MIN_BLOCKS and name not in named):
            continue
        keys = tuple(n for n, _c in children)
        found.append(RepeatedBlocks(name, keys, not isinstance(mod, nn.ModuleDict), runs))
    return found


def shallow_copy(model: nn.Module, blocks: list[RepeatedBlocks]) -> nn.Module:
    """A structural copy of `model` (on meta) keeping only the blocks in `RepeatedBlocks.kept`."""
    out = copy.deepcopy(model)
    for b in blocks:
        parent_name, _, attr = b.container.rpartition(".")
        parent = out.get_submodule(parent_name)
        container = getattr(parent, attr)
        kids = [container.get_submodule(b.keys[i]) for i in b.kept]
        if isinstance(container, nn.ModuleDict):
            new: nn.Module = nn.ModuleDict({b.keys[i]: k for i, k in zip(b.kept, kids)})
        elif isinstance(container, nn.Sequential):
            new = nn.Sequential(*kids)
        else:
            new = nn.ModuleList(kids)
        setattr(parent, attr, new)
    return out


def block_labels(model: nn.Module, containers: list[str]) -> list[tuple[nn.Module, dict]]:
    """The annotation for everything traced inside child j of each container:
    `{LABEL_KEY: "<container>#j"}` (trace.py applies them with forward hooks)."""
    return [
        (child, {LABEL_KEY: f"{cname}#{j}"})
        for cname in containers
        for j, (_n, child) in enumerate(model.get_submodule(cname).named_children())
    ]


def read_labels(
    gm: fx.GraphModule,
    param_fqns: dict[fx.Node, str],
    containers: list[str],
    keys: dict[str, list[str]],
) -> dict[fx.Node, str]:
    """Block label of every node traced inside a block (see module docstring).

    `param_fqns` labels parameter/buffer placeholders by name; `keys[c]` lists the child
    names of container c as traced (their positions are the labels' indices)."""
    by_prefix = {f"{c}.{k}.": f"{c}#{j}" for c in containers for j, k in enumerate(keys[c])}
    labels: dict[fx.Node, str] = {}
    last = None
    for n in gm.graph.nodes:
        lab = None
        if n.op == "placeholder":
            fqn = param_fqns.get(n)
            if fqn is not None:
                lab = next((v for p, v in by_prefix.items() if fqn.startswith(p)), None)
        elif n.op == "call_function":
            lab = (n.meta.get("custom") or {}).get(LABEL_KEY)
            if lab is None:
                # e.g. a mixed-precision cast of a block's parameter, made before the blocks run
                ins = {labels.get(a) for a in n.all_input_nodes}
                lab = ins.pop() if len(ins) == 1 else None
            lab = lab or last
            if lab is not None:
                last = lab
        if lab is not None:
            labels[n] = lab
    return labels


def weights_of(labels: dict[fx.Node, str], blocks: list[RepeatedBlocks]) -> dict[fx.Node, int]:
    """Objective weight of each node of a shallow trace (only those != 1)."""
    by_name = {b.container: b for b in blocks}
    out = {}
    for n, lab in labels.items():
        cname, _, j = lab.rpartition("#")
        w = by_name[cname].multiplicity(int(j))
        if w != 1:
            out[n] = w
    return out


def reduced_fqn(fqn: str, blocks: list[RepeatedBlocks]) -> str:
    """Name in the shallow copy of the parameter/buffer `fqn` of the full model."""
    for b in blocks:
        if fqn.startswith(b.prefix()):
            key, _, rest = fqn[len(b.prefix()) :].partition(".")
            j = b.representative(b.keys.index(key))
            return f"{b.prefix()}{b.reduced_key(j)}.{rest}"
    return fqn


def name_pattern(fqn: str) -> str:
    """A parameter's name with list/dict indices wildcarded: `layers.7.attention.wq.weight`
    -> `layers.*.attention.wq.weight` (how plans group repeated layers)."""
    return ".".join("*" if part.isdigit() else part for part in fqn.split("."))
