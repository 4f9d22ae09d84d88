"""Model code, weight loading and tokenizers.

Import the submodules directly (``servelm.models.loader``); this package
imports nothing so that torch-free code (the API) can use the registry.
"""
