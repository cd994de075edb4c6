"""``python -m rankwatch.exporter.cli``: the ``rankwatch`` command."""

import sys

from rankwatch.exporter.cli.main import main

sys.exit(main())
