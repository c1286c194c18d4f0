"""Build the repo's offline English-ish text corpus from the Python standard library.

Every machine with Python has the stdlib sources, and their docstrings and comments
are plain English prose about programming. This script turns them into
``tests/assets/titan_corpus/data.jsonl``: one ``{"text": ...}`` line per source file,
holding that file's prose (docstrings and comment blocks, in source order, separated
by blank lines).

The output is a pure function of the stdlib sources: files are visited in sorted
order, a fixed filter is applied, and JSON is written with fixed settings, so two
runs on the same Python version give the same bytes. A different Python version has
different sources and therefore gives a different (equally valid) corpus.

Usage::

    python scripts/build_corpus.py [--stdlib DIR] [--out FILE] [--max-bytes N]
"""

import argparse
import ast
import io
import json
import re
import sysconfig
import tokenize
from pathlib import Path

# Directories whose files are skipped: tests, vendored code, tools and generated data
# (plus any ``config-*`` build directory).
EXCLUDED_DIRS = frozenset(
    {
        "__pycache__",
        "encodings",
        "ensurepip",
        "idlelib",
        "lib2to3",
        "lib-dynload",
        "pydoc_data",
        "site-packages",
        "test",
        "tests",
        "turtledemo",
    }
)

DEFAULT_OUT = Path(__file__).resolve().parents[1] / "tests/assets/titan_corpus/data.jsonl"
DEFAULT_MAX_BYTES = 3_000_000

_WORD = re.compile(r"[A-Za-z]{2,}")
# Comments that are tooling directives rather than prose.
_DIRECTIVE = re.compile(r"^(!|-\*-|coding[:=]|noqa|type:|pragma|fmt:|pylint|XXX$)")


def is_prose(text: str) -> bool:
    """The fixed filter: at least 5 words, and letters make up >= 60% of the visible characters."""
    visible = [c for c in text if not c.isspace()]
    if len(_WORD.findall(text)) < 5 or not visible:
        return False
    return sum(c.isalpha() for c in visible) / len(visible) >= 0.6


def strip_doctests(text: str) -> str:
    """Drop interactive examples: a ``>>>`` line and everything up to the next blank line."""
    kept, in_example = [], False
    for line in text.split("\n"):
        if line.lstrip().startswith(">>>"):
            in_example = True
        elif not line.strip():
            in_example = False
        if not in_example:
            kept.append(line)
    return re.sub(r"\n{3,}", "\n\n", "\n".join(kept)).strip()


def _docstrings(tree: ast.Module) -> list[tuple[int, str]]:
    """(line, cleaned docstring) of the module and of every class and function."""
    nodes = [tree] + [
        n
        for n in ast.walk(tree)
        if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
    ]
    found = []
    for node in nodes:
        doc = ast.get_docstring(node, clean=True)
        if doc:
            found.append((getattr(node, "lineno", 0), strip_doctests(doc)))
    return found


def _comment_blocks(source: str) -> list[tuple[int, str]]:
    """(first line, text) of each run of comments on consecutive lines."""
    blocks: list[tuple[int, list[str]]] = []
    last_line = -2
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type != tokenize.COMMENT:
            continue
        text = tok.string.lstrip("#").strip()
        line = tok.start[0]
        if _DIRECTIVE.match(text):
            continue
        if line == last_line + 1 and blocks:
            blocks[-1][1].append(text)
        else:
            blocks.append((line, [text]))
        last_line = line
    return [(line, "\n".join(lines).strip()) for line, lines in blocks]


def extract_prose(source: str) -> str:
    """All docstrings and comment blocks of one source file that pass the filter, in line order."""
    try:
        tree = ast.parse(source)
        pieces = _docstrings(tree) + _comment_blocks(source)
    except (SyntaxError, tokenize.TokenError, ValueError):
        return ""
    pieces.sort(key=lambda item: item[0])  # stable: docstring before a comment on the same line
    return "\n\n".join(text for _, text in pieces if is_prose(text))


def iter_source_files(root: Path) -> list[Path]:
    """All ``.py`` files under ``root`` outside EXCLUDED_DIRS, sorted by relative POSIX path."""
    files = [
        p
        for p in root.rglob("*.py")
        if not any(
            part in EXCLUDED_DIRS or part.startswith("config-")
            for part in p.relative_to(root).parts[:-1]
        )
    ]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def build_corpus(root: Path, max_bytes: int = DEFAULT_MAX_BYTES) -> bytes:
    """The jsonl bytes for the corpus built from ``root``; stops before exceeding ``max_bytes``."""
    out = bytearray()
    for path in iter_source_files(root):
        with tokenize.open(path) as f:  # honours PEP 263 encoding declarations
            source = f.read()
        text = extract_prose(source)
        if not text:
            continue
        line = json.dumps({"text": text}, ensure_ascii=False) + "\n"
        encoded = line.encode("utf-8")
        if len(out) + len(encoded) > max_bytes:
            break
        out += encoded
    return bytes(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--stdlib", type=Path, default=Path(sysconfig.get_paths()["stdlib"]))
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--max-bytes", type=int, default=DEFAULT_MAX_BYTES)
    args = parser.parse_args()
    data = build_corpus(args.stdlib, args.max_bytes)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_bytes(data)
    n_docs = data.count(b"\n")
    print(f"wrote {args.out}: {n_docs} documents, {len(data)} bytes")


if __name__ == "__main__":
    main()
