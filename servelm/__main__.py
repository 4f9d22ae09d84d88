"""``python -m servelm``: the same as the ``servelm`` command."""

from servelm.cli import main

raise SystemExit(main())
