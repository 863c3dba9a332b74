import sys

from xdplb.agent.wire import main

sys.exit(main())
