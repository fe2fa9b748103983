"""``python -m benchmarks``: see ``benchmarks.suite``."""

from benchmarks.suite import main

if __name__ == "__main__":
    main()
