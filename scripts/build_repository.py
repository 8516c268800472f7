#!/usr/bin/env python3
"""Build the Triton model repository from a checkpoint, or seeded random weights: ``s3flow.repository.cli``
(``--help`` lists the options and examples). Exits non-zero on any failure."""
import sys

from s3flow.repository.cli import main

if __name__ == "__main__":
    sys.exit(main())
