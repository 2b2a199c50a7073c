"""Training with Lightning: the LightningModule (module.py), the optimizer update's bookkeeping and its one
wait for the device (update.py), what a run tells a person and how it ends (callbacks.py), where its lines
and metrics go (logs.py), checkpoints and exact resume (resume.py), FSDP (sharding.py), the end-of-run
protocol (final.py), the moving average of the weights (ema.py) and data.max_tokens=auto (batch_fit.py)."""
