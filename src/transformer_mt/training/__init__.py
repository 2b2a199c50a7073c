"""Training with Lightning. A map of the wing:
fit.py          one run from its composed config: the Trainer's arguments, data, module, callbacks, fit, the end
module.py       the LightningModule: the loss, Adam with the Noam schedule (or a time budget's), validation
update.py       an optimizer update, its one wait for the device, and UpdateEnd, the one owner of what follows it
budget.py       trainer.max_time as a time budget: one object that the schedule, the step limit and the saves read
saving.py       every checkpoint written during training (periodic, best, last.ckpt), atomically, at update ends
resume.py       resuming exactly: every rank's random state, which checkpoint a run continues from
callbacks.py    what a run tells a person: progress lines, the start-up line, the update bar, the end's summary
logs.py         where a run's lines and metrics go: the log file, CSV, TensorBoard, Weights & Biases
ema.py          an exponential moving average of the weights, beside them
batch_fit.py    data.max_tokens=auto: the largest micro-batch a GPU's memory holds, the fastest per token on a CPU
sharding.py     FSDP, one unit per layer, and a whole copy of the model for decoding
"""
