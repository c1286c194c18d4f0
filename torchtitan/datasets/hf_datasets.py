"""Text datasets for pre-training: loading, tokenizing, packing and per-rank splitting.

Named datasets live in ``DATASETS``. ``titan_corpus`` (the default) ships with the repo
in ``tests/assets/titan_corpus`` and needs no network; ``c4`` and ``c4_validation``
stream from the Hugging Face Hub and fail with an ``AssetError`` when it is unreachable.

``training.dataset_path`` replaces the dataset's location with a local file or folder
(the registered name then only labels the run). Supported files, chosen by suffix:

* ``.jsonl`` / ``.json``: one JSON object per line, or a JSON list of objects; the
  document is the ``"text"`` field.
* ``.parquet``: the ``text`` column, one document per row.
* ``.txt``: one document per paragraph; paragraphs are separated by blank lines.

A folder means every such file below it (hidden ones excluded), in sorted path order.
Files must be UTF-8.  A bad file (not UTF-8, a malformed JSON line, a record without a
string ``"text"``, no text at all) raises an ``AssetError`` naming the file and line;
``check_local_dataset`` finds these with the same readers before any rank starts.
"""

import itertools
import json
import logging
import os
import socket
import threading
import urllib.parse
import urllib.request
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from torch.distributed.checkpoint.stateful import Stateful
from torch.utils.data import DataLoader, IterableDataset

from torchtitan.components.errors import AssetError
from torchtitan.errors import UserInputError

logger = logging.getLogger(__name__)

_REPO_ROOT = Path(__file__).resolve().parents[2]
_LOCAL_SUFFIXES = (".jsonl", ".json", ".parquet", ".txt")


# ---------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------


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


# Every reader yields ``(text, bytes_read)`` for each document of one file: the text,
# already validated, and how many bytes of the file had been read when it was produced
# (the file's size once the whole file is in memory).  Training reads every document;
# ``check_local_dataset`` reads the first ones of each file through the same readers.
# A bad file raises a one-line ``AssetError``: ``<file>:<line>: <problem>; <fix>``.


def _not_utf8(file: Path, line: int, offset: int, byte: int) -> AssetError:
    return AssetError(
        f"{file}:{line}: not UTF-8 text (byte 0x{byte:02x} at byte offset {offset}); "
        "convert the file to UTF-8 (e.g. iconv -f latin1 -t utf-8 IN > OUT)"
    )


def _decode(file: Path, data: bytes) -> str:
    """``data``, all of ``file``, as text (a UTF-8 byte order mark is dropped)."""
    try:
        return data.decode("utf-8").removeprefix("\ufeff")
    except UnicodeDecodeError as e:
        raise _not_utf8(file, data.count(b"\n", 0, e.start) + 1, e.start, data[e.start]) from e


def _lines(file: Path) -> Iterator[tuple[int, str, int]]:
    """``(line number, line without its newline, bytes read)`` for each line of a UTF-8 file."""
    offset = 0
    with file.open("rb") as f:
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise _not_utf8(file, lineno, offset + e.start, raw[e.start]) from e
            offset += len(raw)
            if lineno == 1:
                line = line.removeprefix("\ufeff")
            yield lineno, line.removesuffix("\n").removesuffix("\r"), offset


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _record_text(where: str, record: Any) -> str:
    """The ``"text"`` of one JSON record; ``where`` (``file:line``) names it in errors."""
    if not isinstance(record, dict):
        raise AssetError(
            f'{where}: expected a JSON object with a "text" field, got {_type_name(record)}; '
            "fix or remove that record"
        )
    if "text" not in record:
        keys = ", ".join(list(record)[:8]) or "none"
        raise AssetError(
            f'{where}: the record has no "text" field (its keys: {keys}); every record needs one'
        )
    text = record["text"]
    if not isinstance(text, str):
        raise AssetError(
            f'{where}: "text" must be a string, got {_type_name(text)}; fix or remove that record'
        )
    return text


def _json_hint(file: Path) -> str:
    if file.suffix != ".json":
        return ""
    return " (a .json file holds a JSON list of objects, or one object per line)"


def _json_lines_texts(file: Path) -> Iterator[tuple[str, int]]:
    """One JSON object per line; blank lines are skipped."""
    for lineno, line, read in _lines(file):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise AssetError(
                f"{file}:{lineno}: not valid JSON ({e.msg} at column {e.colno}){_json_hint(file)}; "
                "fix or remove that line"
            ) from e
        yield _record_text(f"{file}:{lineno}", record), read


