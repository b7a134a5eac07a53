"""Entry point of the frozen ``afmd`` binary (PyInstaller runs this as ``__main__``)."""

import sys

from afmd.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
