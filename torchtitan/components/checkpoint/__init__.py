"""Distributed checkpoints: periodic save, resume, initial weights and model-only export.

A checkpoint is a `torch.distributed.checkpoint` (DCP) folder
`{dump_folder}/{checkpoint.folder}/step-{N}`. Its keys are the model's parameters by
fully qualified name at the top level (so a model-only checkpoint and a full one look
alike to a weights-only loader), plus one entry per stateful component: "optimizer",
"lr_scheduler", "dataloader" and those passed as `states` (e.g. "train_state").
Model and optimizer states go through DCP's state-dict helpers, so a checkpoint saved
under one mesh (FSDP, TP, one rank) loads under any other. Values that are the same on
every rank (dataloader position, step, scheduler) are written once: DCP's save planner
keeps a single copy of items with the same key.

Atomic visibility: a save writes into `step-N.tmp-<run id>`; DCP returns only after
every rank wrote its files and the coordinator wrote `.metadata`, and rank 0 then
renames the folder to `step-N`. So a `step-N` folder is complete by construction; a
`.tmp-` folder is an interrupted save, reported and deleted when the next job starts.

Integrity: before that rename, `checksums.json` is written into the folder: every
file's size and BLAKE2b-256 digest (`{"format": 1, "hash": "blake2b-256", "files":
{name: {"size": n, "blake2b": hex}}}`), itself via a temporary name, fsync and rename,
so it is part of the atomic commit. Every rank hashes the files it wrote, in parallel,
and rank 0 merges the parts and adds `.metadata`: this assumes a filesystem shared by
all ranks (as DCP's file storage and the rename already do). `.metadata` records that
the checkpoint carries a manifest (a mark in DCP's `StorageMeta.modules`). Before a
load, sizes are checked, then every rank hashes its share of the files
(`verify_checkpoint(share=...)`) and the verdicts are gathered; a checkpoint that does
not match (flipped bytes, truncated or missing file, manifest missing though
`.metadata` says there is one) is skipped with a warning naming the file, and the
newest intact one loads. Checkpoints written before manifests existed have no mark:
they load unverified, with a warning. Hashing reads every byte once, about a second
per GB, divided among the ranks, at each save and at each load.

Asynchronous saves (`--checkpoint.async_mode async`): the state is staged in memory,
and writing, hashing and the commit run in a background thread while training goes
on; at most one save is in flight (the next save, and `close()`, wait for it), and a
crash before its commit leaves the previous checkpoint the newest intact one.

Loading never unpickles arbitrary objects: the `.metadata` file goes through an
allowlisting unpickler and non-tensor values through `torch.load(weights_only=True)`,
so non-tensor state must be plain Python values (int, float, str, bytes, lists, dicts).

Modules: `folders` (finding, completing and purging checkpoint folders), `manifest`
(checksums: build, write, verify; the writer that marks `.metadata`), `safe_load`
(restricted unpickling and weights-only loading) and `manager` (`CheckpointManager`).
"""

from torchtitan.components.checkpoint.folders import (
    MANIFEST,
    is_complete,
    purge_old,
    scan_folder,
)
from torchtitan.components.checkpoint.manager import CheckpointManager
from torchtitan.components.checkpoint.manifest import (
    build_manifest,
    verify_checkpoint,
    write_manifest,
)
from torchtitan.components.checkpoint.safe_load import SafeLoadPlanner, SafeReader, read_keys

__all__ = [
    "MANIFEST",
    "CheckpointManager",
    "SafeLoadPlanner",
    "SafeReader",
    "build_manifest",
    "is_complete",
    "purge_old",
    "read_keys",
    "scan_folder",
    "verify_checkpoint",
    "write_manifest",
]
