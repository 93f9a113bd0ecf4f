"""A schema's fidelity report: sampled prompts (`samples.py`) run in every fidelity mode and compared
against exact (`report.py`). Kept free of imports so the modules load on their own.
"""
