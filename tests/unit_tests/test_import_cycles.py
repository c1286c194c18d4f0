"""`scripts/check_import_cycles.py`: the package has no import circle, and one is found."""

from pathlib import Path

import check_import_cycles  # scripts/, on pytest's pythonpath

REPO = Path(__file__).resolve().parents[2]


def test_torchtitan_has_no_import_circle(capsys):
    assert check_import_cycles.main([str(REPO / "torchtitan")]) == 0
    assert capsys.readouterr().out == ""


def test_a_circle_through_a_late_import_is_found(tmp_path, capsys):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from .a import f\n")
    (pkg / "a.py").write_text("from .b import g\n\ndef f():\n    return g()\n")
    (pkg / "b.py").write_text("def g():\n    from . import c\n    return c\n")
    (pkg / "c.py").write_text("from pkg.a import f\n")
    assert check_import_cycles.main([str(pkg)]) == 1
    assert capsys.readouterr().out == "import circle: pkg.a <-> pkg.b <-> pkg.c\n"
