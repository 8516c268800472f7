"""A results file shared by drivers: each owns a section between its markers, and a rewrite keeps the others'.

results/qos.md is the scheduling driver's table followed by the admission driver's section; each driver rewrites
only its own part, without importing the other.

Example::

    write_section(Path("results/qos.md"), "admission", lines)   # between <!-- measure_admission --> markers
    write_keeping_sections(Path("results/qos.md"), lines)       # the file's own part; every section kept after it
"""
from __future__ import annotations

import re
from pathlib import Path


def markers(name: str) -> tuple[str, str]:
    """The lines that open and close the section ``name``."""
    return f"<!-- measure_{name} -->", f"<!-- /measure_{name} -->"


def write_section(out: Path, name: str, lines: list[str]) -> None:
    """Replace the section ``name`` in ``out`` with ``lines`` (appended where it has none)."""
    begin, end = markers(name)
    text = out.read_text() if out.exists() else ""
    section = "\n".join([begin] + lines + [end])
    if begin in text and end in text:
        text = text[:text.index(begin)] + section + text[text.index(end) + len(end):]
    else:
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    out.write_text(text)


def write_keeping_sections(out: Path, lines: list[str]) -> None:
    """Write ``lines`` as ``out``'s own part, keeping every driver's section that followed it."""
    old = out.read_text() if out.exists() else ""
    first = re.search(r"<!-- measure_\w+ -->", old)
    kept = "\n" + old[first.start():] if first else ""
    out.write_text("\n".join(lines) + kept)
