import sys

from dsv41.checkpoints import main

sys.exit(main())
