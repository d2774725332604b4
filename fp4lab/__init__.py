"""fp4lab: find out which FP4 training recipe trains a language model stably and fast.

Importing this package is cheap on purpose: torch is imported only by the modules (and CLI
commands) that need it, so `fp4lab --help` stays fast.
"""

__version__ = "0.1.0"
