"""Readers of local dataset files, one per suffix: ``READERS[file.suffix](file)``.

Every reader yields ``(text, bytes_read)`` for each document of one file: the text,
already validated, and how many bytes of the file had been read when it was produced
(the file's size once the whole file is in memory).  Training reads every document;
``check_local_dataset`` reads the first ones of each file through the same readers.
A bad file raises a one-line ``AssetError``: ``<file>:<line>: <problem>; <fix>``.

* ``.jsonl`` / ``.json``: one JSON object per line, or a JSON list of objects; the
  document is the ``"text"`` field.
* ``.parquet``: the ``text`` column, one document per row.
* ``.txt``: one document per paragraph; paragraphs are separated by blank lines.
"""

import json
from collections.abc import Callable, Generator, Iterator
from pathlib import Path
from typing import Any

from torchtitan.components.errors import AssetError


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


def _json_lines_texts(file: Path) -> Generator[tuple[str, int], None, None]:
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


def _json_list_texts(file: Path) -> Generator[tuple[str, int], None, None]:
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


def _read_json_texts(file: Path) -> Generator[tuple[str, int], None, None]:
    if file.suffix == ".json" and _starts_a_list(file):
        return _json_list_texts(file)
    return _json_lines_texts(file)


def _read_parquet_texts(file: Path) -> Generator[tuple[str, int], None, None]:
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


def _read_txt_texts(file: Path) -> Generator[tuple[str, int], None, None]:
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


READERS: dict[str, Callable[[Path], Generator[tuple[str, int], None, None]]] = {
    ".jsonl": _read_json_texts,
    ".json": _read_json_texts,
    ".parquet": _read_parquet_texts,
    ".txt": _read_txt_texts,
}
