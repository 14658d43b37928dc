"""Run reports: PNG plots and a Markdown summary computed from a run directory's own logs
(`tpurl report`, and at the end of `tpurl train`)."""
