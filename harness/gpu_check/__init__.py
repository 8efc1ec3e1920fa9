"""The GPU check's body, which ``scripts/gpu_check.py`` drives: its plan (``gpu_plan``), its
stages (``gpu_stages``) and what they use (the SDPA probe, the engine profile, a seeded
model of SmolLM2's shapes). A floor above the oracle and the benchmarks: it runs both."""
