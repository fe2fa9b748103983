"""The research behind evictlayers' shipped recipes: the papers' claims, the recipe search's candidates,
the tuning / held-out retrieval reports and the per-head needle dumps, with their raw runs.

Not part of the installed package (``pip install .`` leaves it out); it imports evictlayers and runs from
the repository root. README.md here lists the commands.
"""
