"""Local datasets: a file or folder of ``.jsonl``/``.json``/``.parquet``/``.txt`` files.

``training.dataset_path`` (or a registered local dataset such as ``titan_corpus``) names
a file or a folder; a folder means every such file below it (hidden ones excluded), in
sorted path order, each read by the reader for its suffix (``file_readers``).  Files must
be UTF-8.  A bad file (not UTF-8, a malformed JSON line, a record without a string
``"text"``, no text at all) raises an ``AssetError`` naming the file and line;
``check_local_dataset`` finds these with the same readers before any rank starts.
"""

from dataclasses import dataclass
from pathlib import Path

from torchtitan.components.errors import AssetError
from torchtitan.datasets.file_readers import READERS

_REPO_ROOT = Path(__file__).resolve().parents[2]
_LOCAL_SUFFIXES = (".jsonl", ".json", ".parquet", ".txt")


def _resolve_local(path: str) -> Path:
    """``path`` if it exists; a relative path is tried from the cwd, then from the repo root."""
    given = Path(path).expanduser()
    candidates = [given] if given.is_absolute() else [given, _REPO_ROOT / given]
    for candidate in candidates:
        if candidate.exists():
            return candidate
    raise AssetError(
        f"dataset path '{path}' does not exist (resolved to {given.resolve()}): set "
        "--training.dataset_path to a local .jsonl/.json/.parquet/.txt file or a folder of them"
    )


def _local_files(root: Path) -> list[Path]:
    if root.is_file():
        files = [root] if root.suffix in _LOCAL_SUFFIXES else []
    else:
        files = sorted(
            (
                p
                for p in root.rglob("*")
                if p.is_file()
                and p.suffix in _LOCAL_SUFFIXES
                and not any(part.startswith(".") for part in p.relative_to(root).parts)
            ),
            key=lambda p: p.relative_to(root).as_posix(),
        )
    if not files:
        raise AssetError(f"dataset path '{root}' holds no {'/'.join(_LOCAL_SUFFIXES)} files")
    return files


def _no_text(path: str, files: list[Path]) -> AssetError:
    fix = "add documents, or point --training.dataset_path at other files"
    if len(files) == 1:
        return AssetError(f"{files[0]} holds no text (the file is empty or blank); {fix}")
    named = ", ".join(str(f) for f in files[:3]) + (
        f" and {len(files) - 3} more" if len(files) > 3 else ""
    )
    return AssetError(f"dataset path '{path}' holds no text: {named} are empty or blank; {fix}")


@dataclass(frozen=True)
class LocalDocuments:
    """The documents of a local dataset, in order: map-style (a length, and row ``i`` as
    ``{"text": ...}``), as the packing dataset reads them.  Kept as plain strings rather
    than a ``datasets.Dataset``: files read directly need nothing of that library, so a
    launch on local data does not import it."""

    texts: tuple[str, ...]

    def __len__(self) -> int:
        return len(self.texts)

    def __getitem__(self, i: int) -> dict[str, str]:
        return {"text": self.texts[i]}


def load_local_dataset(path: str) -> LocalDocuments:
    """One ``text`` row per document found at ``path``.

    Files are read directly (no ``load_dataset``), so nothing is cached or downloaded.
    """
    files = _local_files(_resolve_local(path))
    texts = [text for file in files for text, _ in READERS[file.suffix](file)]
    if not any(text.strip() for text in texts):
        raise _no_text(path, files)
    return LocalDocuments(tuple(texts))


def _format_bytes(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    size = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        size /= 1024
        if size < 1024 or unit == "TiB":
            break
    return f"{size:.1f} {unit}"


def _sample_file(file: Path, share: int) -> tuple[int, int, bool]:
    """``(bytes read, documents, any text)`` reading ``file`` until ``share`` bytes are read.

    At least the first document is read; a file already in memory is read to the end.
    """
    size = file.stat().st_size
    count, has_text = 0, False
    documents = READERS[file.suffix](file)
    for text, read in documents:
        count += 1
        has_text = has_text or bool(text.strip())
        if share <= read < size:
            documents.close()
            return read, count, has_text
    return size, count, has_text


def check_local_dataset(path: str, max_bytes: int = 64 * 2**20) -> str:
    """Parse the local data at ``path`` with training's readers; a summary of what was read.

    Raises the ``AssetError`` a rank would raise on a bad file.  Data of up to
    ``max_bytes`` in total is read whole.  Larger data is sampled: every file is read from
    its start for an equal share of ``max_bytes`` (a share a smaller file leaves unused
    passes on to the next ones), and at least up to its first document — so a file that is
    not UTF-8, not JSON or has no text column is caught wherever it is, but a bad record
    deep inside a big file is not.  A ``.json`` list is parsed whole whatever its size.

    Returns e.g. ``"checked 3 files, 12,345 documents (all)"`` or ``"checked 3 files,
    812 documents (64.0 MiB of 10.0 GiB sampled: the start of each file)"``.
    """
    files = _local_files(_resolve_local(path))
    total = sum(file.stat().st_size for file in files)
    checked, documents, has_text = 0, 0, False
    for i, file in enumerate(files):
        read, count, text = _sample_file(file, max(max_bytes - checked, 0) // (len(files) - i))
        checked, documents, has_text = checked + read, documents + count, has_text or text
    complete = checked >= total
    if complete and not has_text:
        raise _no_text(path, files)
    scope = "all"
    if not complete:
        scope = (
            f"{_format_bytes(checked)} of {_format_bytes(total)} sampled: the start of each file"
        )
    plural = "s" if len(files) != 1 else ""
    return f"checked {len(files)} file{plural}, {documents:,} documents ({scope})"
