"""``python -m moefleet`` runs the CLI (same as the ``moefleet`` script)."""

from moefleet.cli import main

main()
