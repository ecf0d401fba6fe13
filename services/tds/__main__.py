"""`python -m services.tds --address 127.0.0.1:PORT --es-url URL`."""

import sys

from services.tds.server import main

sys.exit(main())
