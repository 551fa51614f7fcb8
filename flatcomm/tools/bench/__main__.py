import sys

from flatcomm.tools.bench import main

sys.exit(main())
