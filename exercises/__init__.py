"""Your code: one module per chapter. Fill in the stubs; grade with ``kvlab grade chNN``."""
