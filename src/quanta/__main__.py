import sys

from quanta.cli.main import main

sys.exit(main())
