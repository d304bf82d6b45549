"""``python -m meshkit.doctor`` is not a command: it points to ``meshkit doctor`` and exits 2."""

if __name__ == "__main__":  # a library package, not a command: point to its verb (meshkit.cli.VERBS), exit 2
    import sys

    print("meshkit.doctor is not a command: run `meshkit doctor` (or `python -m meshkit doctor`).", file=sys.stderr)
    raise SystemExit(2)
