"""Training sluice's own draft heads (``sluice train-heads``). Serving never imports this package:
``engine.cli`` reaches it only inside the ``train-heads`` command (tests/unit/test_import_cycles.py
holds the package free of import cycles and keeps serving code from importing it)."""