def _json_list_texts(file: Path) -> Iterator[tuple[str, int]]:
    """A JSON list of objects, parsed whole (JSON cannot be parsed in part)."""
    data = file.read_bytes()
    try:
        records = json.loads(_decode(file, data))
    except json.JSONDecodeError as e:
        raise AssetError(
            f"{file}:{e.lineno}: not valid JSON ({e.msg} at column {e.colno}){_json_hint(file)}; "
            "fix the file"
        ) from e
    for number, record in enumerate(records, 1):
        yield _record_text(f"{file}: record {number}", record), len(data)


def _starts_a_list(file: Path) -> bool:
    """Whether the first character of ``file`` other than whitespace (and a BOM) is ``[``."""
    with file.open("rb") as f:
        head = f.read(4096).removeprefix(b"\xef\xbb\xbf")
        while head and not head.lstrip():
            head = f.read(4096)
    return head.lstrip().startswith(b"[")


def _read_json_texts(file: Path) -> Iterator[tuple[str, int]]:
    if file.suffix == ".json" and _starts_a_list(file):
        return _json_list_texts(file)
    return _json_lines_texts(file)


def _read_parquet_texts(file: Path) -> Iterator[tuple[str, int]]:
    """The ``text`` column, row by row; bytes read are estimated from the row count."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    def unreadable(e: Exception) -> AssetError:
        reason = " ".join(str(e).split())[:200]
        return AssetError(
            f"{file}: not a readable parquet file ({reason}); "
            "rewrite it or move it out of the dataset path"
        )

    try:
        parquet = pq.ParquetFile(file)
    except (pa.ArrowException, OSError) as e:
        raise unreadable(e) from e
    schema = parquet.schema_arrow
    if schema.get_field_index("text") < 0:
        columns = ", ".join(schema.names[:8]) or "none"
        raise AssetError(f'{file}: the parquet file needs a "text" column (its columns: {columns})')
    kind = schema.field("text").type
    if not (
        pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_string_view(kind)
    ):
        raise AssetError(
            f'{file}: the "text" column must hold strings, got {kind}; convert it to strings'
        )
    size, rows, row = file.stat().st_size, max(parquet.metadata.num_rows, 1), 0
    try:
        for batch in parquet.iter_batches(columns=["text"]):
            for text in batch.column(0).to_pylist():
                if text is None:
                    raise AssetError(
                        f'{file}: row {row} (counting from 0): "text" is null; '
                        "fill or drop that row"
                    )
                row += 1
                yield text, size * row // rows
    except (pa.ArrowException, OSError) as e:
        raise unreadable(e) from e


def _read_txt_texts(file: Path) -> Iterator[tuple[str, int]]:
    """One document per paragraph; paragraphs are separated by blank (whitespace-only) lines."""
    paragraph: list[str] = []
    read = 0
    for _, line, read in _lines(file):
        if line.strip():
            paragraph.append(line)
        elif paragraph:
            yield "\n".join(paragraph).strip(), read
            paragraph = []
    if paragraph:
        yield "\n".join(paragraph).strip(), read


_READERS = {
    ".jsonl": _read_json_texts,
    ".json": _read_json_texts,
    ".parquet": _read_parquet_texts,
    ".txt": _read_txt_texts,
}


def _no_text(path: str, files: list[Path]) -> AssetError:
    fix = "add documents, or point --training.dataset_path at other files"
    if len(files) == 1:
        return AssetError(f"{files[0]} holds no text (the file is empty or blank); {fix}")
    named = ", ".join(str(f) for f in files[:3]) + (
        f" and {len(files) - 3} more" if len(files) > 3 else ""
    )
    return AssetError(f"dataset path '{path}' holds no text: {named} are empty or blank; {fix}")


def load_local_dataset(path: str):
    """A map-style ``datasets.Dataset`` with one ``text`` row per document found at ``path``.

    Files are read directly (no ``load_dataset``), so nothing is cached or downloaded.
    """
    import datasets

    files = _local_files(_resolve_local(path))
    texts = [text for file in files for text, _ in _READERS[file.suffix](file)]
    if not any(text.strip() for text in texts):
        raise _no_text(path, files)
    return datasets.Dataset.from_dict({"text": texts})


def _format_bytes(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024:
            break
        size /= 1024
    else:
        unit = "TiB"
    return f"{n} B" if unit == "B" else f"{size:.1f} {unit}"


def _sample_file(file: Path, share: int) -> tuple[int, int, bool]:
    """``(bytes read, documents, any text)`` reading ``file`` until ``share`` bytes are read.

    At least the first document is read; a file already in memory is read to the end.
    """
    size = file.stat().st_size
    count, has_text = 0, False
    documents = _READERS[file.suffix](file)
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


def _hub_offline() -> bool:
    import datasets

    flags = (os.environ.get(k, "").upper() for k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))
    return any(f in ("1", "ON", "YES", "TRUE") for f in flags) or bool(
        datasets.config.HF_HUB_OFFLINE
    )


_HUB_PROBE_TIMEOUT_S = 3.0


def _first_hop(endpoint: str) -> tuple[str, int]:
    """``(host, port)`` a request to ``endpoint`` connects to: its proxy if one applies."""
    url = urllib.parse.urlsplit(endpoint)
    if not url.hostname:
        raise ValueError("no host name")
    proxies = urllib.request.getproxies()
    proxy = proxies.get(url.scheme) or proxies.get("all")
    if proxy and not urllib.request.proxy_bypass(url.hostname):
        url = urllib.parse.urlsplit(proxy if "://" in proxy else f"http://{proxy}")
    return url.hostname, url.port or (443 if url.scheme == "https" else 80)


def _hub_unreachable() -> str | None:
    """Why the hub (``HF_ENDPOINT``) cannot be reached, or ``None`` when it can.

    A TCP connect to the endpoint or its proxy, given ``_HUB_PROBE_TIMEOUT_S`` seconds in
    all: it runs in a daemon thread because a name lookup has no timeout of its own.
    """
    endpoint = os.environ.get("HF_ENDPOINT") or "https://huggingface.co"
    try:
        host, port = _first_hop(endpoint)
    except ValueError as e:
        return f"HF_ENDPOINT '{endpoint}' is not a usable URL: {e}"
    failures: list[str | None] = []

    def connect() -> None:
        try:
            socket.create_connection((host, port), timeout=_HUB_PROBE_TIMEOUT_S).close()
            failures.append(None)
        except OSError as e:
            failures.append(f"{type(e).__name__}: {e}")

    probe = threading.Thread(target=connect, name="hub-probe", daemon=True)
    probe.start()
    probe.join(_HUB_PROBE_TIMEOUT_S)
    if not failures:
        return f"no connection to {endpoint} ({host}:{port}) within {_HUB_PROBE_TIMEOUT_S:g} s"
    return failures[0] and f"cannot connect to {endpoint} ({host}:{port}): {failures[0]}"


def load_hub_dataset(path: str, *, name: str | None, split: str):
    """A streaming dataset from the Hub; any failure becomes a one-line ``AssetError``.

    The hub is probed first, so that offline a run fails in seconds rather than after
    ``load_dataset``'s retries.
    """
    import datasets

    def no_hub(reason: str) -> AssetError:
        reason = " ".join(reason.split())[:300]
        return AssetError(
            f"cannot load '{path}' from the Hugging Face Hub ({reason}); no hub access: use "
            "--training.dataset titan_corpus (ships with the repo) or --training.dataset_path "
            "<local .jsonl/.json/.parquet/.txt file or folder>"
        )

    if _hub_offline():
        raise no_hub("offline mode is set by HF_HUB_OFFLINE/HF_DATASETS_OFFLINE")
    unreachable = _hub_unreachable()
    if unreachable:
        raise no_hub(unreachable)
    try:
        return datasets.load_dataset(path, name=name, split=split, streaming=True)
    except Exception as e:  # connection, auth, missing repo: all mean "not usable here"
        raise no_hub(f"{type(e).__name__}: {e}") from e


def _text_field(sample: dict[str, Any]) -> str:
    return sample["text"]


@dataclass(frozen=True)
class DatasetConfig:
    """Where a named dataset lives, how to load it, and how to get a document's text."""

    path: str
    loader: Callable[[str], Any]
    text_processor: Callable[[dict[str, Any]], str] = _text_field


