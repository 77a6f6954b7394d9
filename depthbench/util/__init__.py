"""Low-level helpers every layer uses: the error types and atomic file writes."""
