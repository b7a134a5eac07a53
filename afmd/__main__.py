import sys

from afmd.cli import main

sys.exit(main())
