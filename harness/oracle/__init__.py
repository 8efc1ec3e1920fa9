"""What decides whether the paged run is right: dense generation with HF's own cache, the
three checks, and ``run_equivalence`` that runs them per request."""
