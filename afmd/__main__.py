import sys

from afmd.cli.main import main

sys.exit(main())
