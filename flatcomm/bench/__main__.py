import sys

from flatcomm.bench import main

sys.exit(main())
