"""`python -m launcher`: see launcher/__init__.py. A bad configuration or a finished run folder is refused
before the stack's modules are imported (launcher/cli.py)."""

import sys

from launcher.cli import early_exit

code = early_exit(sys.argv[1:])
if code is None:
    from launcher.run import main
    from rlcommon.entrypoint import exit_process

    exit_process(main())  # its services are stopped and its files written: no interpreter teardown
sys.exit(code)
