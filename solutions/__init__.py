"""Reference answers to ``exercises/``: same functions, same signatures."""
