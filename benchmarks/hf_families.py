"""Which Hugging Face causal-LM families the planner runs exactly: 4 CPU ranks, dp2×tp2.

    .venv/bin/python benchmarks/hf_families.py [--steps 3] [model_type ...]

For each `transformers` model type (default: the list below, the usual decoder families and
a few encoders with an LM head), its default config shrunk to 2 layers, hidden 64, vocab 128,
dropout 0 (`tests/integration_tests/hf_models.py: tiny_config`) is built by the
`hf_auto_parallel` spec's builder and checked by `tests/integration_tests/autoparallel_numerics.py
hf:<type> dp2tp2` against one process: init bitwise, then forward and every gradient at every
step.  A family that fails is listed with the first error line, so the table says what does
not get there and why.  Writes benchmarks/hf_families.md between the markers; given some
model types, re-measures just their rows and keeps the others.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
from bench_lib import write_table  # noqa: E402

FAMILIES = [
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "gemma",
    "gemma2",
    "gemma3_text",
    "phi",
    "phi3",
    "olmo",
    "olmo2",
    "gpt2",
    "gpt_neo",
    "gpt_neox",
    "gptj",
    "gpt_bigcode",
    "opt",
    "bloom",
    "falcon",
    "starcoder2",
    "stablelm",
    "cohere",
    "granite",
    "mpt",
    "persimmon",
    "codegen",
    "xglm",
    "biogpt",
    "smollm3",
    "glm",
    "glm4",
    "helium",
    "nemotron",
    "exaone4",
    "ernie4_5",
    "seed_oss",
    "internlm3",
    "bitnet",
    "arcee",
    "apertus",
    "hunyuan_v1_dense",
    "cwm",
    "lfm2",
    "diffllama",
    "minicpm3",
    "deepseek_v3",
    "mixtral",
    "qwen3_moe",
    "olmoe",
    "mamba",
    "bert",
    "roberta",
    "bart",
    "openai-gpt",
    "ctrl",
]


def run_family(model_type: str, steps: int) -> tuple[str, str]:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=4",
        str(REPO / "tests/integration_tests/autoparallel_numerics.py"),
        f"hf:{model_type}",
        "dp2tp2",
    ]
    env = dict(
        os.environ,
        AP_STEPS=str(steps),
        OMP_NUM_THREADS="1",
        PYTHONHASHSEED="0",
        PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
    )
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env, cwd=REPO)
        out = res.stdout + res.stderr
    except subprocess.TimeoutExpired:
        return "timeout", "over 900 s"
    tag = f"hf:{model_type}/dp2tp2"
    if "ALL OK" in out:
        fwd = re.search(rf"OK   {re.escape(tag)} forward x{steps} max err (\S+)", out)
        grad = re.search(rf"OK   {re.escape(tag)} grads x{steps} max err (\S+)", out)
        return "exact", f"forward {fwd.group(1)}, gradients {grad.group(1)}"
    errors = [
        ln.strip()
        for ln in out.splitlines()
        if re.match(r"^(\[rank0\]:)?\S*(Error|Exception)\b.*: ", ln.strip())
        and "ChildFailedError" not in ln
        and "gloo" not in ln
    ]
    first = errors[0] if errors else out.strip().splitlines()[-1]
    first = re.sub(r"^\[rank0\]:", "", first)
    if "init_weights left" in first or "init bitwise" in first:
        stage = "init"  # the model's own init_weights does not set every value after to_empty
    elif first.startswith("AssertionError"):
        stage = "numerics"
    else:
        stage = "plan or run"
    return f"fails ({stage})", first[:220].replace("|", "\\|")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("families", nargs="*", default=FAMILIES)
    args = parser.parse_args()
    # a run over some families re-measures their rows of the table and keeps the others
    rows = {} if args.families == FAMILIES else _table_rows(HERE / "hf_families.md")
    for mt in args.families:
        t0 = time.perf_counter()
        result, detail = run_family(mt, args.steps)
        rows[mt] = f"| {mt} | {result} | {detail} | {time.perf_counter() - t0:.0f} |"
        print(rows[mt], flush=True)
    lines = ["| model type | result | detail | s |", "|---|---|---|---|"]
    lines += [rows[mt] for mt in FAMILIES if mt in rows]
    lines += [row for mt, row in rows.items() if mt not in FAMILIES]
    exact = sum(" | exact | " in row for row in rows.values())
    lines += [
        "",
        f"**{exact} of {len(rows)} families exact** (dp2×tp2, {args.steps} AdamW "
        "steps, every gradient every step, fp32 tolerance 1e-5)",
    ]
    table = "\n".join(lines)
    print(table)
    write_table(HERE / "hf_families.md", table)


def _table_rows(markdown_file: Path) -> dict[str, str]:
    rows = {}
    for line in markdown_file.read_text().splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if line.startswith("| ") and len(cells) == 4 and cells[0] not in ("model type", "---"):
            rows[cells[0]] = line
    return rows


if __name__ == "__main__":
    main()
