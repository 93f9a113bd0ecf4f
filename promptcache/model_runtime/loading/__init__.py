"""Loading a model and laying out its weights at load time (`loader.py` is the entry point). Kept free of
imports so importing one module does not load the others."""
