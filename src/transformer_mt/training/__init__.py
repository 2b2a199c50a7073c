"""Training with Lightning. A map of the wing:

fit.py          one run from its composed config: the Trainer's arguments, data, module, callbacks, fit, the end
module.py       the LightningModule: the loss, Adam with the Noam schedule (or a budget's), validation
update.py       the optimizer update's bookkeeping (tokens, gradient normalisation and norm, stop signals) and
                its one wait for the device; every callback asks it whether an update just ended
saving.py       every checkpoint written during training (periodic, best, last.ckpt), atomically, at update ends
resume.py       resuming exactly: every rank's random state, which checkpoint a run continues from
callbacks.py    what a run tells a person (progress lines, start-up line, update bar) and how it ends (signals)
logs.py         where a run's lines and metrics go: the log file, CSV, TensorBoard, Weights & Biases
ema.py          an exponential moving average of the weights, beside them
batch_fit.py    data.max_tokens=auto: the largest micro-batch a GPU's memory holds, the fastest per token on a CPU
budget.py       trainer.max_time as a time budget: the schedule's horizon from the measured speed, ending inside it
sharding.py     FSDP, one unit per layer, and a whole copy of the model for decoding
"""