DATASETS: dict[str, DatasetConfig] = {
    "titan_corpus": DatasetConfig(path="tests/assets/titan_corpus", loader=load_local_dataset),
    "c4": DatasetConfig(
        path="allenai/c4", loader=partial(load_hub_dataset, name="en", split="train")
    ),
    "c4_validation": DatasetConfig(
        path="allenai/c4", loader=partial(load_hub_dataset, name="en", split="validation")
    ),
}


def resolve_dataset(dataset_name: str, dataset_path: str | None) -> tuple[str, DatasetConfig]:
    """(path, config) to load: the registered location, or ``dataset_path`` as a local override."""
    if dataset_name not in DATASETS:
        raise AssetError(
            f"unknown dataset '{dataset_name}'; registered datasets: {', '.join(sorted(DATASETS))} "
            "(or set --training.dataset_path to a local file or folder)"
        )
    config = DATASETS[dataset_name]
    if dataset_path:
        return dataset_path, DatasetConfig(dataset_path, load_local_dataset, config.text_processor)
    return config.path, config


def check_dataset(training: Any) -> str:
    """What preflight checks of `[training]`'s data before any rank starts: local files
    parsed (`check_local_dataset`), a hub dataset opened; a line saying what was checked."""
    path, config = resolve_dataset(training.dataset, training.dataset_path)
    if config.loader is load_local_dataset:
        return f"{path}: {check_local_dataset(path)}"
    config.loader(path)
    return f"{path}: opened"


