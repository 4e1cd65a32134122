"""``python -m zfunc.checkpoint consolidate|export-hf ...`` (zfunc.checkpoint.cli)."""
import sys

from .cli import main

sys.exit(main())
