"""Harnesses that run whole experiments through the composition root (fault runs, the sMoE
online run): above every package they drive, beside the CLI and the demo."""