# ---------------------------------------------------------------------------------------
# Tokenizing and packing
# ---------------------------------------------------------------------------------------


class HuggingFaceDataset(IterableDataset, Stateful):
    """Packed ``(input_ids, labels)`` samples of length ``seq_len`` for one data-parallel rank.

    Documents are tokenized with BOS and EOS and appended to a token buffer; every
    ``seq_len + 1`` buffered tokens ``w`` become one window ``(w[:-1], w[1:])``, without
    padding or overlap.  All ranks read the same window stream and cut it into global
    batches of ``local_batch_size × dp_world_size`` windows; rank r takes the r-th slice
    of each.  So the global batch at every step is the same whatever the data-parallel
    degree — 4 ranks see exactly what 1 rank with a 4× local batch sees, which is what
    makes losses comparable across meshes and the data position reshardable.  The price:
    every rank tokenizes the whole stream (cheap next to a training step at the batch
    sizes here; a per-document split would scale better and lose both properties).

    With ``infinite=True`` the data is re-read from the start whenever it runs out;
    otherwise iteration ends before an incomplete global batch.  Between global batches
    ``state_dict()`` (document position and leftover token buffer) is identical on every
    rank, and a dataset restored with ``load_state_dict()`` yields exactly the samples
    the original would have yielded next — under any dp degree.
    """

    def __init__(
        self,
        dataset_name: str,
        dataset_path: str | None,
        tokenizer,
        seq_len: int = 2048,
        dp_rank: int = 0,
        dp_world_size: int = 1,
        infinite: bool = False,
        local_batch_size: int = 1,
    ):
        import datasets

        path, config = resolve_dataset(dataset_name, dataset_path)
        logger.info("Preparing dataset %s from %s", dataset_name, path)
        data = config.loader(path)
        self.dataset_name = dataset_name
        self._path = path
        self.seq_len = seq_len
        self.infinite = infinite
        self._data = data
        self._dp_rank = dp_rank
        self._dp_world_size = dp_world_size
        self._local_batch_size = local_batch_size
        self._map_style = isinstance(self._data, datasets.Dataset)
        self._text_processor = config.text_processor
        self._tokenizer = tokenizer

        self._epoch = 0
        self.reloops = 0  # re-loops in this process (not checkpointed; for logging)
        self._sample_idx = 0  # documents of this epoch already tokenized (map-style only)
        self._token_buffer: list[int] = []

    def _documents(self) -> Iterator[dict[str, Any]]:
        """The remaining documents of the current epoch."""
        if self._map_style:
            if self._sample_idx < len(self._data):  # select() rejects an empty range at the end
                yield from self._data.select(range(self._sample_idx, len(self._data)))
        else:
            self._data.set_epoch(self._epoch)
            yield from self._data

    def _drain(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Every full window in the token buffer, oldest first."""
        window = self.seq_len + 1
        while len(self._token_buffer) >= window:
            x = torch.tensor(self._token_buffer[:window], dtype=torch.long)
            self._token_buffer = self._token_buffer[window:]
            yield x[:-1], x[1:]

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        global_batch = self._local_batch_size * self._dp_world_size
        start = self._dp_rank * self._local_batch_size
        windows = self._windows()
        while True:
            # Read the whole global batch before yielding this rank's share, so that when
            # the share is consumed the stream position is the same on every rank.
            batch = list(itertools.islice(windows, global_batch))
            if len(batch) < global_batch:
                return
            yield from batch[start : start + self._local_batch_size]

    def _windows(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The global stream of packed windows, continuing from the current position."""
        first_pass = True
        while True:
            yield from self._drain()  # a restored buffer may already hold full windows
            documents_read = 0
            for sample in self._documents():
                self._token_buffer.extend(self._tokenizer.encode(self._text_processor(sample)))
                self._sample_idx += 1
                documents_read += 1
                yield from self._drain()
            if not self.infinite:
                logger.info("Dataset %s is exhausted", self.dataset_name)
                return
            if documents_read == 0 and not first_pass:
                raise AssetError(
                    f"dataset '{self.dataset_name}' ({self._path}) has no documents; point "
                    "--training.dataset or --training.dataset_path at data with text"
                )
            first_pass = False
            self._epoch += 1
            self._sample_idx = 0
            self._log_reloop()

    def _log_reloop(self) -> None:
        """A warning at the first re-loop; later ones go to debug level, with their count."""
        self.reloops += 1
        if self.reloops == 1:
            logger.warning(
                "Dataset %s is being re-looped (later re-loops are logged at debug level)",
                self.dataset_name,
            )
        else:
            logger.debug("Dataset %s re-looped %d times", self.dataset_name, self.reloops)

    def state_dict(self) -> dict[str, Any]:
        state = {"epoch": self._epoch, "token_buffer": list(self._token_buffer)}
        if self._map_style:
            state["sample_idx"] = self._sample_idx
        else:
            state["data"] = self._data.state_dict()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._epoch = state_dict["epoch"]
        self._token_buffer = list(state_dict["token_buffer"])
        if self._map_style:
            self._sample_idx = state_dict["sample_idx"]
        else:
            self._data.set_epoch(self._epoch)
            self._data.load_state_dict(state_dict["data"])


# ---------------------------------------------------------------------------------------
# Batching
# ---------------------------------------------------------------------------------------


def _collate(
    samples: list[tuple[torch.Tensor, torch.Tensor]],
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    inputs, labels = zip(*samples)
    return {"input": torch.stack(inputs)}, torch.stack(labels)


class ParallelAwareDataloader(DataLoader, Stateful):
    """Batches of ``({"input": LongTensor[b, seq_len]}, labels LongTensor[b, seq_len])``.

    A plain single-process ``DataLoader``: with ``num_workers=0`` the dataset's state after
    a batch is the loader's state.  Because every rank reads the same window stream (see
    ``HuggingFaceDataset``), that state is the same on all ranks after each step and does
    not depend on the dp degree: a checkpoint's data position loads under any mesh.
    Stored as JSON bytes (no pickled objects).
    """

    def __init__(self, dataset: HuggingFaceDataset, batch_size: int):
        super().__init__(dataset, batch_size=batch_size, num_workers=0, collate_fn=_collate)

    def state_dict(self) -> dict[str, bytes]:
        return {"dataset": json.dumps(self.dataset.state_dict()).encode("utf-8")}

    def load_state_dict(self, state_dict: dict[str, bytes]) -> None:
        """Restore the stream position; an empty ``state_dict`` is a no-op (nothing saved)."""
        if not state_dict:
            return
        if "dataset" not in state_dict:
            raise UserInputError(
                f"dataloader checkpoint has no 'dataset' entry (it holds "
                f"{', '.join(sorted(state_dict))}); was it written by another trainer version?"
            )
        self.dataset.load_state_dict(json.loads(state_dict["dataset"]))


def build_hf_dataloader(
    dp_world_size: int, dp_rank: int, tokenizer, job_config, infinite: bool = True
) -> ParallelAwareDataloader:
    """The training dataloader described by ``job_config.training``.

    Reads ``dataset``, ``dataset_path``, ``local_batch_size`` and ``seq_len``.
    """
    training = job_config.training
    dataset = HuggingFaceDataset(
        dataset_name=training.dataset,
        dataset_path=getattr(training, "dataset_path", None),
        tokenizer=tokenizer,
        seq_len=training.seq_len,
        dp_rank=dp_rank,
        dp_world_size=dp_world_size,
        infinite=infinite,
        local_batch_size=training.local_batch_size,
    )
    return ParallelAwareDataloader(dataset, training.local_batch_size)
