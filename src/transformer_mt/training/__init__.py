"""Training with Lightning: the LightningModule (module.py), what a run tells a person and how it
ends (callbacks.py), where its lines and metrics go (logs.py), exact resume (resume.py), and FSDP (sharding.py)."""
