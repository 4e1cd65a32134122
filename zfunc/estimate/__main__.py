"""``python -m zfunc.estimate``: zfunc/estimate/cli.py."""
from .cli import main

raise SystemExit(main())
