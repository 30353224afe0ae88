"""The composition root: the one place that turns a model, a plan (or none), an expert
stack, a backend and a store into a running engine and its biller."""
