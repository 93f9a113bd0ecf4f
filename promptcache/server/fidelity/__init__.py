"""A schema's fidelity report (`report.py`) on sampled prompts (`samples.py`); no imports, so each loads alone."""
