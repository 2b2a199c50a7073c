"""Training with Lightning: the LightningModule (module.py), what a run tells a person and how it
ends (callbacks.py), where its lines and metrics go (logs.py), and exact resume (resume.py)."""
