import sys

from bench.runner import main

sys.exit(main())
