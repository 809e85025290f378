import sys

from trajforge.training.cli import main

sys.exit(main())
