"""Command-line interface: one module per verb (see quanta.cli.main.VERBS)."""
