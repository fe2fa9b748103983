"""The benchmark suite of evictlayers: ``python -m benchmarks [--quick] [--only NAME ...]``.

One module per benchmark family (``decode``, ``overhead``, ``prefill``, ``memory``, ``kernel``);
``suite`` runs them and ``report`` writes ``benchmarks/results/<machine>.json`` and ``.md``. Every
ratio is taken against a baseline measured in the same run. See ``benchmarks/README.md``.
"""
