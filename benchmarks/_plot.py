"""Figures for the benchmark tables, drawn only when a script is given `--plot PATH`.

matplotlib is imported here, on first use, so the benchmarks run without it
(`pip install -e ".[benchmark]"` brings it).
"""


def pyplot():
    """matplotlib's pyplot on the file-only Agg back end, or a clear error naming the extra."""
    try:
        import matplotlib
    except ImportError as e:
        raise SystemExit(f"--plot needs matplotlib: pip install -e \".[benchmark]\" ({e})")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def save(fig, path):
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"\nplot written to {path}")
