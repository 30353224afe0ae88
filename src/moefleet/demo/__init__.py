"""The end-to-end demo job (``moefleet demo``)."""
