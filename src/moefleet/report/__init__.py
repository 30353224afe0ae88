"""Reports: tables and plots."""
