"""A schema's fidelity report on sampled prompts (`report.py`)."""
