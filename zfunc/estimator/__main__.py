"""``python -m zfunc.estimator``: zfunc/estimator/cli.py."""
from .cli import main

raise SystemExit(main())
