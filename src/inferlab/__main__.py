import sys

from inferlab.cli import main

sys.exit(main())
