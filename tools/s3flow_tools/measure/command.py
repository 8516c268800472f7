"""The measurement drivers' command line: each is ``python -m s3flow_tools.measure.<name>``, its module docstring
(the example at its end included) its ``--help``.

Example (a driver's ``main``)::

    p = command(__file__, __doc__)
    p.add_argument("--out", type=Path, default=ROOT / "results" / "x.md")
"""
from __future__ import annotations

import argparse
from pathlib import Path


def command(module_file: str, doc: str) -> argparse.ArgumentParser:
    """The parser of the driver in ``module_file`` (its ``__file__``), described by ``doc`` as written."""
    return argparse.ArgumentParser(prog=f"python -m s3flow_tools.measure.{Path(module_file).stem}", description=doc,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
