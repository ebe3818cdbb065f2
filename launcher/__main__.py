"""`python -m launcher`: see launcher/__init__.py."""

import sys

from launcher.run import main

sys.exit(main())
