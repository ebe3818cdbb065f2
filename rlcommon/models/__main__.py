"""`python -m rlcommon.models --preset tiny [--out DIR]`: the builder's CLI (`rlcommon.models.builder.main`)."""

import sys

from rlcommon.models.builder import main

if __name__ == "__main__":
    sys.exit(main())
