"""Tests of the research code; pytest collects them beside tests/ (pyproject.toml\x27s testpaths)."""
